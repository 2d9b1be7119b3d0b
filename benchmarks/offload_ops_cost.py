"""What the host time of the offload ops does to plans: the bench GPT planned for an H100 from this machine
(the built-in datasheet profile), with the ops costed as free (as before 2026-11-29), at the profile's floor
(50 us per value) and at 150 us, at budgets across the reachable range. Prints and writes, per budget and
cost, the values offloaded and recomputed, the predicted peak and the added seconds the plan model gives.

    python benchmarks/offload_ops_cost.py --out benchmarks/results/h200_2026-11-29
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from dpcs_testing import measured_step  # noqa: E402
from dpcs_compiler.cost.profiles import BUILTIN_PROFILES  # noqa: E402
from dpcs_compiler.models import bench_workload  # noqa: E402

FRACTIONS = (0.95, 0.75, 0.5, 0.25, 0.1)  # of the way from the lowest reachable peak to the all-saved one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", help="a `dpcs bench` model (default gpt)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)

    h100 = BUILTIN_PROFILES["h100"][1]
    costs = {"free": dataclasses.replace(h100, offload_ops_s=0.0), "floor 50 us": h100,
             "150 us": dataclasses.replace(h100, offload_ops_s=150e-6)}
    w = bench_workload(args.model)
    _, lowest = measured_step(w, "eager", memory_budget=1, on_infeasible="best", hardware_profile=h100)
    _, highest = measured_step(w, "eager", memory_budget="1TiB", keep_torch_plan=False, hardware_profile=h100)
    low, high = lowest.predicted_peak_bytes, highest.predicted_peak_bytes
    rows = []
    for fraction in FRACTIONS:
        budget = int(low + fraction * (high - low))
        for name, profile in costs.items():
            _, r = measured_step(w, "eager", memory_budget=budget, hardware_profile=profile, on_infeasible="best")
            rows.append({"fraction": fraction, "budget_bytes": budget, "offload_ops": name,
                         "feasible": r.plan_feasible, "offloaded": r.offloaded_values, "recomputed": r.recomputed_values,
                         "predicted_peak_bytes": r.predicted_peak_bytes, "added_ms": 1e3 * r.plan_added_seconds})
            print(rows[-1], flush=True)
    payload = {"planned_for": h100.device_key, "host": platform.processor() or platform.machine(),
               "torch": torch.__version__, "model": args.model, "lowest_bytes": low, "all_saved_bytes": high,
               "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "offload_ops_cost_h100_planned_on_cpu.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
