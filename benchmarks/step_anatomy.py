"""Where a planned step's time goes: torch.compile's step against dpcs's at one budget, with and without offload.

    python benchmarks/step_anatomy.py [--device cuda] [--model gpt] [--budget-fractions 0.75,0.5] [--steps 10]
                                      [--warmup 2] [--profile-steps 3] [--profile PROFILE] [--out DIR]

On the H200 (2026-11-29) every dpcs plan of the bench GPT offloaded 12-13 values and ran 1.67-1.88x
`torch.compile`'s 7.9 ms step, and nothing there said where the time went. This runs three strategies on one
model in one process: `compile` (plain Inductor), and at each of `--budget-fractions` of compile's measured
peak `dpcs@F`, costed with `--profile` (default: the device's measured profile; on CPU the built-in "h100",
a GPU's, so that plans may offload), and `dpcs_no_offload@F`, the same budget with that profile's host link
removed, so the plan can only recompute. It times them interleaved (median after warm-up, as `dpcs bench` does), then runs each under
`torch.profiler` for `--profile-steps` steps and reports per step:

- host seconds in dpcs's own ops (`dpcs::offload` and the others: the rewrite's), in aten ops, and kernel
  launches (CUDA), and the device's busy time (the sum of its kernels' and copies' times) against the step's
  wall time: a step whose host issues kernels slower than the device runs them is host-bound;
- the ops with the most host time, and the plan (values offloaded, recomputed, fusions the guard refused).

Writes step_anatomy_<device type>.json under --out (device, torch version inside). On CPU the offload ops are
synchronous copies: the figures show the ops' host time and the plan's, not a GPU's overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench  # noqa: E402
from dpcs_compiler.cost.profiles import MEASURE, resolve_profile  # noqa: E402
from dpcs_compiler.models import bench_workload  # noqa: E402

TOP = 12  # ops listed per strategy


def no_host_link(profile):
    """`profile` with its host link removed: a plan costed with it cannot offload."""
    return dataclasses.replace(profile, host_to_device=None, device_to_host=None, offload_ops_s=None)


def strategies(fraction: float, budget: int, profile, compiler: str) -> list[bench.Strategy]:
    def dpcs(name: str, hardware) -> bench.Strategy:
        options = {"memory_budget": budget, "on_infeasible": "best", "compiler": compiler, "strict": True,
                   "hardware_profile": hardware}

        def build(m, outside_bytes: int = 0):
            return torch.compile(m, backend="dpcs", options={**options, "memory_budget": budget + outside_bytes},
                                 dynamic=False)

        return bench.Strategy(f"{name}@{fraction:g}", "dpcs", build, compiled=True, budget_bytes=budget,
                              budget_source=f"{fraction:g} x compile's peak")

    return [dpcs("dpcs", profile), dpcs("dpcs_no_offload", no_host_link(profile))]


def _device_seconds(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value:
            return value / 1e6
    return 0.0


def anatomy(step, steps: int, device: torch.device) -> dict[str, Any]:
    """Profile `steps` calls of `step`: per step, the host seconds by kind of op, the device's busy seconds,
    launches, and the ops with the most host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    bench._sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        bench._sync(device)
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    dpcs_s = aten_s = launch_s = device_s = 0.0
    launches = dpcs_calls = 0
    rows = []
    for e in events:
        host = e.self_cpu_time_total / 1e6
        device_s += _device_seconds(e)
        if e.key.startswith("dpcs::"):
            dpcs_s += host
            dpcs_calls += e.count
        elif e.key.startswith("aten::"):
            aten_s += host
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync"):
            launch_s += host
            launches += e.count
        rows.append({"op": e.key, "calls_per_step": e.count / steps, "host_ms_per_step": 1e3 * host / steps,
                     "device_ms_per_step": 1e3 * _device_seconds(e) / steps})
    rows.sort(key=lambda r: -r["host_ms_per_step"])
    return {
        "wall_ms_per_step": 1e3 * wall,
        "dpcs_ops_host_ms_per_step": 1e3 * dpcs_s / steps,
        "dpcs_op_calls_per_step": dpcs_calls / steps,
        "aten_host_ms_per_step": 1e3 * aten_s / steps,
        "launch_host_ms_per_step": 1e3 * launch_s / steps,
        "launches_per_step": launches / steps,
        "device_busy_ms_per_step": 1e3 * device_s / steps,
        "top_host_ops": rows[:TOP],
        "dpcs_ops": [r for r in rows if r["op"].startswith("dpcs::")],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="gpt", help="a `dpcs bench` model (default gpt)")
    parser.add_argument("--budget-fractions", default="0.75,0.5", help="of compile's measured peak, comma-separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profile", default=None,
                        help="the hardware profile dpcs plans with (default: 'measure' on CUDA, 'h100' on CPU)")
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    parser.add_argument("--quick", action="store_true", help="tiny model (tests)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    try:
        fractions = [float(x) for x in args.budget_fractions.split(",")]
    except ValueError:
        fractions = []
    if not fractions or not all(0 < f <= 1 for f in fractions):
        parser.error(f"--budget-fractions {args.budget_fractions!r} is not valid; valid choices: floats in (0, 1], "
                     "comma-separated")
    for name in ("steps", "profile_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not valid; valid choices: an int >= 1")
    device = torch.device(args.device)
    spec = args.profile or (MEASURE if device.type == "cuda" else "h100")
    resolved = resolve_profile(spec, device)
    profile = resolved.profile
    if profile.host_to_device is None:
        parser.error(f"--profile {spec!r} has no host link: dpcs could not offload with it; valid choices: a GPU "
                     "profile ('measure' on a GPU, or a built-in GPU name such as 'h100')")

    w = bench_workload(args.model, quick=args.quick)
    base = bench.LossModule(w.model, w.loss_fn).to(device)
    inputs = tuple(x.to(device) for x in w.inputs)
    backend = "inductor" if args.compiler == "inductor" else "aot_eager"
    plain = bench.Strategy("compile", "upstream", lambda m: torch.compile(
        m, backend=bench.StrategyBackend(backend, "compile"), dynamic=False), compiled=True)
    with bench.compile_afresh():
        bench.prepare(plain, base, inputs, device=device, warmup=args.warmup, sgd=False)
        if not plain.ok:
            raise RuntimeError(f"compile failed: {plain.result['error']}")
        budgets = {f: int(plain.result["peak_bytes"] * f) for f in fractions}
        runs = [plain, *(s for f, b in budgets.items() for s in strategies(f, b, profile, args.compiler))]
        for s in runs[1:]:
            bench.prepare(s, base, inputs, device=device, warmup=args.warmup, sgd=False)
            if not s.ok:
                raise RuntimeError(f"{s.name} failed: {s.result['error']}")
        bench.time_interleaved(runs, steps=args.steps, warmup=args.warmup, device=device)
        with bench.device_to_itself():
            for s in runs:
                s.result["anatomy"] = anatomy(s.step, args.profile_steps, device)
    results = {}
    for s in runs:
        r = s.result
        results[s.name] = {
            key: r.get(key) for key in ("peak_bytes", "budget_bytes", "budget_source", "predicted_peak_bytes", "step_s", "step_s_all",
                                        "offloaded_values", "recomputed_values", "plan_feasible", "error")
        }
        latest = {(x["variant_of"] or x["graph"]): x for x in r.get("records", []) if x["mode"] == "training"}
        results[s.name]["fusions_refused"] = sum(x.get("fusions_refused") or 0 for x in latest.values())
        results[s.name]["step_ratio"] = r["step_s"] / plain.result["step_s"] if r.get("step_s") else None
        results[s.name]["anatomy"] = r["anatomy"]
    payload = {
        "device": bench.device_name(device), "device_type": device.type, "torch": torch.__version__,
        "python": platform.python_version(), "compiler": args.compiler, "model": args.model, "quick": args.quick,
        "budget_fractions": fractions, "budgets_bytes": budgets,
        "profile": f"{profile.device_key} ({resolved.source})", "steps": args.steps, "warmup": args.warmup,
        "profile_steps": args.profile_steps, "strategies": results,
    }
    print_table(payload)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_anatomy_{device.type}{'_quick' if args.quick else ''}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def print_table(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{payload['model']} on {payload['device']}, torch {payload['torch']}: dpcs@F at F x compile's "
                        f"peak, plans costed with {payload['profile']}")
    for column in ("strategy", "budget MiB", "step ms", "vs compile", "peak MiB", "offloaded", "recomputed", "fusions refused",
                   "dpcs ops ms", "aten ms", "launches", "device busy ms", "profiled wall ms"):
        table.add_column(column)
    for name, r in payload["strategies"].items():
        a = r["anatomy"]
        budget = f"{r['budget_bytes'] / 2**20:.1f}" if r["budget_bytes"] else "-"
        table.add_row(name, budget, f"{1e3 * r['step_s']:.2f}", f"{r['step_ratio']:.2f}x", f"{r['peak_bytes'] / 2**20:.1f}",
                      str(r["offloaded_values"] if r["offloaded_values"] is not None else "-"),
                      str(r["recomputed_values"] if r["recomputed_values"] is not None else "-"),
                      str(r["fusions_refused"]), f"{a['dpcs_ops_host_ms_per_step']:.2f}",
                      f"{a['aten_host_ms_per_step']:.2f}", f"{a['launches_per_step']:.0f}",
                      f"{a['device_busy_ms_per_step']:.2f}", f"{a['wall_ms_per_step']:.2f}")
    Console(width=max(Console().width, 180)).print(table)
    print(f"median of {payload['steps']} interleaved steps after {payload['warmup']} warm-up; per-step figures from "
          f"{payload['profile_steps']} profiled steps")


if __name__ == "__main__":
    sys.exit(main())
