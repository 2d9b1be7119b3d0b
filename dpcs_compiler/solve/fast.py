"""The fast solver: heuristics on an incrementally re-simulated timeline, for problems too big for the exact one.

All stages edit a `Timeline`, which keeps the bytes alive at every step equal to `plan_memory`'s under every
edit (tested), so every move sees the true peak:

- greedy repair: while the peak is over the budget, apply the change at the peak step that frees the most of
  what is still needed there per added second (screened for every candidate at once, the best few checked
  exactly); then clean up: revert the costliest decisions the budget no longer needs;
- Lagrangian prices: a price per step on bytes over the budget, raised by subgradient steps; under given
  prices each candidate picks its cheapest decision on its own, and each such plan is repaired and cleaned
  up into a candidate answer (prices see which steps stay tight, which the peak-step greedy cannot);
- local search on the best plan: drop a decision and repair without it, or make a change, then clean up;
  keep what is faster.

Deterministic: work is bounded by counts, never by the clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from dpcs_compiler.cost.memory_model import DECISIONS, MemoryProblem, floor_bytes
from dpcs_compiler.solve.solution import FREE_SECONDS as _FREE
from dpcs_compiler.solve.solution import Solution, measured_solution, solved_solution
from dpcs_compiler.solve.timeline import OFFLOAD_, RECOMPUTE_, SAVE_, Timeline

_EXACT_RANKED = 4  # greedy: how many of the screen's best changes are ranked again on exact effects
_PRICE_ROUNDS = 60  # subgradient steps on the step prices
_PRICE_PLANS = 60  # at most this many of their plans are repaired into candidate answers
_PRICE_PATIENCE = 5  # rounds without a better bound before the step size halves
# Work allowances, in moves evaluated (`Timeline.work`; a few tens of microseconds each): prices stop handing
# out plans past the first, local search stops past the second. The solver-gap problems of 30-60 candidates
# finish within them (at most 5,415 moves in all); big ones are cut short. The local search's moves from 6,000
# to 10,000 bought 0.05% of the added seconds on average (1.1% at most) on the 1,500-2,500-step problems, for
# 30% of their solve time (Xeon, 2 cores): 2,500 steps x 400 candidates solve in about 0.5-0.7 s.
_PRICE_WORK = 5_000
_SEARCH_WORK = 6_000
_PEAK_PROBES = 16  # bisection steps towards the lowest peak, when the budget cannot be met
# ... until the lowest peak reached is within 1/_PEAK_PRECISION of a target that failed. At 1/1,000 (it was
# 1/10,000) the lowest peaks of 33 synthetic problems (30-400 candidates, `benchmarks/solver_gap.py`'s) were
# the same to the byte, in 9% less time (up to 25% on the 2,500-step ones).
_PEAK_PRECISION = 1_000


def repair(tl: Timeline, target: int, frozen: frozenset[int] = frozenset(), shrink: bool = True) -> bool:
    """Lower the peak to `target` greedily; False if stuck above it (the peak is then the lowest either phase
    reached).

    At the peak step, apply the change that frees the most of what is still needed there per added second,
    never lifting another step to the peak (so the peak, or its count of steps, falls every move). Once no
    such change is left, take changes that shrink the total excess over the target instead (which may lift
    other steps; that total falls every move)."""
    while True:
        t = int(np.argmax(tl.during))
        peak = int(tl.during[t])
        if peak <= target:
            return True
        if not _lower_peak_step(tl, t, peak, target, frozen):
            break
    if not shrink:
        return False
    lowest = tl.snapshot()
    while True:
        t = int(np.argmax(tl.during))
        if tl.during[t] <= target:
            return True
        if not _shrink_excess(tl, t, target, frozen):
            break
    if tl.peak() > int(lowest[3].max()):
        tl.restore(lowest)  # stuck either way: keep the lower peak
    return False


def _lower_peak_step(tl: Timeline, t: int, peak: int, target: int, frozen: frozenset[int]) -> bool:
    """Apply the best change (see `repair`) at peak step t; False if there is none."""
    freed = tl.freed_at(t)
    added = tl.a_cost - tl.a_cost[np.arange(tl.n), tl.a_decision][:, None]
    ok = (freed > 0) & np.isfinite(added)
    if frozen:
        ok[list(frozen)] = False
    cand_i, cand_k = np.nonzero(ok)
    f = freed[cand_i, cand_k]
    a = added[cand_i, cand_k]
    score = np.where(a <= _FREE, np.inf, np.minimum(f, peak - target) / np.maximum(a, _FREE))
    best = None
    for rank, o in enumerate(np.lexsort((cand_k, cand_i, -f, -score)).tolist()):
        if rank >= _EXACT_RANKED and best is not None:
            break
        move = tl.change(int(cand_i[o]), int(cand_k[o]))
        exact = -tl.at(move, t)
        if exact <= 0 or tl.raises_to(move) >= peak:
            continue
        key = (math.inf if a[o] <= _FREE else min(exact, peak - target) / a[o], exact, -move.i, -move.k)
        if best is None or key > best[0]:
            best = (key, move)
    if best is None:
        return False
    tl.apply(best[1])
    return True


def _shrink_excess(tl: Timeline, t: int, target: int, frozen: frozenset[int]) -> bool:
    """Apply the change lowering step t that most lowers the total excess over `target` per added second;
    False if none lowers it."""
    best = None
    # Those that may lower t: by the screen, or through recomputed inputs (the screen follows one level).
    chained = np.zeros(tl.n, dtype=bool)
    if len(tl.edge_input):
        chained[tl.edge_consumer[tl.a_decision[tl.edge_input] == RECOMPUTE_]] = True
    for i in np.flatnonzero((tl.freed_at(t) > 0).any(axis=1) | chained).tolist():
        if i in frozen:
            continue
        now = tl.decision[i]
        for k in range(3):
            if k == now or tl.cost[i][k] == math.inf:
                continue
            move = tl.change(i, k)
            if tl.at(move, t) >= 0:
                continue
            lo, local = tl.effect(move)
            old = tl.during[lo : lo + len(local)]
            gain = int(np.maximum(old - target, 0).sum() - np.maximum(old + local - target, 0).sum())
            if gain <= 0:
                continue
            added = tl.cost[i][k] - tl.cost[i][now]
            score = math.inf if added <= _FREE else gain / added
            if best is None or score > best[0]:
                best = (score, move)
    if best is None:
        return False
    tl.apply(best[1])
    return True


def clean_up(
    tl: Timeline,
    target: int,
    frozen: frozenset[int] = frozenset(),
    among: np.ndarray | None = None,
    per_byte: bool = False,
) -> None:
    """Revert decisions, costliest first (per byte, with `per_byte`), to cheaper ones while the peak stays
    within `target` (only those of the candidates in `among`, when given).

    Back to SAVE fills the candidate's gap, and nothing it lets go of lies inside that gap: so the gap's
    highest step plus its bytes over `target` rules the revert out, and is screened for all at once."""
    lo, hi = _gaps(tl)
    fits_saved = _range_max(tl.during, lo, hi) + tl.a_nbytes <= target
    chosen = (tl.a_decision != SAVE_) if among is None else (tl.a_decision != SAVE_) & among
    now_cost = tl.a_cost[np.arange(tl.n), tl.a_decision]
    # Worth a look: SAVE may fit, or a cheaper decision other than SAVE exists.
    other = np.where(tl.a_decision == RECOMPUTE_, tl.a_cost[:, OFFLOAD_], tl.a_cost[:, RECOMPUTE_]) < now_cost
    look = np.flatnonzero(chosen & (fits_saved | other))
    weight = now_cost / tl.a_nbytes if per_byte else now_cost
    for i in sorted(look.tolist(), key=lambda i: -weight[i]):
        now = tl.decision[i]
        if now == SAVE_ or i in frozen:
            continue
        for k in tl.by_cost[i]:
            if tl.cost[i][k] >= tl.cost[i][now]:
                break
            if k == SAVE_:
                a, b = int(lo[i]), int(hi[i])
                if b > a and int(tl.during[a:b].max()) + tl.nbytes[i] > target:
                    continue
                if not any(tl.decision[j] == RECOMPUTE_ for j in tl.inputs[i]):
                    tl.set(i, k)  # nothing but the gap changes upwards: it fits
                    break
            move = tl.change(i, k)
            if tl.raises_to(move) <= target:
                tl.apply(move)
                break


def _gaps(tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) per candidate: the steps where its decision keeps it out of memory (empty for SAVE)."""
    decision = tl.a_decision
    lo = np.where(decision == RECOMPUTE_, tl.a_forward_end + 1, np.where(decision == OFFLOAD_, tl.a_free + 1, 0))
    hi = np.where(decision == RECOMPUTE_, tl.a_made, np.where(decision == OFFLOAD_, tl.a_reload, 0))
    return lo, np.maximum(hi, lo)


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo:hi]) for each pair (min int64 where empty), by a sparse table."""
    table = [values]
    while 2 ** len(table) <= len(values):
        prev, width = table[-1], 2 ** (len(table) - 1)
        table.append(np.maximum(prev[:-width], prev[width:]))
    length = hi - lo
    empty = length <= 0
    level = np.where(empty, 0, np.floor(np.log2(np.maximum(length, 1)))).astype(np.int64)
    out = np.full(len(lo), np.iinfo(np.int64).min, dtype=np.int64)
    for k in np.unique(level[~empty]).tolist():
        rows = np.flatnonzero(~empty & (level == k))
        out[rows] = np.maximum(table[k][lo[rows]], table[k][hi[rows] - 2**k])
    return out


def _gap_touches(tl: Timeline, steps: np.ndarray) -> np.ndarray:
    """bool [n]: candidates whose gap holds one of `steps` (bool per step)."""
    count = np.concatenate(([0], np.cumsum(steps)))
    lo, hi = _gaps(tl)
    return (tl.a_decision != SAVE_) & (count[hi] > count[lo])


def _price_search(tl: Timeline, target: int, consider: Callable[[list[int]], tuple[int, float]], upper: float) -> None:
    """Candidate plans from Lagrangian prices on the steps, each handed to `consider` (which repairs it and
    returns its (peak, seconds)). Under prices λ (seconds per byte at a step) each candidate takes the
    decision minimising its seconds plus the priced bytes it keeps alive (remade at its own first backward
    use); λ follows subgradient steps on the bytes over `target` (Polyak steps towards `upper`, the best
    fitting plan's seconds)."""
    n, steps = tl.n, len(tl.base)
    # Each decision's stretches, padded to three: start, end, bytes [n, 3 decisions, 3 stretches].
    start = np.zeros((n, 3, 3), dtype=np.int64)
    end = np.zeros((n, 3, 3), dtype=np.int64)
    size = np.zeros((n, 3, 3))
    for i in range(n):
        for k in range(3):
            if tl.cost[i][k] < math.inf:
                stretches = tl.intervals(i, k, tl.first_backward[i])
                if k == RECOMPUTE_:
                    step = tl.first_backward[i]
                    stretches.append((step, step, tl._extra(step, tl.transient[i])))
                for j, (a, b, v) in enumerate(stretches):
                    start[i, k, j], end[i, k, j], size[i, k, j] = a, b + 1, v
    room = (target - tl.base).astype(np.float64)
    price = np.zeros(steps)
    theta, best_bound, stale, tried = 2.0, -math.inf, 0, 0
    seen: set[tuple[int, ...]] = set()
    for _ in range(_PRICE_ROUNDS):
        cumulative = np.concatenate(([0.0], np.cumsum(price)))
        value = tl.a_cost + (size * (cumulative[end] - cumulative[start])).sum(axis=2)
        choice = np.argmin(value, axis=1)
        bound = float(value[np.arange(n), choice].sum() - price @ room)
        if bound > best_bound * (1 + 1e-9):
            best_bound, stale = bound, 0
        else:
            stale += 1
            if stale >= _PRICE_PATIENCE:
                theta, stale = theta / 2, 0
        decision = choice.tolist()
        tl.reset(decision)
        over = (tl.during - target).astype(np.float64)
        key = tuple(decision)
        if key not in seen and tried < _PRICE_PLANS and tl.work < _PRICE_WORK:
            seen.add(key)
            tried += 1
            peak, seconds = consider(decision)
            if peak <= target:
                upper = min(upper, seconds)
        over[(price <= 0) & (over < 0)] = 0.0
        norm = float(over @ over)
        if norm == 0.0:
            break
        gap = (upper if math.isfinite(upper) else 2 * abs(bound) + 1e-6) - bound
        price = np.maximum(0.0, price + theta * max(gap, 1e-12) / norm * over)


def improve(tl: Timeline, target: int) -> None:
    """Local search until no move helps (or the work allowance is spent). Drop: revert a decision, costliest
    first, and repair the plan without it. Add: make a change. Each followed by a clean-up (both orders);
    kept when faster."""
    while tl.work < _SEARCH_WORK:
        gained = False
        tries = [
            (i, k)
            for i in sorted(range(tl.n), key=lambda i: -tl.cost[i][tl.decision[i]])
            for k in range(3)
            if tl.decision[i] != SAVE_ and tl.cost[i][k] < tl.cost[i][tl.decision[i]]
        ]
        tries += [
            (i, k)
            for i in range(tl.n)
            for k in (RECOMPUTE_, OFFLOAD_)
            if k != tl.decision[i] and tl.cost[i][k] < math.inf
        ]
        for i, k in tries:
            if tl.work >= _SEARCH_WORK:
                return
            if k == tl.decision[i]:
                continue
            before = tl.snapshot()
            tl.set(i, k)
            frozen = frozenset((i,))
            if repair(tl, target, frozen):
                # The plan was clean before: only where memory fell can a decision now be reverted.
                among = _gap_touches(tl, tl.during < before[3])
                repaired = tl.snapshot()
                better = False
                for per_byte in (False, True):
                    if per_byte:
                        tl.restore(repaired)
                    clean_up(tl, target, frozen, among=among, per_byte=per_byte)
                    better = tl.seconds < before[2] * (1 - 1e-12) - _FREE
                    if better:
                        break
                if better:
                    gained = True
                    continue
            tl.restore(before)
        if not gained:
            return


def _lowest_peak(tl: Timeline, plan: list[int], floor: int) -> list[int]:
    """Push the peak of `plan` down by bisection on a target between `floor` (no plan goes below it) and its
    peak: repair towards each target from the lowest plan so far."""
    tl.reset(plan)
    low, high = floor, tl.peak()
    for _ in range(_PEAK_PROBES):
        if high - low <= max(1, high // _PEAK_PRECISION):
            break
        target = (low + high) // 2
        tl.reset(plan)
        if not repair(tl, target):
            low = target
        if tl.peak() < high:
            plan, high = list(tl.decision), tl.peak()
    return plan


def _better(a: tuple[int, float], b: tuple[int, float], budget: int) -> bool:
    """Whether a plan with (peak, seconds) `a` beats `b`: fitting first, then faster; else the lower peak."""
    a_fits, b_fits = a[0] <= budget, b[0] <= budget
    if a_fits != b_fits:
        return a_fits
    return a[1] < b[1] if a_fits else a < b


def solve_fast(problem: MemoryProblem, budget_bytes: int, *, lowest_when_over: bool = True,
               local_search: bool = True) -> Solution:
    """A fast plan whose peak fits `budget_bytes`, or, if the heuristics cannot fit it, the lowest peak they
    reach (feasible=False). `lowest_when_over=False`: a caller that only asks whether the budget can be met
    (the step planner's level search) gets the best plan found when it cannot, without the search for the
    lowest peak (the costly part of an infeasible solve). `local_search=False`: the plan of the greedy repair
    and the prices, without the local search that makes it faster (it never changes whether it fits)."""
    started = time.perf_counter()
    given = int(budget_bytes)
    tl = Timeline(problem)
    if not tl.n or tl.peak() <= given:  # all-SAVE fits, or nothing to decide
        return measured_solution(problem, tl.decisions(), given, "fast", time.perf_counter() - started)
    floor = int(tl.base.max())  # no plan goes below the base bytes
    # Every budget below the bound no plan goes under (`floor_bytes`) is searched as 0: its answer, the lowest
    # plan, is the same for all of them (what `memory_budget=1` reports as the smallest reachable peak), and
    # every budget at or above that plan's peak is met (`_lowest_of_all`). Searched at its own value, such a
    # budget cost a search for it that cannot succeed and then the search at 0 (2.4 s of a 2,500-step
    # problem's 2.4 s, `benchmarks/solver_gap.py`).
    bound = int(floor_bytes(problem).max())
    budget = given if given >= bound else 0
    out_of_memory = [
        RECOMPUTE_ if tl.cost[i][RECOMPUTE_] < math.inf else OFFLOAD_ if tl.cost[i][OFFLOAD_] < math.inf else SAVE_
        for i in range(tl.n)
    ]
    if not lowest_when_over and bound > given:
        # No plan fits (a step's floor is over): what the caller asked is answered; the plan given is the
        # one with everything out of memory that can be.
        tl.reset(out_of_memory)
        return solved_solution(problem, tl.decisions(), given, "fast", time.perf_counter() - started)
    best: list = []  # [(peak, seconds), decisions]

    def consider(start: list[int]) -> tuple[int, float]:
        """Repair `start`, clean it up both ways, keep the better as `best` if it is; its (peak, seconds)."""
        tl.reset(start)
        target = budget if repair(tl, budget) else tl.peak()
        repaired = tl.snapshot()
        results = []
        for per_byte in (False, True):
            tl.restore(repaired)
            clean_up(tl, target, per_byte=per_byte)
            results.append(((tl.peak(), tl.seconds), list(tl.decision)))
        score, plan = min(results, key=lambda r: (r[0][0] > max(budget, target), r[0][1]))
        if not best or _better(score, best[0], budget):
            best[:] = [score, plan]
        return score

    consider([SAVE_] * tl.n)
    # Everything out of memory that can be (recomputed, else offloaded), then the clean-up keeps what pays.
    consider(out_of_memory)
    _price_search(tl, budget, consider, best[0][1] if best[0][0] <= budget else math.inf)
    if best[0][0] > budget and not lowest_when_over:
        tl.reset(best[1])
        return solved_solution(problem, tl.decisions(), budget, "fast", time.perf_counter() - started)
    if best[0][0] > budget:
        # Nothing fitted: push for the lowest peak, whatever the budget (it may turn out to fit after all).
        lowest = None
        for start, shrink in ((best[1], False), (best[1], True), ([SAVE_] * tl.n, True), (out_of_memory, True)):
            tl.reset(start)
            if shrink:
                repair(tl, 0)  # stuck, it ends by shrinking all bytes over time: a low start
            plan = _lowest_peak(tl, list(tl.decision), floor)
            tl.reset(plan)
            if lowest is None or tl.peak() < lowest[0]:
                lowest = (tl.peak(), plan)
        if budget > 0 and lowest[0] > budget:
            lowest = _lowest_of_all(problem, tl, lowest, local_search)
        tl.reset(lowest[1])
        clean_up(tl, max(budget, tl.peak()))
    else:
        tl.reset(best[1])
    if local_search:
        improve(tl, max(budget, tl.peak()))
    return solved_solution(problem, tl.decisions(), given, "fast", time.perf_counter() - started)


def _lowest_of_all(problem: MemoryProblem, tl: Timeline, lowest: tuple[int, list[int]], local_search: bool
                   ) -> tuple[int, list[int]]:
    """The lower of `lowest`, found from a budget nothing met, and the lowest plan as a budget below every plan
    finds it. The heuristics' path depends on the budget, so from a budget just above the lowest peak reported
    they can end higher (2.4 MB over on a synthetic problem, `tests/solve/test_fast.py`): a budget at or above
    that peak must be met, as the error naming it promises."""
    decisions = solve_fast(problem, 0, local_search=local_search).decisions
    plan = [DECISIONS.index(d) for d in decisions]
    tl.reset(plan)
    return min(lowest, (tl.peak(), plan), key=lambda entry: entry[0])
