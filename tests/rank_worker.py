"""One rank of the 2-process gloo tests in distributed/test_rank_agreement.py (run as a script, not collected by pytest).

    python rank_worker.py RANK WORLD STORE_FILE BUDGET PROFILE_JSON RESULT_JSON [--no-broadcast]

Before anything compiles, the rank writes PROFILE_JSON into its own profile cache ($DPCS_CACHE_DIR, set per
rank by the test), as a profile measured on this machine would be; then it trains one step of
SquaredLinears through dpcs with `hardware_profile="measure"` and writes what it compiled, or the error it
got, to RESULT_JSON. --no-broadcast makes every rank resolve its own profile (rank 0's is not broadcast).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dpcs_testing import SQUARED_LINEARS_PRECISION, SquaredLinears  # noqa: E402
from rank_process import join, leave, report_crashes, see_dpcs_warnings  # noqa: E402
from dpcs_compiler import compile_records  # noqa: E402
from dpcs_compiler.distributed import rank_agreement  # noqa: E402
from dpcs_compiler.cost import hardware  # noqa: E402


def main() -> None:
    report_crashes()
    rank, world, store, budget, profile_json, result_json = sys.argv[1:7]
    rank, world, budget = int(rank), int(world), int(budget)
    own = json.loads(Path(profile_json).read_text()) | {"device_key": hardware.device_key("cpu"),
                                                          "torch_version": torch.__version__}
    path = hardware.cache_path(own["device_key"], hardware.default_cache_dir())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(own))
    if "--no-broadcast" in sys.argv:
        rank_agreement.from_rank_zero = lambda compute, what: compute()
    join(store, rank, world)
    torch.manual_seed(0)
    model, x = SquaredLinears(), torch.randn(1024, 256) * 0.3
    options = {"compiler": "eager", "strict": True, "hardware_profile": "measure", "memory_budget": budget}
    compiled = torch.compile(model, backend="dpcs", options={**SQUARED_LINEARS_PRECISION, **options})
    try:
        with warnings.catch_warnings():
            see_dpcs_warnings()
            compiled(x).backward()
        (record,) = [r for r in compile_records() if r.mode == "training"]
        result = {
            "plan_hash": record.plan_hash,
            "hardware_profile": record.hardware_profile,
            "recomputed": record.recomputed_values,
            "grad_sum": sum(float(p.grad.double().sum()) for p in model.parameters()),
        }
    except Exception as error:  # noqa: BLE001 - the test reads what each rank got
        result = {"error": f"{type(error).__name__}: {error}"}
    Path(result_json).write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    main()
