"""The exact solver against brute force over every allowed plan, and `solve`'s dispatch."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest

from dpcs_compiler.cost.memory_model import (
    DECISIONS,
    OFFLOAD,
    RECOMPUTE,
    SAVE,
    MemoryProblem,
    plan_memory,
    plan_seconds,
)
from dpcs_compiler.solve import EXACT_MAX_CANDIDATES, solve, solve_exact
from dpcs_compiler.solve.synthetic import random_problem

SEEDS = range(12)
BUDGETS = ("below_lowest", "lowest", "tight", "middle", "just_under_all_saved")


def tiny_problem(seed: int) -> MemoryProblem:
    """Seven candidates, half with transients, offloadable on even seeds; on every third seed the bytes alive
    before some steps exceed those during them (the recomputation row then binds on its own)."""
    problem = random_problem(seed, steps=40, candidates=7, can_offload=seed % 2 == 0, transient_fraction=0.5)
    if seed % 3:
        return problem
    rng = np.random.default_rng(seed)
    lift = (rng.random(problem.steps) < 0.5) * rng.integers(0, 8 << 20, problem.steps)
    return dataclasses.replace(problem, base_before_bytes=problem.base_bytes + lift)


def allowed(problem: MemoryProblem) -> list[list[str]]:
    return [
        [d for d in DECISIONS if d == SAVE or (d == RECOMPUTE and c.can_recompute) or (d == OFFLOAD and c.can_offload)]
        for c in problem.candidates
    ]


@functools.cache
def brute_force(seed: int) -> tuple[MemoryProblem, list[tuple[int, float]]]:
    """The problem and (peak, seconds) of every allowed plan, by the memory model itself."""
    problem = tiny_problem(seed)
    plans = itertools.product(*allowed(problem))
    return problem, [(plan_memory(problem, d).peak_bytes, plan_seconds(problem, d)) for d in plans]


def budget_for(kind: str, lowest: int, saved: int) -> int:
    return {
        "below_lowest": lowest - 1,
        "lowest": lowest,
        "tight": lowest + (saved - lowest) // 5,
        "middle": (lowest + saved) // 2,
        "just_under_all_saved": saved - 1,
    }[kind]


@pytest.mark.parametrize("kind", BUDGETS)
@pytest.mark.parametrize("seed", SEEDS)
def test_exact_matches_brute_force(seed: int, kind: str) -> None:
    problem, plans = brute_force(seed)
    lowest = min(peak for peak, _ in plans)
    budget = budget_for(kind, lowest, plan_memory(problem, problem.all_saved()).peak_bytes)
    fitting = [seconds for peak, seconds in plans if peak <= budget]
    solution = solve_exact(problem, budget)
    assert solution.solver == "exact"
    if fitting:
        assert solution.feasible
        assert solution.peak_bytes <= budget
        assert solution.added_seconds == pytest.approx(min(fitting), rel=1e-9, abs=1e-15)
    else:  # no plan fits: the lowest peak, and the fastest plan reaching it
        assert not solution.feasible
        assert solution.peak_bytes == lowest
        fastest_lowest = min(seconds for peak, seconds in plans if peak == lowest)
        assert solution.added_seconds == pytest.approx(fastest_lowest, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("seed", SEEDS)
def test_lowest_peak_is_found_and_proven_from_the_worst_start(monkeypatch, seed: int) -> None:
    """No plan fits: the search for the lowest peak starts from the fast solver's lowest plan. Started from
    the plan that saves everything instead (the highest peak), the bisection still ends at the lowest peak
    and the fastest plan there, proven (solver "exact", not the fast fallback)."""
    import dpcs_compiler.solve.exact as exact

    problem, plans = brute_force(seed)
    lowest = min(peak for peak, _ in plans)
    started, fast = [], exact.solve_fast

    def worst_start(problem, budget, **kwargs):
        started.append(budget)
        return dataclasses.replace(fast(problem, budget, **kwargs), decisions=problem.all_saved())

    monkeypatch.setattr(exact, "solve_fast", worst_start)
    solution = solve_exact(problem, lowest - 1)
    assert started == [lowest - 1]  # the start was asked for once (and reused had it been needed again)
    assert solution.solver == "exact" and not solution.feasible and solution.peak_bytes == lowest
    fastest_lowest = min(seconds for peak, seconds in plans if peak == lowest)
    assert solution.added_seconds == pytest.approx(fastest_lowest, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("seed", range(4))
def test_solution_is_measured_by_the_memory_model(seed: int) -> None:
    problem = random_problem(seed, steps=200, candidates=30, can_offload=seed % 2 == 0)
    budget = int(0.9 * plan_memory(problem, problem.all_saved()).peak_bytes)
    solution = solve_exact(problem, budget)
    assert len(solution.decisions) == len(problem.candidates)
    assert solution.peak_bytes == plan_memory(problem, solution.decisions).peak_bytes
    assert solution.added_seconds == plan_seconds(problem, solution.decisions)
    assert solution.budget_bytes == budget
    assert solution.feasible == (solution.peak_bytes <= budget)
    assert solution.solve_seconds > 0


def test_forbidden_decisions_are_never_chosen() -> None:
    base = random_problem(3, steps=120, candidates=20, can_offload=True)
    # Every other candidate may only be saved; the rest may only be offloaded.
    candidates = tuple(
        dataclasses.replace(c, can_recompute=False, can_offload=i % 2 == 1) for i, c in enumerate(base.candidates)
    )
    problem = dataclasses.replace(base, candidates=candidates)
    solution = solve_exact(problem, 0)  # unreachable: the lowest peak
    assert not solution.feasible
    assert all(d == SAVE for d in solution.decisions[::2])
    assert set(solution.decisions[1::2]) <= {SAVE, OFFLOAD}
    assert OFFLOAD in solution.decisions  # the lowest peak does need the offloads


def test_nothing_allowed_returns_all_saved() -> None:
    base = random_problem(4, steps=80, candidates=10, can_offload=False)
    candidates = tuple(dataclasses.replace(c, can_recompute=False) for c in base.candidates)
    problem = dataclasses.replace(base, candidates=candidates)
    solution = solve_exact(problem, 0)
    assert solution.decisions == problem.all_saved()
    assert not solution.feasible


def test_all_saved_when_it_fits() -> None:
    problem = random_problem(5, steps=100, candidates=15)
    solution = solve_exact(problem, plan_memory(problem, problem.all_saved()).peak_bytes)
    assert solution.decisions == problem.all_saved()
    assert solution.feasible and solution.added_seconds == 0.0


def test_no_candidates() -> None:
    problem = dataclasses.replace(random_problem(6, steps=50, candidates=3), candidates=())
    solution = solve_exact(problem, 0)
    assert solution.decisions == () and not solution.feasible
    assert solution.peak_bytes == int(problem.base_bytes.max())


def test_out_of_time_still_returns_a_measured_plan() -> None:
    problem = random_problem(7, steps=600, candidates=120, can_offload=False)
    saved = plan_memory(problem, problem.all_saved()).peak_bytes
    solution = solve_exact(problem, int(0.8 * saved), time_limit_s=0.0)
    assert solution.solver in ("exact", "fast")
    assert solution.peak_bytes == plan_memory(problem, solution.decisions).peak_bytes
    assert solution.feasible


def test_solve_auto_picks_by_size() -> None:
    small = random_problem(8, steps=100, candidates=12)
    budget = int(0.8 * plan_memory(small, small.all_saved()).peak_bytes)
    assert solve(small, budget).solver == "exact"
    assert solve(small, budget, method="fast").solver == "fast"
    big = random_problem(8, steps=2 * EXACT_MAX_CANDIDATES + 100, candidates=EXACT_MAX_CANDIDATES + 1)
    assert solve(big, plan_memory(big, big.all_saved()).peak_bytes).solver == "fast"


def test_solve_rejects_unknown_method() -> None:
    problem = random_problem(9, steps=50, candidates=4)
    with pytest.raises(ValueError, match=r"'greedy'.*auto, exact, fast"):
        solve(problem, 0, method="greedy")
