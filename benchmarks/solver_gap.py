"""The fast solver against the exact optimum, and the fast solver's time on a big problem.

    python benchmarks/solver_gap.py [--out benchmarks/results] [--quick]

For random training-shaped problems (`dpcs_compiler.solve.synthetic.random_problem`) of four sizes, at five
budgets each between the lowest reachable peak and the all-SAVE peak: the fast solver's relative gap in
added seconds to the exact solver's optimum (mean, median, max), how often it missed a budget the exact
solver met, and both solvers' times. Then the fast solver's time on 2,500 steps and 400 candidates (median
of three runs per budget). Writes JSON with the platform and library versions inside.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import scipy
import torch
from rich.console import Console
from rich.table import Table

from dpcs_compiler.cost.memory_model import plan_memory
from dpcs_compiler.solve import solve_exact, solve_fast
from dpcs_compiler.solve.synthetic import random_problem

FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)
# label, candidates [lo, hi), steps [lo, hi), seeds (full run), seeds (--quick)
SIZES = [
    ("30-45 candidates, 200-300 steps", (30, 45), (200, 300), range(0, 24), range(0, 6)),
    ("45-60 candidates, 300-400 steps", (45, 61), (300, 401), range(100, 124), range(100, 106)),
    ("80-150 candidates, 500-1000 steps", (80, 151), (500, 1001), range(200, 212), range(200, 203)),
    ("200-300 candidates, 1500-2500 steps", (200, 301), (1500, 2501), range(300, 306), range(300, 302)),
]
BIG_FRACTIONS = (0.1, 0.5, 0.9)  # of the way from the largest base bytes to the all-SAVE peak


def timed(fn, *args):
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def gap_rows(quick: bool) -> list[dict]:
    rows = []
    for label, candidates, steps, seeds, quick_seeds in SIZES:
        gaps, missed, exact_times, fast_times = [], 0, [], []
        for seed in quick_seeds if quick else seeds:
            rng = np.random.default_rng(seed)
            size = {"steps": int(rng.integers(*steps)), "candidates": int(rng.integers(*candidates))}
            problem = random_problem(seed, **size, can_offload=seed % 2 == 0)
            lowest = solve_exact(problem, 0).peak_bytes
            saved = plan_memory(problem, problem.all_saved()).peak_bytes
            for fraction in FRACTIONS:
                budget = int(lowest + fraction * (saved - lowest))
                exact, exact_s = timed(solve_exact, problem, budget)
                fast, fast_s = timed(solve_fast, problem, budget)
                exact_times.append(exact_s)
                fast_times.append(fast_s)
                if not fast.feasible:
                    missed += 1
                    continue
                base = exact.added_seconds
                gaps.append((fast.added_seconds - base) / base if base else 0.0)
        rows.append(
            {
                "size": label,
                "problems": len(quick_seeds if quick else seeds),
                "budgets": len(gaps) + missed,
                "mean_gap": float(np.mean(gaps)),
                "median_gap": float(np.median(gaps)),
                "max_gap": float(np.max(gaps)),
                "fast_missed": missed,
                "exact_seconds_median": statistics.median(exact_times),
                "exact_seconds_max": max(exact_times),
                "fast_seconds_median": statistics.median(fast_times),
                "fast_seconds_max": max(fast_times),
            }
        )
    return rows


def big_rows(quick: bool) -> list[dict]:
    rows = []
    for seed, can_offload in ((0, False), (1, False), (0, True)) if not quick else ((0, False),):
        problem = random_problem(seed, steps=2500, candidates=400, can_offload=can_offload)
        saved = plan_memory(problem, problem.all_saved()).peak_bytes
        floor = int(problem.base_bytes.max())
        for fraction in BIG_FRACTIONS:
            budget = int(floor + fraction * (saved - floor))
            runs = [timed(solve_fast, problem, budget) for _ in range(3)]
            solution = runs[-1][0]
            rows.append(
                {
                    "seed": seed,
                    "can_offload": can_offload,
                    "budget_fraction": fraction,
                    "seconds_median": statistics.median(s for _, s in runs),
                    "feasible": solution.feasible,
                    "added_seconds": solution.added_seconds,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="fewer seeds (a smoke run)")
    args = parser.parse_args()
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rows, big = gap_rows(args.quick), big_rows(args.quick)

    console = Console(width=160)
    table = Table(title=f"fast vs exact solver - {cpu}, torch {torch.__version__}, scipy {scipy.__version__}")
    columns = ("size", "budgets", "mean gap", "median gap", "max gap", "fast missed")
    for column in (*columns, "exact s (med/max)", "fast s (med/max)"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["size"], str(r["budgets"]), f"{r['mean_gap']:.3%}", f"{r['median_gap']:.3%}", f"{r['max_gap']:.2%}",
            str(r["fast_missed"]), f"{r['exact_seconds_median']:.3f} / {r['exact_seconds_max']:.3f}",
            f"{r['fast_seconds_median']:.3f} / {r['fast_seconds_max']:.3f}",
        )
    console.print(table)
    big_table = Table(title="fast solver on 2,500 steps x 400 candidates (median of 3 runs)")
    for column in ("seed", "offload", "budget", "seconds", "fits", "added ms"):
        big_table.add_column(column, justify="right")
    for r in big:
        big_table.add_row(
            str(r["seed"]), str(r["can_offload"]), f"{r['budget_fraction']:.0%}", f"{r['seconds_median']:.3f}",
            str(r["feasible"]), f"{r['added_seconds'] * 1e3:.3f}",
        )
    console.print(big_table)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "solver_gap.json"
    payload = {
        "platform": platform.platform(),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "quick": args.quick,
        "budget_fractions": FRACTIONS,
        "gap": rows,
        "fast_2500_steps_400_candidates": big,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
