"""The cadence's decisions as pure functions (no job, no graph), and the inputs it refuses."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from dpcs_compiler.distributed.cadence import Cadence, CadenceConfig, Estimate, counts_for, initial_counts, next_round


@pytest.mark.parametrize(("field", "value", "message"), [
    ("anchor", 0, "anchor=0 is not valid; valid choices: an int >= 1"),
    ("anchor", 1.5, "anchor=1.5 is not valid"),
    ("max_anchor", 0, "max_anchor=0 is not valid"),
    ("overhead_target", 1.5, "overhead_target=1.5 is not valid; valid choices: None or a number in (0, 1)"),
    ("max_batch_diff", -1, "max_batch_diff=-1 is not valid"),
    ("speeds", (1.0, 0.0), "speeds=(1.0, 0.0) is not valid"),
    ("loss_reduction", "avg", "loss_reduction='avg' is not valid; valid choices: 'mean', 'sum'"),
    ("timeout", 0, "timeout=0 is not valid"),
    ("report_timing", "yes", "report_timing='yes' is not valid"),
])
def test_bad_options_are_named_with_the_valid_choices(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CadenceConfig(**{field: value})


def test_max_anchor_below_anchor_is_refused():
    with pytest.raises(ValueError, match="max_anchor=2 is below anchor=3"):
        CadenceConfig(anchor=3, max_anchor=2)


def test_initial_counts_follow_the_speeds_the_slowest_runs_the_anchor():
    counts, estimate = initial_counts(CadenceConfig(anchor=2, speeds=(1.0, 0.5, 0.25)), 3)
    assert counts == (8, 4, 2) and not estimate.measured
    assert initial_counts(CadenceConfig(anchor=3), 2)[0] == (3, 3)
    with pytest.raises(ValueError, match="speeds has 2 entries for a job of 3 ranks"):
        initial_counts(CadenceConfig(speeds=(1.0, 2.0)), 3)


def test_max_batch_diff_caps_how_far_the_fastest_leads():
    assert counts_for(CadenceConfig(anchor=2), 2, [0.01, 0.1]) == (20, 2)
    assert counts_for(CadenceConfig(anchor=2, max_batch_diff=3), 2, [0.01, 0.1]) == (5, 2)


def test_the_first_measured_round_replaces_the_relative_speeds_then_rounds_are_smoothed():
    config = CadenceConfig(overhead_target=None, smoothing=0.5)
    start = Estimate(seconds_per_batch=(1.0, 1.0))
    first = next_round(config, 1, start, ran=(1, 1), busy=(0.05, 0.1), waited=None)
    assert first.estimate.seconds_per_batch == (0.05, 0.1) and first.counts == (2, 1) and first.overhead is None
    second = next_round(config, 1, first.estimate, ran=(2, 1), busy=(0.05, 0.1), waited=0.001)
    assert second.estimate.seconds_per_batch == pytest.approx((0.0375, 0.1))
    assert second.counts == (3, 1) and second.anchor == 1  # no target: the anchor stays
    assert "micro-batches [2, 1] -> [3, 1]" in second.reason


def test_the_anchor_grows_until_the_sync_overhead_is_under_target_and_stops_at_max_anchor():
    config = CadenceConfig(overhead_target=0.1, max_anchor=8, smoothing=1.0)
    measured = Estimate(seconds_per_batch=(0.1, 0.1), waits=(0.05, 0.05), measured=True)
    # sync 50 ms against 100 ms of work: 33% overhead; 7 micro-batches bring it a quarter under the target (7.5%).
    grown = next_round(config, 1, measured, ran=(1, 1), busy=(0.1, 0.1), waited=0.05)
    assert grown.anchor == 7 and grown.counts == (7, 7) and grown.overhead == pytest.approx(1 / 3)
    assert "sync overhead 33.3% > target 10%: anchor 1 -> 7" in grown.reason
    capped = next_round(CadenceConfig(overhead_target=0.1, max_anchor=3, smoothing=1.0), 1, measured, (1, 1),
                        (0.1, 0.1), 0.05)
    assert capped.anchor == 3


def test_the_anchor_waits_for_three_timed_syncs_and_one_slow_sync_does_not_move_it():
    config = CadenceConfig(overhead_target=0.1, smoothing=1.0)
    young = next_round(config, 1, Estimate((0.1, 0.1), waits=(0.05,), measured=True), (1, 1), (0.1, 0.1), 0.05)
    assert young.anchor == 1 and young.overhead == pytest.approx(1 / 3)
    calm = next_round(config, 1, Estimate((0.1, 0.1), waits=(0.001, 0.001), measured=True), (1, 1), (0.1, 0.1), 0.5)
    assert calm.anchor == 1 and calm.estimate.wait_seconds == 0.001  # the median of the last syncs


def test_the_anchor_shrinks_back_towards_the_one_asked_for_when_the_sync_is_cheap():
    config = CadenceConfig(anchor=2, overhead_target=0.1, smoothing=1.0)

    def after(anchor: int, sync: float):
        estimate = Estimate(seconds_per_batch=(0.1, 0.1), waits=(sync, sync), measured=True)
        return next_round(config, anchor, estimate, ran=(anchor, anchor), busy=(0.1 * anchor,) * 2, waited=sync)

    # 20 ms of sync against 600 ms of work: 3.2%; the least anchor that keeps it under half the target is 4.
    shrunk = after(6, 0.02)
    assert shrunk.anchor == 4 and "sync overhead 3.2% < 5%: anchor 6 -> 4" in shrunk.reason
    assert after(3, 0.001).anchor == 2  # never below the anchor asked for
    # Between half the target and the target the anchor holds: no swinging around the target.
    held = after(4, 0.03)
    assert held.anchor == 4 and held.reason == ""


def test_the_decision_is_the_same_function_of_the_same_report_on_every_rank():
    config = CadenceConfig(speeds=(1.0, 0.4))
    _, estimate = initial_counts(config, 2)
    rounds = [((2, 1), (0.021, 0.052), None), ((3, 1), (0.03, 0.05), 0.002), ((3, 1), (0.031, 0.049), 0.02)]
    decisions = []
    for _ in range(2):
        anchor, state, out = 1, estimate, []
        for ran, busy, sync in rounds:
            decision = next_round(config, anchor, state, ran, busy, sync)
            anchor, state = decision.anchor, decision.estimate
            out.append((decision.counts, decision.anchor))
        decisions.append(out)
    assert decisions[0] == decisions[1]


def test_cadence_needs_a_job_of_two_or_more_ranks(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        Cadence(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match="this job has world size 1"):
            Cadence(model)
    finally:
        dist.destroy_process_group()


def test_an_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"Cadence got unknown options \['anchr'\]; valid choices: 'anchor', "):
        Cadence(torch.nn.Linear(2, 2), anchr=2)
