"""The fusion guard's producer/consumer rule, measured: dpcs plans compiled with and without it, side by side.

    python benchmarks/fusion_guard.py [--models llama,hf_gpt2,gpt] [--fractions 0.85,0.6,0.3] [--steps 15]
                                      [--warmup 3] [--out benchmarks/results/fusion_guard] [--quick]

`passes.rewrite.fusion_guard.PlannedFusionChoices` refuses a producer/consumer fusion across allocations when a
kernel in between reads the producer's outputs. Per model, `compile` (plain Inductor) is measured first; at
each fraction of its measured peak, dpcs (on_infeasible="best": the lowest fraction gives the lowest plan)
is compiled twice, with the rule ("guarded") and with Inductor's own vertical fusions ("vertical fused", the
rule off while it compiles). All points are timed interleaved in this one process (`bench.time_interleaved`):
median step time after warm-up; peaks measured as `dpcs bench` measures them. Writes fusion_guard_<device>.json
(device, torch version) and a plot of peak against step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench import (  # noqa: E402
    LossModule, compile_afresh, device_name, dpcs_strategy, prepare, time_interleaved, upstream_strategies,
)
from dpcs_compiler.models import bench_workload  # noqa: E402
from dpcs_compiler.passes.rewrite import fusion_guard  # noqa: E402

MiB = 2**20


@contextlib.contextmanager
def inductors_fusions():
    """While compiling: producer/consumer fusions decided by Inductor alone (the guard's rule never applies)."""
    rule = fusion_guard.PlannedFusionChoices.can_fuse_vertical
    fusion_guard.PlannedFusionChoices.can_fuse_vertical = staticmethod(fusion_guard.InductorChoices.can_fuse_vertical)
    try:
        yield
    finally:
        fusion_guard.PlannedFusionChoices.can_fuse_vertical = rule


@contextlib.contextmanager
def producers_always_apart():
    """While compiling: the guard's producer/consumer rule on for every planned graph."""
    init = fusion_guard.PlannedFusionChoices.__init__
    fusion_guard.PlannedFusionChoices.__init__ = (
        lambda self, keep_producers_apart=False, count_refusable=False, refuse_horizontal=True:
        init(self, True, count_refusable, refuse_horizontal))
    try:
        yield
    finally:
        fusion_guard.PlannedFusionChoices.__init__ = init


VARIANTS = (("by schedule", contextlib.nullcontext), ("inductor's fusions", inductors_fusions),
            ("producers apart", producers_always_apart))


def run_model(name: str, fractions: Sequence[float], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    workload = bench_workload(name, quick=args.quick)
    base = LossModule(workload.model, workload.loss_fn).to(device)
    inputs = [x.to(device) for x in workload.inputs]
    (plain,) = upstream_strategies(["compile"], [], "inductor")
    prepare(plain, base, inputs, device=device, warmup=args.warmup, sgd=False)
    if plain.result.get("error"):
        raise RuntimeError(f"{name}: compile failed: {plain.result['error']}")
    points = []
    for fraction in fractions:
        budget = int(plain.result["peak_bytes"] * fraction)
        # Bytes apart: equal options would let Dynamo serve one copy's graphs to another.
        for extra, (label, context) in enumerate(VARIANTS):
            strategy = dpcs_strategy(budget + extra, f"{fraction} x compile's peak", "inductor",
                                     label=f"{fraction}:{label}")
            strategy.compile_context = context
            prepare(strategy, base, inputs, device=device, warmup=args.warmup, sgd=False)
            points.append((fraction, label, strategy))
    time_interleaved([plain] + [s for _, _, s in points], steps=args.steps, warmup=args.warmup, device=device)
    rows = []
    for fraction, label, strategy in points:
        result = strategy.result
        records = [r for r in result.get("records", []) if r["mode"] == "training"]
        rows.append({
            "fraction": fraction, "rule": label, "budget_bytes": strategy.budget_bytes,
            "peak_bytes": result.get("peak_bytes"), "step_s": result.get("step_s"), "step_s_all": result.get("step_s_all"),
            "predicted_peak_bytes": result.get("predicted_peak_bytes"), "feasible": result.get("plan_feasible"),
            "recomputed_values": result.get("recomputed_values"),
            "fusions_refused": sum(r["fusions_refused"] or 0 for r in records),
            "backward_fusion": [r.get("backward_fusion") for r in records],
            "backward_schedule_excess_bytes": [r["backward_schedule_excess_bytes"] for r in records],
            "error": result.get("error"),
        })
    by = {(r["fraction"], r["rule"]): r for r in rows}
    ratios = []
    for fraction in fractions:
        base_row = by[(fraction, "inductor's fusions")]
        for label, _ in VARIANTS:
            row = by[(fraction, label)]
            if label != base_row["rule"] and row["step_s"] and base_row["step_s"] and row["peak_bytes"]:
                ratios.append({"fraction": fraction, "rule": label, "peak_ratio": row["peak_bytes"] / base_row["peak_bytes"],
                               "step_ratio": row["step_s"] / base_row["step_s"]})
    return {"compile": {"peak_bytes": plain.result["peak_bytes"], "step_s": plain.result.get("step_s")},
            "points": rows, "against_inductors_fusions": ratios}


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = payload["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, (name, model) in zip(axes[0], models.items()):
        for (label, _), marker in zip(VARIANTS, ("o", "x", "+")):
            pts = [(p["peak_bytes"] / MiB, p["step_s"] * 1e3) for p in model["points"]
                   if p["rule"] == label and p["peak_bytes"] and p["step_s"]]
            ax.plot(*zip(*pts), marker=marker, linestyle="", label=label) if pts else None
        ax.plot([model["compile"]["peak_bytes"] / MiB], [model["compile"]["step_s"] * 1e3], "k*", label="compile")
        ax.set_title(name)
        ax.set_xlabel("peak MiB")
        ax.set_ylabel("step ms")
        ax.legend()
    fig.suptitle(f"fusion guard's producer/consumer rule - {payload['device']}, torch {payload['torch']}")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,hf_gpt2,gpt")
    parser.add_argument("--fractions", default="0.85,0.6,0.3")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fusion_guard")
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    device = torch.device(args.device)
    payload: dict[str, Any] = {"device": device_name(device), "torch": torch.__version__,
                               "python": platform.python_version(), "steps": args.steps, "warmup": args.warmup,
                               "quick": args.quick, "models": {}}
    with compile_afresh():
        for name in args.models.split(","):
            payload["models"][name] = model = run_model(name, fractions, args, device)
            for p in model["points"]:
                print(f"{name} {p['fraction']:.2f} {p['rule']:>14}: peak {p['peak_bytes']} step "
                      f"{(p['step_s'] or 0) * 1e3:.1f} ms refused {p['fusions_refused']} {p['error'] or ''}", flush=True)
            for r in model["against_inductors_fusions"]:
                print(f"{name} {r['fraction']:.2f}: {r['rule']} / inductor's fusions: peak {r['peak_ratio']:.4f}x, "
                      f"step {r['step_ratio']:.3f}x", flush=True)
            torch._dynamo.reset()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"fusion_guard_{device.type}" if not args.quick else args.out / f"fusion_guard_{device.type}_quick"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(payload, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
