"""A small GPT trained through the dpcs backend: the README's main job.

    python examples/train_gpt.py [--steps 20] [--batch 8] [--layers 2] [--compiler inductor|eager] [--device cpu]

Prints what dpcs did for each compiled graph (nodes, values saved for backward, predicted peak) and how
the step measured up: predicted vs measured peak memory and median step time.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from dpcs_compiler import compile_records
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.measure import measure_training_step
from dpcs_compiler.models import workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--compiler", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    console = Console(width=110)

    w = workload("gpt", args.batch, layers=args.layers)
    model = w.model.to(args.device)
    inputs = tuple(x.to(args.device) for x in w.inputs)
    compiled = torch.compile(model, backend="dpcs", options={"compiler": args.compiler})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    start = time.perf_counter()
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(*inputs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    wall = time.perf_counter() - start
    console.print(
        f"trained MiniGPT ({args.layers} layers, batch {args.batch}x{model.cfg.block_size} tokens) for {args.steps} "
        f"steps on {args.device} through dpcs ({args.compiler}): loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{wall:.1f} s including compilation"
    )

    training = [r for r in compile_records() if r.mode == "training"]
    predicted = training[0].predicted_peak_bytes if len(training) == 1 else None
    measured = measure_training_step(
        model, compiled, inputs, loss_fn=w.loss_fn, device=args.device, predicted_peak_bytes=predicted
    )
    table = Table(title="what dpcs decided, per compiled graph")
    for column in ("graph", "mode", "nodes fwd/bwd", "saved for backward", "predicted peak", "peak at", "dpcs time"):
        table.add_column(column)
    for r in compile_records():
        table.add_row(
            r.graph, r.mode, f"{r.forward_nodes}/{r.backward_nodes}", f"{r.saved_values} values, {format_bytes(r.saved_bytes)}",
            format_bytes(r.predicted_peak_bytes), r.peak_node or "-", f"{sum(r.pass_seconds.values()):.2f} s",
        )
    console.print(table)
    error = measured.relative_error
    console.print(
        f"graphs compiled: {len(compile_records())}; predicted peak {format_bytes(measured.predicted_peak_bytes)}, "
        f"measured peak {format_bytes(measured.measured_peak_bytes)} "
        f"({'n/a' if error is None else f'{error * 100:+.1f}%'}); parameters+inputs {format_bytes(measured.resident_bytes)}; "
        f"median step {measured.step_seconds * 1e3:.1f} ms (forward+backward)"
    )
    console.print(
        "dpcs partitions with torch's min-cut for now: the memory planner (a real-peak budget) is not built yet, "
        "so nothing is recomputed or offloaded beyond what min-cut chooses."
    )


if __name__ == "__main__":
    main()
