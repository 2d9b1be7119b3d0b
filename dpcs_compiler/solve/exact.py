"""The exact solver: the plan problem as a mixed-integer program, solved by HiGHS (`scipy.optimize.milp`).

Columns: s_c, r_c, o_c (save, recompute, offload; one per candidate) and, for a recomputed candidate that a
recomputed consumer may pull earlier, a[c, v] = "c is recomputed and made again at or before step v". The
a's are pinned to exactly that boolean (an AND/OR of binaries, each bound written both ways), so the memory
rows equal `plan_memory` at every integral point: the program is the memory model itself, not a bound on
it. Rows: in each stretch between events (where no candidate's bytes can change) the step with the most
base bytes; and for each step t where a candidate c with a transient may be made again, the recomputation's
own row, active only when c is made again exactly at t (before[t] + candidates at t + c's transient).

Every plan returned is measured with `plan_memory`. Row bounds sit half a byte above the budget; a plan
HiGHS's tolerances still let over the budget is cut off and the program solved again. When no plan fits,
the lowest peak is searched from the fast solver's lowest plan (is there a plan under it?), then the
fastest plan at that peak is found.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Iterator

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from dpcs_compiler.cost.memory_model import DECISIONS, MemoryProblem, plan_memory
from dpcs_compiler.solve.fast import solve_fast
from dpcs_compiler.solve.solution import Solution, measured_solution, solved_solution

_RETIGHTEN_LIMIT = 20
_CUT_LIMIT = 5
# Tolerances: HiGHS's defaults (1e-6, 1e-7) could pass a plan a byte over the budget for one that fits.
# RINS/RENS off: they were slightly slower here (and their sub-MIPs print HiGHS 1.12's stray line, below).
_HIGHS_OPTIONS = {
    "mip_feasibility_tolerance": 1e-9,
    "primal_feasibility_tolerance": 1e-9,
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
}


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null for the duration: HiGHS 1.12 (scipy 1.17) printf's a debug line,
    "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();", from heuristics worth keeping
    (ERGO-Code/HiGHS#2783, fixed upstream). Python-level output is flushed first and is unaffected after."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        yield  # no usable descriptor 1: nothing to silence
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
    """The budget-independent part of the program: memory rows (candidate bytes per variable, and the base
    bytes of the row's step), the rows defining the a's, and the objective."""

    columns: int
    binaries: int  # the first `binaries` columns are s, r, o per candidate
    upper: np.ndarray  # column upper bounds (0 for forbidden decisions)
    cost: np.ndarray  # seconds per column
    row_base: np.ndarray  # int64 [rows]: the row's constant bytes (base, or before, at its step)
    row_most: np.ndarray  # int64 [rows]: the most candidate bytes any plan can have there
    memory: coo_array  # [rows, columns] candidate bytes
    link: coo_array  # [links, columns]
    link_upper: np.ndarray


def _formulate(problem: MemoryProblem) -> _Program:
    """Build the program's rows and columns (see module docstring)."""
    cands = problem.candidates
    n = len(cands)
    consumers: list[list[int]] = [[] for _ in range(n)]
    for d, c in enumerate(cands):
        for j in c.recompute_inputs:
            consumers[j].append(d)
    # Every step each candidate may be made again at: its first backward use, or one a recomputed consumer
    # may be made again at (materialize_steps, unrolled).
    remake: list[list[int]] = [[] for _ in range(n)]
    for i in reversed(range(n)):
        c = cands[i]
        if c.can_recompute:
            steps = {c.first_backward_use}
            for d in consumers[i]:
                steps.update(v for v in remake[d] if v < c.first_backward_use)
            remake[i] = sorted(steps)
    free = [problem.offload_free_step(i) if c.can_offload else -1 for i, c in enumerate(cands)]
    reload = [problem.reload_step(i) if c.can_offload else -1 for i, c in enumerate(cands)]

    upper = [1.0] * (3 * n)
    cost = [0.0] * (3 * n)
    for i, c in enumerate(cands):
        upper[3 * i + 1] = 1.0 if c.can_recompute else 0.0
        upper[3 * i + 2] = 1.0 if c.can_offload else 0.0
        cost[3 * i + 1] = c.recompute_seconds if c.can_recompute else 0.0
        cost[3 * i + 2] = problem.offload_seconds(i) if c.can_offload else 0.0

    link_rows: list[int] = []
    link_cols: list[int] = []
    link_vals: list[float] = []
    link_upper: list[float] = []
    aux: dict[tuple[int, int], int] = {}

    def add_link(terms: list[tuple[int, float]], ub: float) -> None:
        row = len(link_upper)
        for col, val in terms:
            link_rows.append(row)
            link_cols.append(col)
            link_vals.append(val)
        link_upper.append(ub)

    def made_by(c: int, t: int) -> int | None:
        """The column equal to "c recomputed and made again at or before t" (None: never true)."""
        if t >= cands[c].first_backward_use:
            return 3 * c + 1 if cands[c].can_recompute else None
        k = bisect.bisect_right(remake[c], t) - 1
        if k < 0:
            return None
        v = remake[c][k]
        if (c, v) in aux:
            return aux[(c, v)]
        col = len(upper)
        aux[(c, v)] = col
        upper.append(1.0)
        cost.append(0.0)
        r = 3 * c + 1
        xs = [x for x in (made_by(d, v) for d in consumers[c]) if x is not None]
        # a = r AND (x_1 OR ... OR x_k): a <= r, a <= sum x, a >= r + x_k - 1.
        add_link([(col, 1.0), (r, -1.0)], 0.0)
        add_link([(col, 1.0)] + [(x, -1.0) for x in xs], 0.0)
        for x in xs:
            add_link([(r, 1.0), (x, 1.0), (col, -1.0)], 1.0)
        return col

    def candidate_bytes(t: int) -> tuple[dict[int, float], int]:
        """The candidates' bytes alive at step t, per column; and the most any plan has there."""
        terms: dict[int, float] = {}

        def put(col: int | None, val: float) -> None:
            if col is not None and val:
                terms[col] = terms.get(col, 0.0) + val

        most = 0
        for i, c in enumerate(cands):
            if not c.produced <= t <= c.last_use:
                continue
            nb = c.nbytes
            options = [nb]  # save
            put(3 * i, nb)
            if c.can_recompute:
                forward = nb if t <= c.last_forward_use else 0
                put(3 * i + 1, forward)
                put(made_by(i, t), nb)
                latest = forward + (nb if t >= c.first_backward_use else 0)
                earliest = forward + (nb if t >= remake[i][0] else 0)
                options += [latest, earliest]
            if c.can_offload:
                alive = (nb if t <= free[i] else 0) + (nb if t >= reload[i] else 0)
                put(3 * i + 2, alive)
                options.append(alive)
            most += max(options)
        return terms, most

    # Steps where some candidate's bytes may change; between them only the base bytes move.
    events = {0}
    for i, c in enumerate(cands):
        events.update((c.produced, c.last_forward_use + 1, c.first_backward_use, c.last_use + 1))
        events.update(remake[i])
        if c.can_offload:
            events.update((free[i] + 1, reload[i]))
    bounds = sorted(e for e in events if e < problem.steps) + [problem.steps]
    base, before = problem.base_bytes, problem.base_before_bytes
    rows: list[tuple[dict[int, float], int, int]] = []  # terms, base, most
    stretch: dict[int, tuple[dict[int, float], int]] = {}  # first step -> its candidate bytes
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        t = lo + int(np.argmax(base[lo:hi]))
        terms, most = stretch[lo] = candidate_bytes(t)
        rows.append((terms, int(base[t]), most))
    # Remaking c at t with a transient: before[t] + candidates at t + its transient (plan_memory takes the
    # larger of that and the step's own row). m = made_by(c, t) - made_by(c, t - 1) says c is remade at t.
    # Where before[t] > base[t], D = before - base is charged with m too, so that at m = 0 the row is the
    # step's own row again (no transient, no "before" term).
    for i, c in enumerate(cands):
        if not (c.can_recompute and c.recompute_transient):
            continue
        for t in remake[i]:
            terms, most = stretch[t]  # t starts a stretch: remake steps are events
            terms = dict(terms)
            extra = c.recompute_transient + max(0, int(before[t]) - int(base[t]))
            for col, sign in ((made_by(i, t), 1.0), (made_by(i, t - 1), -1.0)):
                if col is not None:
                    terms[col] = terms.get(col, 0.0) + sign * extra
            rows.append((terms, min(int(before[t]), int(base[t])), most + extra))

    mem_rows: list[int] = []
    mem_cols: list[int] = []
    mem_vals: list[float] = []
    for row, (terms, _, _) in enumerate(rows):
        for col, val in terms.items():
            mem_rows.append(row)
            mem_cols.append(col)
            mem_vals.append(val)

    columns = len(upper)
    return _Program(
        columns=columns,
        binaries=3 * n,
        upper=np.array(upper),
        cost=np.array(cost),
        row_base=np.array([r[1] for r in rows], dtype=np.int64),
        row_most=np.array([r[2] for r in rows], dtype=np.int64),
        memory=coo_array((mem_vals, (mem_rows, mem_cols)), shape=(len(rows), columns)),
        link=coo_array((link_vals, (link_rows, link_cols)), shape=(len(link_upper), columns)),
        link_upper=np.array(link_upper),
    )


def _decisions(x: np.ndarray, n: int) -> tuple[str, ...]:
    """Round the binaries: each candidate's decision is its largest of s, r, o."""
    return tuple(DECISIONS[int(k)] for k in np.argmax(x[: 3 * n].reshape(n, 3), axis=1))


def _run(
    prog: _Program,
    memory_rhs: np.ndarray,
    keep: np.ndarray,
    cuts: list[np.ndarray],
    seconds: float,
) -> tuple[np.ndarray | None, int]:
    """One HiGHS call, the least added seconds: the kept memory rows (<= memory_rhs, scaled units), the link
    rows, one decision per candidate, and a cut excluding each binary vector in `cuts`. Returns (x or None, HiGHS status: 0
    optimal, 2 infeasible, 1 time limit)."""
    n = prog.binaries // 3
    columns = prog.columns
    memory = (prog.memory.tocsr()[keep] / _byte_unit(prog)).tocoo()
    one_each = coo_array((np.ones(3 * n), (np.repeat(np.arange(n), 3), np.arange(3 * n))), shape=(n, columns))
    constraints = [LinearConstraint(memory, -np.inf, memory_rhs), LinearConstraint(one_each, 1.0, 1.0)]
    if prog.link.shape[0]:
        link = coo_array((prog.link.data, (prog.link.row, prog.link.col)), shape=(prog.link.shape[0], columns))
        constraints.append(LinearConstraint(link, -np.inf, prog.link_upper))
    if cuts:
        chosen = np.array([np.flatnonzero(c) for c in cuts])  # [cuts, n]: the column each plan sets
        at = (np.repeat(np.arange(len(cuts)), n), chosen.ravel())
        cut = coo_array((np.ones(chosen.size), at), shape=(len(cuts), columns))
        constraints.append(LinearConstraint(cut, -np.inf, n - 1.0))
    upper = prog.upper
    # Every column is integer: the a's are 0/1 at every integral point anyway.
    # HiGHS 1.12 (scipy 1.17) returned worse plans as "optimal" when they were continuous (tests/solve).
    integrality = np.ones(columns)
    with warnings.catch_warnings(), _stdout_silenced():
        # The tolerances are HiGHS options scipy passes on verbatim, with a warning that it does.
        warnings.filterwarnings("ignore", message="Unrecognized options detected", category=RuntimeWarning)
        result = milp(
            _scaled_cost(prog),
            constraints=constraints,
            integrality=integrality,
            bounds=Bounds(np.zeros(columns), upper),
            options={"time_limit": max(seconds, 0.01), "mip_rel_gap": 1e-10, **_HIGHS_OPTIONS},
        )
    return result.x, result.status


def _byte_unit(prog: _Program) -> float:
    """Bytes per unit in the scaled memory rows: the largest row total becomes about 1e6 units."""
    return max(1.0, float(prog.row_base.max(initial=0) + prog.row_most.max(initial=0)) / 1e6)


def _scaled_cost(prog: _Program) -> np.ndarray:
    """The objective scaled so that doing everything costs about 1e6 (HiGHS's absolute gap is 1e-6)."""
    total = float(prog.cost.sum())
    return prog.cost * (1e6 / total) if total > 0 else prog.cost.copy()


def _binaries(decisions: tuple[str, ...]) -> np.ndarray:
    x = np.zeros(3 * len(decisions))
    x[3 * np.arange(len(decisions)) + np.array([DECISIONS.index(d) for d in decisions], dtype=np.int64)] = 1.0
    return x


def _min_seconds(
    problem: MemoryProblem, prog: _Program, budget: int, deadline: float
) -> tuple[tuple[str, ...] | None, bool]:
    """The fastest plan whose `plan_memory` peak fits `budget`, or None; and whether that answer is proven
    (optimal, or no plan fits) rather than cut short by the deadline.

    Bytes are integers, so each row's bound sits half a byte above the budget, as far from every fitting
    plan as from every plan over it. A plan HiGHS's tolerances still let over is cut off and the program
    solved again; after a few such cuts the budget itself is tightened (and nothing is claimed proven)."""
    n = len(problem.candidates)
    unit = _byte_unit(prog)
    margin = 0
    cuts: list[np.ndarray] = []
    for attempt in range(_RETIGHTEN_LIMIT):
        room = budget - margin - prog.row_base
        keep = prog.row_most > room  # rows that can never exceed the budget are left out
        if not keep.any():
            # No row can bind: each candidate's cheapest decision fits.
            costs = np.where(prog.upper[: 3 * n] > 0, prog.cost[: 3 * n], np.inf).reshape(n, 3)
            decisions, status = tuple(DECISIONS[int(k)] for k in np.argmin(costs, axis=1)), 0 if not cuts else 1
        else:
            rhs = (room[keep] + 0.5) / unit
            x, status = _run(prog, rhs, keep, cuts, deadline - time.perf_counter())
            if x is None:
                return None, status == 2 and margin == 0
            decisions = _decisions(x, n)
        peak = plan_memory(problem, decisions).peak_bytes
        if peak <= budget:
            return decisions, status == 0 and margin == 0
        if attempt < _CUT_LIMIT:
            cuts.append(_binaries(decisions))
        else:
            margin += peak - budget
    return None, False


def _lowest_peak_fastest(
    problem: MemoryProblem, prog: _Program, budget: int, start: tuple[str, ...], deadline: float
) -> tuple[tuple[str, ...] | None, bool]:
    """The fastest of the plans with the lowest peak, and whether that is proven, when no plan fits `budget`
    (proven): is there a plan under the peak of `start` (the fast solver's lowest plan)? If not, that peak is
    the lowest; if so, the lowest lies between the budget and that plan's peak, found by bisection (each
    probe the fastest plan under a peak, or proof that there is none). Then the fastest plan at that peak.

    The start was a program minimizing the peak: on the quick bench GPT (59 candidates) it took 2.6 s and
    ended 7 KB above the lowest peak (its rows for a remake's transient are not plan_memory's), which a
    descent by one plan at a time reached in six steps of 256 B (0.5 s each). The fast solver's lowest plan
    was the lowest itself: proven in two calls (0.5 s)."""
    lowest, floor = start, plan_memory(problem, start).peak_bytes
    lower, proven = _min_seconds(problem, prog, floor - 1, deadline)
    if lower is not None:
        lowest, floor = lower, plan_memory(problem, lower).peak_bytes
        below = budget  # no plan within it: proven
        while proven and floor - below > 1:
            middle = (below + floor) // 2
            lower, proven = _min_seconds(problem, prog, middle, deadline)
            if lower is not None:
                lowest, floor = lower, plan_memory(problem, lower).peak_bytes
            elif proven:
                below = middle
    if not proven:
        return lowest, False
    fastest, proven = _min_seconds(problem, prog, floor, deadline)
    return (fastest, proven) if fastest is not None else (lowest, False)


def solve_exact(problem: MemoryProblem, budget_bytes: int, *, time_limit_s: float = 60.0) -> Solution:
    """The fastest plan whose peak fits `budget_bytes`; if none fits, the fastest of those with the lowest
    peak (feasible=False). Exact up to HiGHS's tolerances. If `time_limit_s` runs out first it returns the
    better of its best plan so far and `solve_fast`'s (whose `solver` then says "fast")."""
    start = time.perf_counter()
    deadline = start + time_limit_s
    budget_bytes = int(budget_bytes)
    saved = problem.all_saved()
    if not problem.candidates or plan_memory(problem, saved).peak_bytes <= budget_bytes:
        return measured_solution(problem, saved, budget_bytes, "exact", time.perf_counter() - start)
    prog = _formulate(problem)
    decisions, proven = _min_seconds(problem, prog, budget_bytes, deadline)
    fast = None
    if decisions is None and proven:
        fast = solve_fast(problem, budget_bytes)
        decisions, proven = _lowest_peak_fastest(problem, prog, budget_bytes, fast.decisions, deadline)
    if decisions is not None and proven:
        return solved_solution(problem, decisions, budget_bytes, "exact", time.perf_counter() - start)
    best = fast if fast is not None else solve_fast(problem, budget_bytes)
    if decisions is not None:
        exact = solved_solution(problem, decisions, budget_bytes, "exact", 0.0)
        if _rank(exact) <= _rank(best):
            best = exact
    return dataclasses.replace(best, solve_seconds=time.perf_counter() - start)


def _rank(solution: Solution) -> tuple[bool, float]:
    """Order of preference: fitting before not; then faster, or (when neither fits) the lower peak."""
    return (not solution.feasible, solution.added_seconds if solution.feasible else float(solution.peak_bytes))
