"""A small GPT trained through the dpcs backend: the README's main job.

    python examples/train_gpt.py [--model gpt|breaks] [--steps 20] [--batch 8] [--layers 2] [--compiler inductor|eager]
                                 [--device cpu]
                                 [--budget-fraction 0.8] [--precision fp32|bf16] [--fp8 tensorwise|rowwise]
                                 [--telemetry runs/telemetry.jsonl] [--adaptive]

Trains the model through dpcs with a memory budget of `--budget-fraction` times the peak the same step
measures without a plan (torch's min-cut partition; AdamW's fp32 state counted in), with a CompressedOptimizer
whose state dpcs keeps as it chooses (states="auto"), then prints what dpcs decided for each compiled graph
(values saved, recomputed, offloaded; budget; predicted peak), how it keeps the optimizer's state, the
peak's split (parameters, optimizer state, the rest), and what it saved: measured peak and median step time
with the budget against without it. `--precision` and `--fp8` apply to both runs
(on a CPU, bf16/fp16/fp8 matmuls are far slower than fp32: use them there to see memory, not speed).
The plan is costed with the hardware profile DPCS_HARDWARE_PROFILE names ("h100" plans for that GPU from
here), else this machine's, measured once and cached; the printout names it and each plan's hash.
The budget bounds the whole step: `--model breaks` trains a model whose step Dynamo splits into three graphs
(a data-dependent branch and a `print`); dpcs learns the step's order on its first run and re-plans the
graphs so that together they fit, and prints the step's predicted peak (one number, with the graph and node).
The training loop runs under a dpcs Runtime (default policies), which writes its telemetry to --telemetry
(`dpcs plot` draws it).

--adaptive runs the Runtime's demonstration instead (`adaptive.py` beside this file): bf16 training whose
gradients overflow at one step, the promotion to fp32 and the demotion back, then a budget squeeze.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from rich.console import Console
from rich.table import Table

from dpcs_compiler import CompressedOptimizer, Runtime, compile_records
from dpcs_compiler.report import describe_step, predicted_step_peak
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.debug.summary import hardware_lines
from dpcs_compiler.measure import measure_training_step, optimizer_state_bytes, resident_bytes
from dpcs_compiler.models import workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "breaks"], default="gpt",
                        help="MiniGPT (one graph), or a model with two graph breaks (three graphs per step)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--compiler", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget-fraction", type=float, default=0.8, help="budget / the unplanned measured peak")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="fp16 needs a GradScaler loop")
    parser.add_argument("--fp8", choices=["tensorwise", "rowwise"], default=None, help="fp8 linears with this recipe")
    parser.add_argument("--telemetry", default="runs/telemetry.jsonl", help="where the Runtime writes its telemetry")
    parser.add_argument("--adaptive", action="store_true", help="run the Runtime's demonstration (adaptive.py)")
    args, rest = parser.parse_known_args()
    if args.adaptive:
        from adaptive import main as adaptive_main

        adaptive_main(rest, defaults=args)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # On a CPU fp8 is never faster, so fp8's default choice ("faster") would keep every linear: convert them all
    # there, to see fp8's memory and numerics; on a GPU, the linears the profile says are faster in fp8.
    fp8 = None if args.fp8 is None else {"recipe": args.fp8, "min_size": 64,
                                         "select": "all" if args.device == "cpu" else "auto"}
    precision = {"precision": args.precision, "fp8": fp8}
    console = Console(width=200)

    # "breaks": rows of 128 features, as many as the GPT's tokens (batch x 128).
    w = workload(args.model, args.batch * (128 if args.model == "breaks" else 1), layers=args.layers)
    model = w.model.to(args.device)
    inputs = tuple(x.to(args.device) for x in w.inputs)

    # AdamW's two fp32 moments are alive through every step after the first: counted in the step's peak. The
    # baseline trains a copy of the model (the same weights) with plain AdamW, its optimizer step measured too.
    adamw_state = 2 * sum(p.numel() * 4 for p in model.parameters())
    reference = copy.deepcopy(model)
    unplanned = torch.compile(reference, backend="dpcs", options={"compiler": args.compiler, **precision})
    baseline = measure_training_step(reference, unplanned, inputs, loss_fn=w.loss_fn, device=args.device,
                                     held_bytes=adamw_state,
                                     optimizer=torch.optim.AdamW(reference.parameters(), lr=3e-3))
    del reference, unplanned
    # On CUDA the budget bounds what the allocator holds, cuBLAS's workspaces too (about 65 MiB on an H200): the
    # fraction applies to the model's own peak, and what the process holds beside the model is added.
    # (less this model's own copy, alive on the device while the reference was measured)
    outside = max(0, (baseline.outside_bytes or 0) - resident_bytes([*model.parameters(), *model.buffers()]))
    budget = int(outside + args.budget_fraction * baseline.own_peak_bytes)
    beside = f" plus {format_bytes(outside)} the process holds beside the model" if outside else ""
    console.print(
        f"without a budget (torch's min-cut partition, AdamW's fp32 state {format_bytes(adamw_state)} included): "
        f"measured peak {format_bytes(baseline.measured_peak_bytes)}, median step {baseline.step_seconds * 1e3:.1f} "
        f"ms; training with memory_budget={budget} B ({format_bytes(budget)}, {args.budget_fraction:.0%} of it"
        f"{beside}), dpcs choosing how the optimizer keeps its state"
    )
    torch._dynamo.reset()
    from dpcs_compiler import clear_compile_records

    clear_compile_records()
    compiled = torch.compile(
        model,
        backend="dpcs",
        options={"compiler": args.compiler, "memory_budget": budget, "on_infeasible": "best", **precision},
    )
    # states="auto": dpcs's step planner chooses how AdamW's moments are kept (fp32, bf16, fp16, int8; in host
    # memory on a GPU), with the activation plan, under the same budget.
    optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), states="auto")
    runtime = Runtime(model, telemetry=args.telemetry)

    start = time.perf_counter()
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = w.loss_fn(compiled(*inputs))
        loss.backward()
        optimizer.step()
        runtime.step(loss=loss, optimizer=optimizer)
        losses.append(loss.item())
    wall = time.perf_counter() - start
    runtime.close()
    what = (
        f"MiniGPT ({args.layers} layers, batch {args.batch}x{model.cfg.block_size} tokens)" if args.model == "gpt"
        else f"BranchingNet ({args.layers} blocks per stack, {inputs[0].shape[0]} rows)"
    )
    console.print(
        f"trained {what} for {args.steps} "
        f"steps on {args.device} through dpcs ({args.compiler}): loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{wall:.1f} s including compilation"
    )

    step = predicted_step_peak()  # the whole step's prediction: one number, with where it happens
    predicted = step.predicted_peak_bytes if step is not None else None
    state = optimizer_state_bytes(optimizer)
    measured = measure_training_step(
        model, compiled, inputs, loss_fn=w.loss_fn, device=args.device, predicted_peak_bytes=predicted,
        held_bytes=state, optimizer=optimizer,
    )
    table = Table(title="what dpcs decided, per compiled graph")
    columns = ("graph", "mode", "precision", "nodes fwd/bwd", "saved", "recomputed", "offloaded", "budget", "plan",
               "predicted peak", "peak at", "plan hash", "dpcs time")
    for column in columns:
        table.add_column(column, no_wrap=column == "plan hash")
    for r in compile_records():
        table.add_row(
            r.graph + (f" (variant of {r.variant_of})" if r.variant_of else ""), r.mode, r.precision + (f", {r.fp8_linears} fp8 linears" if r.fp8_linears else ""),
            f"{r.forward_nodes}/{r.backward_nodes}", f"{r.saved_values} values, {format_bytes(r.saved_bytes)}",
            str(r.recomputed_values), str(r.offloaded_values), format_bytes(r.budget_bytes),
            "-" if r.plan_feasible is None else "fits" if r.plan_feasible else "over budget",
            format_bytes(r.predicted_peak_bytes), r.peak_node or "-", r.plan_hash or "-",
            f"{sum(r.pass_seconds.values()):.2f} s",
        )
    console.print(table)
    for line in hardware_lines([r.to_json() for r in compile_records()]):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if step is not None:
        console.print(describe_step(step), markup=False, highlight=False, soft_wrap=True)
    error = measured.relative_error
    console.print(
        f"graphs compiled: {len(compile_records())}; predicted step peak {format_bytes(measured.predicted_peak_bytes)}, "
        f"measured peak {format_bytes(measured.measured_peak_bytes)} "
        f"({'n/a' if error is None else f'{error * 100:+.1f}%'}; budget {format_bytes(budget)}); "
        f"parameters, inputs and optimizer state {format_bytes(measured.resident_bytes)}; median step "
        f"{measured.step_seconds * 1e3:.1f} ms"
    )
    if step is not None and step.optimizer_state is not None:
        chosen = step.optimizer_state
        kept = (f"{chosen['format']}{' in host memory' if chosen.get('on_host') else ''}" if chosen.get("chosen")
                else "as the optimizer keeps it")
        split = step.split()
        parameters = split["parameters"]
        console.print(
            f"optimizer state kept {kept}: {format_bytes(state)} (fp32: {format_bytes(adamw_state)}); the step's "
            f"peak, predicted: parameters {format_bytes(parameters)}, optimizer state "
            f"{format_bytes(split['optimizer_state'])}, other memory through the step "
            f"{format_bytes(split['outside_graphs'])}, gradients {format_bytes(split['gradients'])}, activations "
            f"{format_bytes(split['activations'])}"
            + (f", the optimizer step's temporaries {format_bytes(split['optimizer_step'])}" if split["optimizer_step"]
               else "")
            + f"; measured: parameters {format_bytes(parameters)}, "
            f"optimizer state {format_bytes(state)}, the rest {format_bytes(measured.measured_peak_bytes - parameters - state)}"
        )
    saved = baseline.measured_peak_bytes - measured.measured_peak_bytes
    console.print(
        f"saved {format_bytes(saved)} of peak memory ({saved / baseline.measured_peak_bytes:.1%}) against no budget, "
        f"at {measured.step_seconds / baseline.step_seconds:.2f}x its step time"
    )
    console.print(
        f"runtime: {runtime.step_count} steps, decisions {runtime.decisions.describe()}, "
        f"{len(runtime.compile_events)} variant(s) compiled; telemetry in {args.telemetry} "
        f"(draw it: dpcs plot {args.telemetry})",
        markup=False, highlight=False, soft_wrap=True,
    )


if __name__ == "__main__":
    main()
