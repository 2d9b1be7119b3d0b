"""Solvers: from a `MemoryProblem` and a budget in bytes to one decision per candidate.

`solve_exact` (a mixed-integer program, HiGHS) is optimal; `solve_fast` (greedy, Lagrangian prices, local
search) scales to thousands of candidates. `solve` picks one. Every `Solution` is measured with
`cost.memory_model.plan_memory` / `plan_seconds`, the one peak formula.
"""

from __future__ import annotations

from dpcs_compiler.cost.memory_model import MemoryProblem
from dpcs_compiler.solve.exact import solve_exact
from dpcs_compiler.solve.fast import solve_fast
from dpcs_compiler.solve.solution import Solution

METHODS = ("auto", "exact", "fast")
EXACT_MAX_CANDIDATES = 300  # "auto" solves exactly up to this many candidates


def solve(problem: MemoryProblem, budget_bytes: int, *, method: str = "auto") -> Solution:
    """The fastest plan within `budget_bytes` by `method`: "exact", "fast", or "auto" (exact for up to
    `EXACT_MAX_CANDIDATES` candidates, else fast)."""
    if method not in METHODS:
        raise ValueError(f"solver method {method!r} is not valid; valid choices: {', '.join(METHODS)}")
    if method == "exact" or (method == "auto" and len(problem.candidates) <= EXACT_MAX_CANDIDATES):
        return solve_exact(problem, budget_bytes)
    return solve_fast(problem, budget_bytes)


__all__ = ["EXACT_MAX_CANDIDATES", "METHODS", "Solution", "solve", "solve_exact", "solve_fast"]
