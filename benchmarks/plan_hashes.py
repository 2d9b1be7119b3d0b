"""The plan hashes of `dpcs bench`'s dpcs points, with dpcs's source hash held fixed.

A plan hash embeds the hash of dpcs's own source (`plan.compile_key`: a code change invalidates cached
graphs), so any change to the package moves every hash. To check that a change leaves the plans alone
(issue 59: the restructure), run this before and after it on one bench result's budgets: each point compiled
with the bench's budget under Inductor, 3 warm-up steps, the source hash fixed; equal hashes, equal plans.

    PYTHONPATH=CHECKOUT python benchmarks/plan_hashes.py BENCH_JSON OUT_JSON

BENCH_JSON: a `dpcs bench --models gpt,llama` result (its dpcs points' budgets); OUT_JSON: per point, each
training graph's (plan hash, recomputed values, predicted peak).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

import dpcs_compiler.plan as plan
from dpcs_compiler import clear_compile_records, compile_records
from dpcs_compiler.models import bench_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import LossModule  # noqa: E402


def main(bench_json: str, out_json: str) -> None:
    plan.dpcs_source_hash = lambda: "fixed"  # the plan's own content only
    bench = json.loads(Path(bench_json).read_text())
    out = {}
    for name, result in bench["models"].items():
        w = bench_workload(name, quick=bench.get("quick", False))
        base = LossModule(w.model, w.loss_fn)
        for label, s in result["strategies"].items():
            if not label.startswith("dpcs"):
                continue
            torch._dynamo.reset()
            clear_compile_records()
            options = {"compiler": "inductor", "memory_budget": s["records"][0]["budget_bytes"], "strict": True,
                       "on_infeasible": "best"}
            compiled = torch.compile(base, backend="dpcs", options=options)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"memory_budget .* cannot be met")  # the points below lowest
                for _ in range(3):
                    base.zero_grad(set_to_none=True)
                    compiled(*w.inputs).backward()
            out[f"{name} {label}"] = [(r.plan_hash, r.recomputed_values, r.predicted_peak_bytes)
                                      for r in compile_records() if r.mode == "training"]
            print(label, out[f"{name} {label}"], flush=True)
    Path(out_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
