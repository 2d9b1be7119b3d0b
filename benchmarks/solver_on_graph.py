"""The solvers on a real joint graph of about 2,500 nodes: a MiniGPT deep enough to get there.

    python benchmarks/solver_on_graph.py [--layers 14] [--out benchmarks/results]

Builds the planning problem dpcs builds for the graph (eager compiler, CPU), then times the fast and the
exact solver at budgets between the lowest reachable peak and the peak of saving everything; writes
`solver_on_graph_cpu.json` with the joint graph's node count, candidates, times and the fast solver's gap.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import dpcs_compiler.stages.memory_plan as memory_plan
from dpcs_compiler.cost.memory_model import plan_memory
from dpcs_compiler.models import workload
from dpcs_compiler.solve import solve_exact, solve_fast


def capture_problem(layers: int):
    """The MemoryProblem dpcs plans for a `layers`-layer MiniGPT, and the joint graph's node count."""
    captured = {}
    original = memory_plan.planning_graph

    def capture(schedule, analyses=None):
        captured["planning"] = original(schedule, analyses)
        captured["joint_nodes"] = len(schedule.graphs[0].graph.nodes)
        return captured["planning"]

    real_solve = memory_plan.solve

    def keep_problem(problem, budget):
        captured["problem"] = problem
        return real_solve(problem, budget, method="fast")

    memory_plan.planning_graph = capture
    memory_plan.solve = keep_problem
    try:
        w = workload("gpt", 2, layers=layers)
        compiled = torch.compile(w.model, backend="dpcs", options={"compiler": "eager", "memory_budget": 2**40})
        w.loss_fn(compiled(*w.inputs)).backward()
    finally:
        memory_plan.planning_graph = original
        memory_plan.solve = real_solve
    return captured["problem"], captured["joint_nodes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    problem, joint_nodes = capture_problem(args.layers)
    high = plan_memory(problem, problem.all_saved()).peak_bytes
    low = solve_fast(problem, 0).peak_bytes
    rows = []
    for fraction in (0.0, 0.25, 0.5, 0.75, 0.9):
        budget = int(low + fraction * (high - low))
        fast_times, fast = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            fast = solve_fast(problem, budget)
            fast_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        exact = solve_exact(problem, budget, time_limit_s=120.0)
        exact_seconds = time.perf_counter() - start
        gap = (fast.added_seconds - exact.added_seconds) / exact.added_seconds if exact.added_seconds > 0 else 0.0
        rows.append(
            {
                "budget_bytes": budget, "fast_seconds": statistics.median(fast_times), "exact_seconds": exact_seconds,
                "fast_feasible": fast.feasible, "exact_feasible": exact.feasible, "exact_solver": exact.solver,
                "fast_added_seconds": fast.added_seconds, "exact_added_seconds": exact.added_seconds, "gap": gap,
                "fast_peak_bytes": fast.peak_bytes, "exact_peak_bytes": exact.peak_bytes,
            }
        )
        print(
            f"budget {budget / 2**20:8.2f} MiB: fast {statistics.median(fast_times):.3f} s "
            f"(fits {fast.feasible}), exact {exact_seconds:.2f} s (fits {exact.feasible}), gap {gap * 100:.2f}%"
        )
    result = {
        "device": "cpu", "platform": platform.processor() or platform.machine(), "torch": torch.__version__,
        "layers": args.layers, "joint_nodes": joint_nodes, "steps": problem.steps,
        "candidates": len(problem.candidates), "lowest_peak_bytes": low, "save_all_peak_bytes": high, "rows": rows,
        "fast_seconds_max": max(r["fast_seconds"] for r in rows), "mean_gap": float(np.mean([r["gap"] for r in rows])),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "solver_on_graph_cpu.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{joint_nodes} joint nodes, {problem.steps} steps, {len(problem.candidates)} candidates; wrote {path}")


if __name__ == "__main__":
    main()
