"""One budget for a training step in a 2-rank gloo job (`step_rank_worker.py`): DDP's graph splitting makes
several graphs per step, and so does FSDP2 (a graph per block); the measured step peak on each rank stays
within the budget, the ranks plan the same step and compile the same plans, and gradients equal a single
process's on the whole batch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dpcs_testing import run_step_ranks
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.cost.budget import CORRECTION_MIN_BYTES, CORRECTION_MIN_FRACTION
from step_scenarios import LayerNormStack, global_batch

# Between the lowest step peak dpcs reaches here (53.6 MB predicted) and the step's peak without a budget
# (65.1 MB measured, DDP's buckets included): the step must be re-planned to fit.
DDP_BUDGET = 60_000_000
# FSDP2: the step peaks at 49.9 MB without a budget (measured; each rank's shards 6.3 MB). Each graph planned
# alone fits this budget without recomputing anything, and the step then goes over it.
FSDP_BUDGET = 42_000_000


def run_ranks(tmp_path: Path, scenario: str, budget: int) -> list[dict]:
    return run_step_ranks(tmp_path, scenario, budget)


def test_ddp_buckets_share_one_step_budget_on_every_rank(tmp_path):
    zero, one = run_ranks(tmp_path, "ddp", DDP_BUDGET)
    assert zero["graphs"] > 2 * 3, "DDP split the step into several graphs (own plans, then step plans)"
    for rank in (zero, one):
        print(f"measured {rank['measured_peak']} B (buckets {rank['buckets']} B), step records {rank['steps']}")
        # The step plan, and at most one measured step beyond it: the first plan counts each piece's output
        # freed before its backward (2 MiB each) and predicts 0.97% (512 KiB) under the measured peak, an
        # allocation at the step's turn that no graph counts; the measured step counts it and plans again.
        first, *corrected = rank["steps"]
        assert len(corrected) <= 1 and all(not r["replanned"] for r in corrected)
        record = rank["steps"][-1]
        assert first["feasible"] and first["replanned"] and len(first["calls"]) > 2
        assert record["outside_bytes"] >= rank["buckets"]  # DDP's buckets counted as the step's
        assert rank["measured_peak"] <= DDP_BUDGET
        # Within the correction tolerance below (a measured step that close is not planned again), 5% above.
        tolerance = max(CORRECTION_MIN_BYTES, CORRECTION_MIN_FRACTION * record["predicted_peak_bytes"])
        assert rank["measured_peak"] - tolerance <= record["predicted_peak_bytes"] <= 1.05 * rank["measured_peak"]
    assert zero["steps"] == one["steps"] and zero["plan_hashes"] == one["plan_hashes"]
    torch.manual_seed(0)
    model = LayerNormStack()
    model(global_batch()).square().mean().backward()
    for got_zero, got_one, expected in zip(zero["grads"], one["grads"], (p.grad for p in model.parameters())):
        assert torch.equal(got_zero, got_one)
        torch.testing.assert_close(got_zero, expected, atol=1e-5, rtol=1e-4)


BLOCK_BYTES = 4 * sum(p.numel() for p in LayerNormStack().blocks[0].parameters())  # one block gathered


def test_fsdp2_blocks_count_their_gathered_parameters_and_hold_the_step_budget(tmp_path):
    zero, one = run_ranks(tmp_path, "fsdp", FSDP_BUDGET)
    for rank in (zero, one):
        print(f"measured {rank['measured_peak']} B, step records {rank['steps']}")
        # Planned once the step is known; planned again if a measured step held more than the plan (the ranks'
        # largest measurement, so both plan alike).
        assert 1 <= len(rank["steps"]) <= 2
        record = rank["steps"][-1]
        assert record["feasible"] and rank["steps"][0]["replanned"] and len(record["calls"]) == 6
        assert all(peak <= FSDP_BUDGET for peak in rank["measured_peaks"])
        # The step is predicted from its compiled variants (`compiled_peak_bytes`), each block's backward with
        # FSDP2's gather ahead, the reduce-scatter behind and a block per collective gloo releases late
        # (`step.calls.fsdp_in_flight`, `step.holdings.late_collectives`: gloo's 2 worker threads). Each drops the
        # collective it ran (the reduce-scatter's copy of its input) when it next takes its queue's lock, before
        # or after the next block's peak by the ranks' timing: steps of one plan differ by up to those blocks
        # (docs/memory_budget.md, limits). The prediction bounds every measured step (within the correction
        # tolerance) and is within 3% of the step that holds them all. (Measured in 160 steps: 37.8 MB, up to
        # 39.9 MB with one copy; once 40.45 MB under a CPU load; in CI, beside other tests, 42.03 MB with two.)
        assert rank["late_collectives"] == 2
        predicted = record["compiled_peak_bytes"] or record["predicted_peak_bytes"]
        tolerance = max(CORRECTION_MIN_BYTES, CORRECTION_MIN_FRACTION * predicted)
        assert rank["measured_peak"] - tolerance <= predicted
        assert predicted <= 1.03 * (min(rank["measured_peaks"]) + rank["late_collectives"] * BLOCK_BYTES)
    assert zero["steps"] == one["steps"] and zero["plan_hashes"] == one["plan_hashes"]
    torch.manual_seed(0)
    model = LayerNormStack()
    model(global_batch()).square().mean().backward()
    for got_zero, got_one, expected in zip(zero["grads"], one["grads"], (p.grad for p in model.parameters())):
        assert torch.equal(got_zero, got_one)
        torch.testing.assert_close(got_zero, expected, atol=1e-5, rtol=1e-4)


def _unreachable(tmp_path: Path, compiler: str) -> None:
    """DDP at 0.8x the step's no-budget peak, which parameters, gradients and DDP's buckets nearly fill: every
    rank raises at the same step, with the smallest peak and its parts, buckets named (issue 58, case 2)."""
    for sub in ("free", "budget"):
        (tmp_path / sub).mkdir()
    (unplanned, _) = (r["measured_peak"] for r in run_ranks(tmp_path / "free", f"ddp_unreachable:{compiler}", 0))
    budget = int(0.8 * unplanned)
    zero, one = run_ranks(tmp_path / "budget", f"ddp_unreachable:{compiler}", budget)
    print(zero)
    assert zero["raised_at"] is not None and zero["raised_at"] == one["raised_at"], (zero, one)
    message = zero["message"]
    assert "cannot be met for the training step" in message and "the smallest step peak dpcs can reach" in message
    buckets = 6 * (512 * 512 + 512) * 4
    assert f"DistributedDataParallel's gradient buckets {format_bytes(buckets)}" in message, message
    assert one["message"].split("; of it")[0] == message.split("; of it")[0]  # the same verdict on both ranks


# FSDP2: the lowest step peak dpcs reaches is 31.1 MiB (predicted; each rank's shards 6.0 MiB, 8.0 MiB of
# gathered parameters at the peak): a budget of 24 MiB is refused.
FSDP_UNREACHABLE = 25_165_824


def test_fsdp2_budget_below_the_lowest_step_peak_is_refused_on_every_rank_naming_shards_and_gathers(tmp_path):
    """FSDP2 per block, default options, a budget below the lowest step peak: both ranks raise at the same
    step, with the smallest peak split as for any step: this rank's shards as its parameters, and the gathered
    parameters (the running block's, and those in flight beside it) named, not counted as activations (issue 58,
    item 4)."""
    zero, one = run_ranks(tmp_path, "fsdp_unreachable", FSDP_UNREACHABLE)
    assert zero["raised_at"] is not None and zero["raised_at"] == one["raised_at"], (zero, one)
    message = zero["message"]
    assert "cannot be met for the training step" in message and "the smallest step peak dpcs can reach" in message
    assert "(FSDP2: this rank's shards)" in message, message
    gathered = re.search(r"FSDP2's gathered parameters \(the running block's and those in flight beside it\) "
                         r"([0-9.]+) MiB", message)
    assert gathered is not None and float(gathered.group(1)) > 0, message
    assert one["message"] == message  # the same verdict on both ranks


def test_ddp_budget_below_its_parameters_gradients_and_buckets_is_refused_on_every_rank(tmp_path):
    _unreachable(tmp_path, "eager")


@pytest.mark.slow
@pytest.mark.inductor
def test_ddp_unreachable_budget_is_refused_under_inductor_too(tmp_path):
    _unreachable(tmp_path, "inductor")
