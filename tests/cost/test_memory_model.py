"""The plan memory model on hand-made problems: exact byte curves for each decision."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dpcs_compiler.cost.memory_model import (
    OFFLOAD,
    RECOMPUTE,
    SAVE,
    Candidate,
    MemoryProblem,
    floor_bytes,
    materialize_steps,
    plan_memory,
    plan_seconds,
)
from dpcs_compiler.solve.synthetic import random_problem


def problem() -> MemoryProblem:
    # 10 steps of 1 s, backward from step 5; "a" feeds the recomputation of "b".
    return MemoryProblem(
        base_bytes=np.full(10, 100),
        step_seconds=np.ones(10),
        backward_start=5,
        candidates=(
            Candidate("a", 50, 0, 1, 8, 9, recompute_seconds=1.0, recompute_transient=7),
            Candidate(
                "b", 30, 1, 2, 6, 7, recompute_seconds=2.0, recompute_inputs=(0,), transfer_seconds=1.5, can_offload=True
            ),
        ),
    )


@pytest.mark.parametrize(
    "decisions, curve, seconds",
    [
        ((SAVE, SAVE), [150, 180, 180, 180, 180, 180, 180, 180, 150, 150], 0.0),
        # a freed after its last forward use (1), made again before its first backward use (8)
        ((RECOMPUTE, SAVE), [150, 180, 130, 130, 130, 130, 130, 130, 157, 150], 1.0),
        # b made again at 6 needs a there too: a comes back at 6, not 8
        ((RECOMPUTE, RECOMPUTE), [150, 180, 130, 100, 100, 100, 187, 180, 150, 150], 3.0),
        # b's copy (1.5 s from the end of step 1) is done during step 3; reload starts at backward start 5
        # (the latest step hiding 1.5 s before step 6 would be 4, which is still forward): 0.5 s exposed
        ((SAVE, OFFLOAD), [150, 180, 180, 180, 150, 180, 180, 180, 150, 150], 0.5),
    ],
)
def test_curve_and_seconds_per_decision(decisions, curve, seconds):
    p = problem()
    memory = plan_memory(p, decisions)
    assert memory.bytes_during.tolist() == curve
    assert memory.peak_bytes == max(curve) and curve[memory.peak_step] == max(curve)
    assert plan_seconds(p, decisions) == pytest.approx(seconds)


def test_recompute_chain_materializes_inputs_with_their_earliest_consumer():
    assert materialize_steps(problem(), (RECOMPUTE, RECOMPUTE)) == [6, 6]
    assert materialize_steps(problem(), (RECOMPUTE, SAVE)) == [8, -1]


@pytest.mark.parametrize(
    "decisions, message",
    [
        ((SAVE,), "1 decisions for 2 candidates"),
        ((SAVE, "keep"), "'keep' for 'b' is not valid"),
        ((OFFLOAD, SAVE), "'a' cannot be offloaded"),
    ],
)
def test_bad_decisions_are_named(decisions, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(problem(), decisions)


def test_bad_candidates_are_named():
    with pytest.raises(ValueError, match="candidate 'x'"):
        Candidate("x", 1, produced=3, last_forward_use=2, first_backward_use=5, last_use=6)
    for field in ("transfer_seconds", "offload_ops_seconds"):
        with pytest.raises(ValueError, match=f"candidate 'x': {field} must be finite and >= 0"):
            Candidate("x", 1, 0, 1, 2, 3, can_offload=True, **{field: -1e-6})
    with pytest.raises(ValueError, match="recompute inputs must be earlier"):
        MemoryProblem(np.zeros(4), np.ones(4), 2, (Candidate("x", 1, 0, 0, 2, 3, recompute_inputs=(0,)),))


def test_schedule_excess_adds_to_each_phase():
    p = problem()
    decisions = (RECOMPUTE, SAVE)
    base = plan_memory(p, decisions).bytes_during
    # 20 B more in every forward step, 7 B in every backward step, including the recomputation row (step 8)
    shifted = plan_memory(p.with_schedule_excess(20, 7), decisions).bytes_during
    assert list(shifted - base) == [20] * 5 + [7] * 5
    assert (plan_memory(p.with_schedule_excess(-50, 7), decisions).bytes_during - base).tolist() == [-50] * 5 + [7] * 5
    assert p.with_schedule_excess(0, 0) is p
    # the copy timing stays with the steps
    assert p.with_schedule_excess(1, 1).reload_step(1) == p.reload_step(1)


@pytest.mark.parametrize("seed", range(4))
def test_floor_bytes_is_under_every_plan_and_reached(seed: int) -> None:
    """`floor_bytes` bounds every plan's bytes from below at every step, and is what a plan that takes each
    candidate out of memory without chains or transients holds."""
    problem = random_problem(seed, steps=200, candidates=40, transient_fraction=0.3, can_offload=seed % 2 == 0)
    floor = floor_bytes(problem)
    rng = np.random.default_rng(seed)
    for _ in range(50):
        decisions = [
            rng.choice([d for d, ok in ((SAVE, True), (RECOMPUTE, c.can_recompute), (OFFLOAD, c.can_offload)) if ok])
            for c in problem.candidates
        ]
        assert (plan_memory(problem, decisions).bytes_during >= floor).all()
    plain = dataclasses.replace(
        problem,
        candidates=tuple(
            dataclasses.replace(c, recompute_inputs=(), recompute_transient=0, can_offload=False)
            for c in problem.candidates
        ),
    )
    out = [RECOMPUTE if c.can_recompute else SAVE for c in plain.candidates]
    np.testing.assert_array_equal(plan_memory(plain, out).bytes_during, floor_bytes(plain))


def test_a_schedule_credit_lowers_the_phases_not_what_is_held_between_them():
    """A compiled schedule that holds less inside a phase (Inductor's reordering) is credited to the bytes
    during its steps, not to those before them: the boundary level, what the graph holds while the others
    of its step run, stays."""
    from dpcs_compiler.cost.step_model import boundary_level

    p = MemoryProblem(base_bytes=np.full(6, 100), step_seconds=np.ones(6), backward_start=3,
                      candidates=(Candidate("a", 50, 0, 1, 4, 5, recompute_seconds=1.0),))
    credited = p.with_schedule_credit(-10, -30)
    np.testing.assert_array_equal(credited.base_bytes, [90, 90, 90, 70, 70, 70])
    np.testing.assert_array_equal(credited.base_before_bytes, p.base_before_bytes)
    assert boundary_level(credited, ("save",)) == boundary_level(p, ("save",))
    assert plan_memory(credited, ("save",)).peak_bytes == plan_memory(p, ("save",)).peak_bytes - 10
    assert p.with_schedule_credit(0, 0) is p
    with pytest.raises(ValueError, match="<= 0"):
        p.with_schedule_credit(5, 0)


def test_a_backward_excess_is_held_between_the_phases_only_where_the_forward_left_it():
    """What the compiled graphs hold beyond the model inside the backward (a fused kernel's outputs) is a peak
    there, not held at the boundary: only `boundary_bytes` (what the forward left beyond the model) is. Without
    it, the backward's excess stands for it; `with_excess` reads the compile's dict, clamped for planning."""
    from dpcs_compiler.cost.step_model import boundary_level

    p = MemoryProblem(base_bytes=np.full(6, 100), step_seconds=np.ones(6), backward_start=3,
                      candidates=(Candidate("a", 50, 0, 1, 4, 5, recompute_seconds=1.0),))
    split = p.with_schedule_excess(10, 30, boundary_bytes=4)
    np.testing.assert_array_equal(split.base_bytes, [110, 110, 110, 130, 130, 130])
    np.testing.assert_array_equal(split.base_before_bytes, [110, 110, 110, 104, 130, 130])
    assert boundary_level(split, ("save",)) == boundary_level(p, ("save",)) + 4
    assert boundary_level(p.with_schedule_excess(10, 30), ("save",)) == boundary_level(p, ("save",)) + 30
    assert plan_memory(split, ("save",)).peak_bytes == plan_memory(p, ("save",)).peak_bytes + 30
    read = {"forward": -8, "backward": 30, "boundary": -2}
    np.testing.assert_array_equal(p.with_excess(read).base_before_bytes, [92, 92, 92, 98, 130, 130])
    np.testing.assert_array_equal(p.with_excess(read, planning=True).base_before_bytes, [100, 100, 100, 100, 130, 130])
    assert p.with_excess({"forward": 0, "backward": 0}) is p


def test_an_offload_costs_its_ops_host_time_in_full_beside_its_exposed_copies():
    """The copies hide behind compute where the schedule leaves room; the ops that issue them do not."""
    p = problem()
    ops = dataclasses.replace(p.candidates[1], offload_ops_seconds=0.25)
    with_ops = dataclasses.replace(p, candidates=(p.candidates[0], ops))
    assert p.offload_seconds(1) == pytest.approx(0.5)  # the exposed copy time alone, as before
    assert with_ops.offload_seconds(1) == pytest.approx(0.5 + 0.25)
    assert plan_seconds(with_ops, (SAVE, OFFLOAD)) == pytest.approx(0.75)
    hidden = dataclasses.replace(ops, transfer_seconds=0.0)  # a copy fully hidden still costs the ops
    assert dataclasses.replace(p, candidates=(p.candidates[0], hidden)).offload_seconds(1) == pytest.approx(0.25)
    assert plan_memory(with_ops, (SAVE, OFFLOAD)).bytes_during.tolist() == plan_memory(p, (SAVE, OFFLOAD)).bytes_during.tolist()
