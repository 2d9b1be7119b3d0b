"""Rank agreement: every rank plans with rank 0's hardware profile, and ranks that compiled different plans
raise on every rank instead of hanging. Two gloo processes on CPU (`rank_worker.py`), each with its own
profile cache holding a different profile."""

from __future__ import annotations

import json
import re
import os
import sys
from pathlib import Path

import pytest
import torch

from dpcs_testing import BF16_FAST, FP32_FAST, SquaredLinears, run_rank_processes, squared_linears_step
from dpcs_compiler.cost.hardware import profile_to_json
from dpcs_compiler.distributed.rank_agreement import _describe, graph_fingerprint

WORKER = Path(__file__).resolve().parent.parent / "rank_worker.py"


def run_ranks(tmp_path: Path, budget: int, *flags: str) -> list[dict]:
    """Rank 0 with FP32_FAST in its profile cache, rank 1 with BF16_FAST (100x the bf16 rate); their results."""
    store = tmp_path / "store"
    commands, envs, results = [], [], []
    for rank, profile in enumerate((FP32_FAST, BF16_FAST)):
        cache = tmp_path / f"cache{rank}"
        profile_file = tmp_path / f"profile{rank}.json"
        profile_file.write_text(profile_to_json(profile))
        result = tmp_path / f"result{rank}.json"
        envs.append({k: v for k, v in os.environ.items() if k != "DPCS_HARDWARE_PROFILE"} | {
            "DPCS_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
        })
        commands.append([sys.executable, str(WORKER), str(rank), "2", str(store), str(budget), str(profile_file), str(result), *flags])
        results.append(result)
    run_rank_processes(commands, envs)
    return [json.loads(r.read_text()) for r in results]


@pytest.fixture(scope="module")
def budget() -> int:
    """A budget at which FP32_FAST and BF16_FAST give different plans (test_hardware_profiles shows which)."""
    torch.manual_seed(0)
    model, x = SquaredLinears(), torch.randn(1024, 256) * 0.3
    low = squared_linears_step(model, x, memory_budget=1, on_infeasible="best", hardware_profile=FP32_FAST)
    high = squared_linears_step(model, x, memory_budget="1TiB", keep_torch_plan=False, hardware_profile=FP32_FAST)
    return int(low.predicted_peak_bytes + 0.1 * (high.predicted_peak_bytes - low.predicted_peak_bytes))


def test_every_rank_plans_with_rank_zeros_profile(tmp_path, budget):
    zero, one = run_ranks(tmp_path, budget)
    assert "error" not in zero and "error" not in one, (zero, one)
    assert zero["plan_hash"] == one["plan_hash"] and zero["recomputed"] == one["recomputed"] > 0
    # rank 0's own cached profile ("measured test": FP32_FAST), and rank 1 says it is rank 0's
    assert ": measured test, cached at " in zero["hardware_profile"] and str(tmp_path / "cache0") in zero["hardware_profile"]
    assert one["hardware_profile"] == zero["hardware_profile"].replace(": measured", ": rank 0's, measured", 1)
    assert zero["grad_sum"] == one["grad_sum"]


def test_ranks_that_plan_alone_raise_naming_the_graph_the_ranks_and_what_differs(tmp_path, budget):
    """With the broadcast disabled each rank plans with its own cached profile: the plans differ, and both
    ranks raise at the comparison after planning (none waits forever in a later collective)."""
    zero, one = run_ranks(tmp_path, budget, "--no-broadcast")
    for result in (zero, one):
        error = result.get("error", "")
        assert "RankDisagreementError: dpcs compiled different plans for graph_000 (Dynamo id 0/0)" in error, result
        assert "rank 1 differs from rank 0 in " in error
        theirs, ours = re.search(r"hardware \('(cpu:[^']*)' vs '(cpu:[^']*)' on rank 0\)", error).groups()
        assert theirs != ours  # each rank's own cached profile
        assert "values (" in error and "decision 'recompute' vs 'save'" in error
    assert "(this is rank 0)" in zero["error"] and "(this is rank 1)" in one["error"]


def test_what_differs_is_said_per_field():
    zero = [{"name": "mm", "decision": "save"}, {"name": "mm_1", "decision": "recompute"}]
    other = [{"name": "mm", "decision": "recompute"}, {"name": "mm_1", "decision": "recompute"}]
    assert _describe("values", zero, other) == "values (1 of 2 differ: 'mm': decision 'recompute' vs 'save')"
    assert _describe("values", zero, other[:1]) == "values (1 entries vs 2 on rank 0)"
    assert _describe("budget_bytes", 100, 90) == "budget_bytes (90 vs 100 on rank 0)"


def test_a_graph_is_the_same_on_every_rank_whatever_device_index_it_runs_on():
    code = "x = torch.ones(3, device=device(type='cuda', index={i})); y = z.to('cuda:{i}')"
    assert graph_fingerprint(code.format(i=0), []) == graph_fingerprint(code.format(i=1), [])
    assert graph_fingerprint(code.format(i=0), []) != graph_fingerprint(code.format(i=0) + "; w = y", [])
