"""The memory-plan stage's solve in a step's first run: what the step may free stays observable."""

from __future__ import annotations

import types

import numpy as np
import pytest

from dpcs_compiler.cost.memory_model import RECOMPUTE, SAVE, Candidate, MemoryProblem
from dpcs_compiler.cost.step_model import StepContext
from dpcs_compiler.passes.analysis.planning import Freeable
from dpcs_compiler.stages.memory_plan import _solve_in_step


def problem() -> MemoryProblem:
    # Base 100 B, backward from step 5. Recomputing "a" (50 B) takes the peak from 180 B to 150 B; recomputing
    # "b" (30 B) alone lowers nothing (it is alive at its making, with "a").
    return MemoryProblem(
        base_bytes=np.full(10, 100),
        step_seconds=np.ones(10),
        backward_start=5,
        candidates=(
            Candidate("a", 50, 0, 0, 8, 9, recompute_seconds=1.0),
            Candidate("b", 30, 1, 1, 6, 7, recompute_seconds=1.0),
        ),
    )


def sharing(*readers: str):
    """A graph input the step may free before the backward, read by recomputing `readers`."""
    return types.SimpleNamespace(freeable=[Freeable(nbytes=8, inputs=(0,), outputs=(), readers=readers)])


@pytest.mark.parametrize("target, decisions, observed", [
    (200, (SAVE, SAVE), True),  # fits keeping "a" saved: kept, so the step shows whether it frees the input
    (160, (RECOMPUTE, SAVE), False),  # only recomputing "a" fits: a first step is not put over its budget
    (100, (SAVE, SAVE), True),  # nothing fits: the plan that shows it
])
def test_the_first_step_keeps_saved_what_reads_a_buffer_the_step_may_free_where_that_fits(target, decisions, observed):
    context, solution = _solve_in_step(problem(), StepContext(first_step=True), target, sharing("a"))
    assert solution.decisions[0] == decisions[0] and solution.feasible == (target > 100)
    assert (context.keep_saved == ("a",)) == observed


def test_after_the_first_step_or_without_such_a_buffer_the_plan_is_free():
    for context, readers in ((StepContext(), ("a",)), (StepContext(first_step=True), ())):
        kept, solution = _solve_in_step(problem(), context, 160, sharing(*readers))
        assert kept == context and solution.decisions[0] == RECOMPUTE and solution.feasible
    # A reader that costs nothing to keep saved is kept saved: "a" is still recomputed.
    kept, solution = _solve_in_step(problem(), StepContext(first_step=True), 160, sharing("b"))
    assert kept.keep_saved == ("b",) and solution.decisions == (RECOMPUTE, SAVE) and solution.feasible
