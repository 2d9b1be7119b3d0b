"""Solvers: from a `MemoryProblem` and a budget in bytes to one decision per candidate.

`solve_exact` (a mixed-integer program, HiGHS) is optimal; `solve_fast` (greedy, Lagrangian prices, local
search) scales to thousands of candidates. `solve` picks one. Every `Solution` is measured with
`cost.memory_model.plan_memory` / `plan_seconds`, the one peak formula.
"""

from __future__ import annotations

from dpcs_compiler.cost.memory_model import MemoryProblem
from dpcs_compiler.fresh_stack import on_fresh_stack
from dpcs_compiler.solve.exact import solve_exact
from dpcs_compiler.solve.fast import solve_fast
from dpcs_compiler.solve.solution import Solution, measured_solution

METHODS = ("auto", "exact", "fast")
# "auto" solves exactly up to this many candidates, within AUTO_EXACT_SECONDS (then the better of the
# exact solver's best plan and the fast one). Measured on a 2,460-node GPT joint graph (189 candidates,
# CPU): exact 2.6-83 s, fast 0.09-0.41 s with no gap to it; on 30-60 random candidates the fast gap is 0.2%.
EXACT_MAX_CANDIDATES = 60
AUTO_EXACT_SECONDS = 10.0


def solve(problem: MemoryProblem, budget_bytes: int, *, method: str = "auto") -> Solution:
    """The fastest plan within `budget_bytes` by `method`: "exact", "fast", or "auto" (exact for up to
    `EXACT_MAX_CANDIDATES` candidates within `AUTO_EXACT_SECONDS`, else fast)."""
    if method not in METHODS:
        raise ValueError(f"solver method {method!r} is not valid; valid choices: {', '.join(METHODS)}")
    # On a fresh stack: called deep inside a compile, the solvers' loops can cross a CPython stack chunk's
    # boundary on every call (`fresh_stack`).
    if method == "exact":
        return on_fresh_stack(solve_exact, problem, budget_bytes)
    if method == "auto" and len(problem.candidates) <= EXACT_MAX_CANDIDATES:
        return on_fresh_stack(solve_exact, problem, budget_bytes, time_limit_s=AUTO_EXACT_SECONDS)
    return on_fresh_stack(solve_fast, problem, budget_bytes)


def solve_or_measure(problem: MemoryProblem, budget_bytes: int) -> Solution:
    """`solve`, or, for a problem with nothing to decide, its one plan measured."""
    return solve(problem, budget_bytes) if problem.candidates else measured_solution(problem, (), budget_bytes, "none", 0.0)


def solved_decisions(problem: MemoryProblem, budget_bytes: int) -> tuple[tuple[str, ...], bool]:
    """The solver as the step model takes it (`cost/step_model.Solver`): (decisions, feasible)."""
    solution = solve_or_measure(problem, budget_bytes)
    return solution.decisions, solution.feasible


def fits(problem: MemoryProblem, budget_bytes: int) -> tuple[tuple[str, ...], bool]:
    """Whether a plan within `budget_bytes` exists, as searches over many budgets ask it (the step planner's
    levels, the first step's least-held cap): the fast solver, without its search for the lowest peak when
    nothing fits, and without the local search that makes a fitting plan faster (those searches keep whether
    a graph fits and what it then holds; the plan compiled is solved again, in full). (decisions, feasible);
    the decisions of an infeasible answer are only the best found."""
    if not problem.candidates:
        solution = measured_solution(problem, (), budget_bytes, "none", 0.0)
    else:
        solution = on_fresh_stack(solve_fast, problem, budget_bytes, lowest_when_over=False, local_search=False)
    return solution.decisions, solution.feasible


__all__ = [
    "AUTO_EXACT_SECONDS", "EXACT_MAX_CANDIDATES", "METHODS", "Solution", "fits", "solve", "solve_exact", "solve_fast",
    "solve_or_measure", "solved_decisions",
]
