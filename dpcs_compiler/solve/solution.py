"""What a solver returns, measured with the one peak formula (`plan_memory`) and time model (`plan_seconds`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dpcs_compiler.cost.memory_model import DECISIONS, OFFLOAD, MemoryProblem, plan_memory, plan_seconds
from dpcs_compiler.solve.timeline import SAVE_, Timeline

FREE_SECONDS = 1e-15  # an added time at or below this counts as free


@dataclasses.dataclass(frozen=True)
class Solution:
    """One decision per candidate, with the peak and added time `plan_memory` / `plan_seconds` give for it.

    feasible: the peak fits the budget. When no plan fits, solvers return the lowest peak they reach.
    """

    decisions: tuple[str, ...]
    peak_bytes: int
    added_seconds: float
    budget_bytes: int
    feasible: bool
    solver: str
    solve_seconds: float


def measured_solution(
    problem: MemoryProblem, decisions: Sequence[str], budget_bytes: int, solver: str, solve_seconds: float
) -> Solution:
    """A `Solution` for `decisions`, its peak and time always recomputed with the memory model (never a
    solver's own formulation)."""
    decisions = tuple(decisions)
    peak = plan_memory(problem, decisions).peak_bytes
    return Solution(
        decisions=decisions,
        peak_bytes=peak,
        added_seconds=plan_seconds(problem, decisions),
        budget_bytes=int(budget_bytes),
        feasible=peak <= budget_bytes,
        solver=solver,
        solve_seconds=solve_seconds,
    )


def solved_solution(
    problem: MemoryProblem, decisions: Sequence[str], budget_bytes: int, solver: str, solve_seconds: float
) -> Solution:
    """A solver's answer: `measured_solution` of its decisions with every free offload saved instead where
    that keeps the plan within the budget (over it, where the peak does not rise). An offload whose copies
    hide and whose ops cost nothing (a profile that says so) ties with keeping the value, and a solver may
    land on either; moving memory that lowers no peak is never the better of the two.

    One pass on a `Timeline` (saving an offload only adds bytes, in its gap): a `plan_memory` per free offload
    cost 1.3 s on a 2,500-step problem with 392 of them."""
    free = [i for i, d in enumerate(decisions) if d == OFFLOAD and problem.offload_seconds(i) <= FREE_SECONDS]
    if free:
        tl = Timeline(problem)
        tl.reset([DECISIONS.index(d) for d in decisions])
        limit = max(int(budget_bytes), tl.peak())
        for i in free:
            move = tl.change(i, SAVE_)
            if tl.raises_to(move) <= limit:
                tl.apply(move)
        decisions = tl.decisions()
    return measured_solution(problem, decisions, budget_bytes, solver, solve_seconds)
