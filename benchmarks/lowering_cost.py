"""What lowering a dpcs plan the way dpcs does costs in step time, factor by factor.

    python benchmarks/lowering_cost.py [--device cuda] [--models gpt,llama] [--fractions 1,0.6] [--steps 30]

dpcs lowers a plan that is not torch's own (`stages/compile_parts.lowering_as_planned`) with Inductor's buffer
reuse off (a dead buffer kept for a later one of its size can be held across the planned peak) and with the
fusion guard refusing horizontal fusions across allocations (`passes/rewrite/fusion_guard.py`). On a GPU step
that is bound by the host (small models: every kernel launch and every allocation is host time), both cost
time the plan's cost model does not see. Per model this compiles `compile` (torch.compile) and dpcs at each
fraction of compile's measured peak four ways:

  guarded      the fusion guard schedules every planned graph (dpcs before 2026-11-30)
  planned      as dpcs lowers it: the guard only where Inductor's own fusions do not fit the budget
  unguarded    no fusion guard
  reuse+ungd   no guard, and buffer reuse on (Inductor's default)

and times them all interleaved in this one process (`bench.time_interleaved`): median step time, peak, the
fusions the guard refused. A lowering without the guard or with reuse can hold more than the plan: the
measured peaks say how much. Writes lowering_cost_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench  # noqa: E402
from dpcs_compiler.models import bench_workload  # noqa: E402
from dpcs_compiler.stages import compile_parts  # noqa: E402

# name -> (buffer reuse, when the fusion guard schedules a planned graph: "always", "if_over" (where Inductor's
# own fusions do not fit the budget: what dpcs does), "never")
LOWERINGS = {
    "guarded": (False, "always"),
    "planned": (False, "if_over"),
    "unguarded": (False, "never"),
    "reuse+ungd": (True, "never"),
}


@contextlib.contextmanager
def lowered(name: str) -> Iterator[None]:
    """dpcs's compiles inside the block lower plans the way `name` says (torch's own plan as torch does)."""
    reuse, guard = LOWERINGS[name]
    real_lowering, real_rule = compile_parts.lowering_as_planned, compile_parts.scheduled_guarded_if_over

    @contextlib.contextmanager
    def lowering(torchs: bool, producers_apart: bool = False, guarded: bool = True):
        reused = reuse and not torchs and torch._inductor.config.allow_buffer_reuse
        with real_lowering(torchs, producers_apart, guarded) as g, \
                torch._inductor.config.patch(allow_buffer_reuse=reused or torchs and torch._inductor.config.allow_buffer_reuse):
            yield g

    def rule(probe, fits, check, keep_producers_apart=False, *, lower, may_improve):
        if guard == "if_over":
            return real_rule(probe, fits, check, keep_producers_apart, lower=lower, may_improve=may_improve)
        # "always": Inductor's fusions never fit, the guard's schedule is always taken; "never": they always fit.
        always = guard == "always"
        return real_rule(probe, lambda peak: not always, check, keep_producers_apart,
                         lower=lambda peak, than: always, may_improve=lambda peak: always)

    compile_parts.lowering_as_planned, compile_parts.scheduled_guarded_if_over = lowering, rule
    try:
        yield
    finally:
        compile_parts.lowering_as_planned, compile_parts.scheduled_guarded_if_over = real_lowering, real_rule


def run_model(model: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    torch._dynamo.reset()
    w = bench_workload(model, quick=args.quick)
    base = bench.LossModule(w.model, w.loss_fn).to(device)
    inputs = tuple(x.to(device) for x in w.inputs)
    backend = "inductor" if args.compiler == "inductor" else "aot_eager"
    plain = bench.Strategy("compile", "upstream", lambda m: torch.compile(
        m, backend=bench.StrategyBackend(backend, "compile"), dynamic=False), compiled=True)
    bench.prepare(plain, base, inputs, device=device, warmup=args.warmup, sgd=False)
    if not plain.ok:
        raise RuntimeError(f"compile failed: {plain.result['error']}")
    runs = [plain]
    for fraction in args.fractions:
        budget = int(plain.result["peak_bytes"] * fraction)
        for i, name in enumerate(LOWERINGS):
            # A byte more per lowering: dpcs backends of equal options are one backend to Dynamo, which would
            # run the first lowering's graphs for the others.
            s = bench.dpcs_strategy(budget + i, f"{fraction:g} x compile's peak", args.compiler, label=f"{fraction:g}")
            s.name = f"{name}@{fraction:g}"
            with lowered(name):
                bench.prepare(s, base, inputs, device=device, warmup=args.warmup, sgd=False)
            print(f"[{model}] {s.name}: peak {s.result.get('peak_bytes')} B, recomputed {s.result.get('recomputed_values')}, "
                  f"offloaded {s.result.get('offloaded_values')}, error {s.result.get('error')}", flush=True)
            runs.append(s)
    bench.time_interleaved(runs, steps=args.steps, warmup=args.warmup, device=device)
    if args.profile_steps:  # kernel launches, host and device time per step (`step_anatomy.anatomy`)
        import step_anatomy

        with bench.device_to_itself():
            for s in runs:
                if s.ok:
                    s.result["anatomy"] = step_anatomy.anatomy(s.step, args.profile_steps, device)
    out = {}
    for s in runs:
        r = s.result
        latest = {(x["variant_of"] or x["graph"]): x for x in r.get("records", []) if x["mode"] == "training"}
        out[s.name] = {
            **{k: r.get(k) for k in ("peak_bytes", "budget_bytes", "predicted_peak_bytes", "step_s", "step_s_all",
                                     "recomputed_values", "offloaded_values", "plan_feasible", "error")},
            "fusions_refused": sum(x.get("fusions_refused") or 0 for x in latest.values()) if latest else None,
            "step_ratio": r["step_s"] / plain.result["step_s"] if r.get("step_s") else None,
            "anatomy": {k: v for k, v in (r.get("anatomy") or {}).items() if k != "top_host_ops"} or None,
            "paired": bench.paired_ratio(r.get("step_s_all"), plain.result.get("step_s_all")) if s is not plain else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="gpt", help="`dpcs bench` models, comma-separated")
    parser.add_argument("--fractions", default="1,0.6", help="budgets as fractions of compile's measured peak")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=0, help="steps of each run under torch.profiler (0: none)")
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    parser.add_argument("--quick", action="store_true", help="tiny models (tests)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    try:
        args.fractions = [float(x) for x in args.fractions.split(",")]
    except ValueError:
        args.fractions = []
    if not args.fractions or not all(0 < f <= 2 for f in args.fractions):
        parser.error(f"--fractions {args.fractions!r} is not valid; valid choices: floats in (0, 2], comma-separated")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    device = torch.device(args.device)
    payload: dict[str, Any] = {
        "device": bench.device_name(device), "device_type": device.type, "torch": torch.__version__,
        "python": platform.python_version(), "compiler": args.compiler, "steps": args.steps, "warmup": args.warmup,
        "fractions": args.fractions, "lowerings": {k: {"buffer_reuse": r, "fusion_guard": g} for k, (r, g) in LOWERINGS.items()},
        "models": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"lowering_cost_{device.type}{'_quick' if args.quick else ''}.json"
    with bench.compile_afresh():
        for model in args.models.split(","):
            payload["models"][model] = run_model(model, args, device)
            path.write_text(json.dumps(payload, indent=1) + "\n")
    for model, rows in payload["models"].items():
        print(f"{model} ({payload['device']}, torch {payload['torch']})")
        for name, r in rows.items():
            paired = (r.get("paired") or {}).get("time_ratio_interval")
            a = r.get("anatomy") or {}
            launches = f"launches {a.get('launches_per_step')} busy {a.get('device_busy_ms_per_step')} ms" if a else ""
            print(f"  {name:16} peak {(r['peak_bytes'] or 0) / 2**20:7.2f} MiB  step {1e3 * (r['step_s'] or 0):6.2f} ms  "
                  f"x{r['step_ratio'] or 0:.3f} {paired or ''}  refused {r['fusions_refused']}  "
                  f"recomputed {r['recomputed_values']}  offloaded {r['offloaded_values']}  {launches} {r['error'] or ''}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
