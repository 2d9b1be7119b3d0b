"""benchmarks/plan_hashes.py: a bench point's plan hash with dpcs's source hash held fixed is the plan's own:
the same in two processes, and moved by a plan that differs (another budget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_hashes.py"


@pytest.mark.slow
@pytest.mark.inductor
def test_hashes_name_the_plan_not_the_source(tmp_path):
    points = {"dpcs@roomy": {"records": [{"budget_bytes": 10**9}]}, "dpcs@tight": {"records": [{"budget_bytes": 1}]}}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"quick": True, "models": {"gpt": {"strategies": points}}}))
    runs = []
    for i in range(2):
        out = tmp_path / f"hashes{i}.json"
        subprocess.run([sys.executable, str(SCRIPT), str(bench), str(out)], check=True, capture_output=True)
        runs.append(json.loads(out.read_text()))
    assert runs[0] == runs[1]
    (roomy,), (tight,) = runs[0]["gpt dpcs@roomy"], runs[0]["gpt dpcs@tight"]
    assert roomy[0] != tight[0] and roomy[1] < tight[1]  # the tight budget's plan recomputes more
