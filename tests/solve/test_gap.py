"""The fast solver's added time against the exact optimum, on problems the exact solver settles quickly."""

from __future__ import annotations

import numpy as np
import pytest

from dpcs_compiler.cost.memory_model import plan_memory
from dpcs_compiler.solve import solve_exact, solve_fast
from dpcs_compiler.solve.synthetic import random_problem

FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)  # budgets between the lowest reachable peak and the all-SAVE peak


def gaps(seeds: range, candidates: tuple[int, int], steps: tuple[int, int]) -> tuple[list[float], int]:
    """Relative gaps of fast to exact over seeds x budgets, and how often fast missed a budget exact met."""
    out, missed = [], 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        problem = random_problem(
            seed, steps=int(rng.integers(*steps)), candidates=int(rng.integers(*candidates)), can_offload=seed % 2 == 0
        )
        lowest = solve_exact(problem, 0).peak_bytes
        saved = plan_memory(problem, problem.all_saved()).peak_bytes
        for fraction in FRACTIONS:
            budget = int(lowest + fraction * (saved - lowest))
            exact, fast = solve_exact(problem, budget), solve_fast(problem, budget)
            assert exact.feasible and exact.solver == "exact"
            assert fast.added_seconds >= exact.added_seconds * (1 - 1e-9)  # nothing beats the optimum
            if not fast.feasible:
                missed += 1
                continue
            out.append((fast.added_seconds - exact.added_seconds) / exact.added_seconds if exact.added_seconds else 0.0)
    return out, missed


@pytest.mark.parametrize(
    ("seeds", "candidates", "steps"),
    [(range(0, 12), (30, 45), (200, 300)), (range(100, 112), (45, 61), (300, 401))],
    ids=["30-45-candidates", "45-60-candidates"],
)
def test_fast_is_within_one_percent_of_exact_on_average(
    seeds: range, candidates: tuple[int, int], steps: tuple[int, int]
) -> None:
    found, missed = gaps(seeds, candidates, steps)
    assert missed == 0, f"fast missed {missed} budgets the exact solver met"
    assert np.mean(found) <= 0.01, f"mean gap {np.mean(found):.4%}, max {np.max(found):.4%}"
