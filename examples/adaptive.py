"""The dpcs Runtime's demonstration: `python examples/train_gpt.py --adaptive` (CPU by default).

    python examples/train_gpt.py --adaptive [--steps 40] [--overflow-step 8] [--squeeze-step 26] [--release-step 34]
                                            [--compiler eager|inductor] [--out benchmarks/results/runtime_demo_cpu]

A small GPT trains in bf16 through dpcs under a Runtime that reads its signals every step:
1. at --overflow-step its gradients overflow (a gradient set to inf; the optimizer skips the step, as
   GradScaler would): the precision policy promotes to fp32 at once, and the next step compiles the fp32
   variant, once;
2. after the cooldown and patience it demotes back to bf16, reusing the cached bf16 variant (no compile);
3. at --squeeze-step the budget is squeezed (`Runtime.force_budget`, 85% of the peak the current plan
   predicts): that step compiles a tighter plan, whose measured peak is lower; at --release-step the
   override is cleared and the loose variant comes back from the cache.
It prints each step's variant and compiles, and writes the telemetry, its plot and a summary JSON (device,
torch version, the events and the measured peaks) under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dpcs_compiler import MemoryPolicy, PrecisionPolicy, Runtime
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.debug.telemetry_plot import plot_telemetry
from dpcs_compiler.measure import measure_peak_memory, resident_bytes
from dpcs_compiler.models import workload
from dpcs_compiler.runtime import read_telemetry


def main(argv: list[str], defaults: argparse.Namespace) -> None:
    parser = argparse.ArgumentParser(prog="train_gpt.py --adaptive", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--overflow-step", type=int, default=8)
    parser.add_argument("--squeeze-step", type=int, default=26)
    parser.add_argument("--release-step", type=int, default=34)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/runtime_demo_cpu"))
    args = parser.parse_args(argv)
    if not 1 < args.overflow_step < args.squeeze_step - 1 < args.release_step - 1 < args.steps:
        parser.error("need 1 < --overflow-step < --squeeze-step - 1 < --release-step - 1 < --steps")
    console = Console(width=200)
    device = defaults.device
    w = workload("gpt", defaults.batch, layers=defaults.layers)
    model = w.model.to(device)
    inputs = tuple(x.to(device) for x in w.inputs)
    compiled = torch.compile(
        model, backend="dpcs", options={"compiler": defaults.compiler, "precision": "bf16", "on_infeasible": "best"}
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args.out.mkdir(parents=True, exist_ok=True)
    telemetry = args.out / "telemetry.jsonl"
    precision = PrecisionPolicy(modes=("fp32", "bf16"), patience=4, cooldown=8, per_region=False)
    runtime = Runtime(model, policies=[precision, MemoryPolicy()], telemetry=telemetry, signal_every=1,
                      telemetry_every=5)
    telemetry.write_text("")  # this run's telemetry only

    def forward_backward() -> torch.Tensor:
        loss = compiled(*inputs)
        loss.backward()
        return loss

    rows, peaks, notes = [], {}, {}
    resident = resident_bytes([*model.parameters(), *model.buffers(), *inputs])
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step == args.squeeze_step:
            [graph] = runtime.graphs
            budget = int(0.85 * graph.records[graph.current_key][0].predicted_peak_bytes)
            runtime.force_budget(budget)
            notes[step] = f"force_budget({budget}) before it"
        if step == args.release_step:
            runtime.clear_overrides()
            notes[step] = "clear_overrides() before it"
        compiled_before = len(runtime.compile_events)
        optimizer.zero_grad(set_to_none=True)
        label = {args.squeeze_step - 1: "before squeeze", args.squeeze_step + 1: "squeezed"}.get(step)
        step_start = time.perf_counter()
        if label is not None:
            loss, peak = measure_peak_memory(forward_backward, device=device)
            # The step's peak as the plan counts it: what it adds on top of parameters, buffers and inputs.
            peaks[label] = resident + peak.peak_increase_bytes
            runtime.telemetry.record({"step": step, "kind": "measured", "step_peak_bytes": peaks[label]})
        else:
            loss = forward_backward()
        seconds = time.perf_counter() - step_start
        ran = runtime.decisions.describe()
        overflow = step == args.overflow_step
        if overflow:
            model.lm_head.weight.grad[0, 0] = float("inf")  # skipped below, as GradScaler skips a step that overflowed
        else:
            optimizer.step()
        changed = runtime.step(loss=loss, optimizer=optimizer)
        new = runtime.compile_events[compiled_before:]
        rows.append({
            "step": step, "ran": ran, "loss": round(loss.item(), 4), "seconds": round(seconds, 3),
            "compiled": [f"{e.decisions} ({e.seconds:.2f} s)" for e in new], "overflow_injected": overflow,
            "decided": None if changed is None else changed.describe(),
            "reason": "; ".join(f"{p.name}: {p.reason}" for p in runtime.policies if p.reason) if changed else None,
            "note": notes.get(step),
        })
    wall = time.perf_counter() - start
    runtime.close()

    table = Table(title="dpcs Runtime, step by step (decisions take effect at the next step)")
    for column in ("step", "ran", "loss", "time", "compiled in this step", "decided after it", "override"):
        table.add_column(column)
    for r in rows:
        marked = r["compiled"] or r["decided"] or r["overflow_injected"] or r["note"] or r["step"] in (1, args.steps)
        if marked:
            table.add_row(str(r["step"]), r["ran"], f"{r['loss']:.4f}" + (" (overflow injected)" if r["overflow_injected"] else ""),
                          f"{r['seconds']:.2f} s", ", ".join(r["compiled"]) or "-",
                          "-" if r["decided"] is None else f"{r['decided']}: {r['reason']}", r["note"] or "-")
    console.print(table)
    checks = demonstration_checks(rows, args, peaks)
    for name, ok in checks.items():
        console.print(f"{'ok ' if ok else 'NOT'} {name}", markup=False, highlight=False)
    console.print(
        f"measured peak of one step: {format_bytes(peaks['before squeeze'])} before the squeeze, "
        f"{format_bytes(peaks['squeezed'])} with the tighter plan "
        f"({(peaks['squeezed'] - peaks['before squeeze']) / peaks['before squeeze']:+.1%})",
        markup=False, highlight=False,
    )
    plot = plot_telemetry(read_telemetry(telemetry), args.out / "telemetry.png",
                          title="dpcs Runtime demonstration: MiniGPT on " + device)
    summary = {
        "device": device if device != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "compiler": defaults.compiler, "batch": defaults.batch, "layers": defaults.layers,
        "steps": rows, "measured_peak_bytes": peaks, "checks": checks, "wall_seconds": round(wall, 2),
        "compile_events": [e.to_json() for e in runtime.compile_events],
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"telemetry {telemetry}, plot {plot}, summary {args.out / 'summary.json'}", markup=False, highlight=False)


def demonstration_checks(rows: list[dict], args: argparse.Namespace, peaks: dict[str, int]) -> dict[str, bool]:
    """What the demonstration shows, each as a check on the steps it ran."""
    by_step = {r["step"]: r for r in rows}
    k = args.overflow_step
    promoted = by_step[k]["decided"] == "fp32"
    fp32_compiles = [r["step"] for r in rows if any(c.startswith("fp32 (") for c in r["compiled"])]
    demoted = [r["step"] for r in rows if r["step"] > k and r["decided"] == "bf16"]
    back_in_bf16 = demoted and by_step[demoted[0] + 1]["ran"] == "bf16" and not by_step[demoted[0] + 1]["compiled"]
    squeezed = by_step[args.squeeze_step]
    released = by_step[args.release_step]
    return {
        f"the overflow at step {k} promoted to fp32 at once": promoted,
        f"step {k + 1} compiled the fp32 variant, once in the run": fp32_compiles == [k + 1],
        "after the cooldown the runtime demoted to bf16 and reused the cached variant (no compile)": bool(back_in_bf16),
        f"step {args.squeeze_step} compiled the squeezed plan": any("budget" in c for c in squeezed["compiled"]),
        "the squeezed plan's measured peak is lower": peaks["squeezed"] < peaks["before squeeze"],
        f"step {args.release_step} went back to the loose plan without compiling": not released["compiled"],
    }
