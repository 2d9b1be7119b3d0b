"""Searching for a step plan (`plan_step`): the contexts each graph of a step is compiled with, so that the step
fits one budget at the least added time, by the step model of `step_model.py` (its module docs say how: one
shared fraction of every graph's boundary range, on a grid refined by bisection; torch's own partitions
offered first where they fit; the smallest reachable peak searched when nothing fits).

Pure, as the model is: problems and plain numbers in, contexts and peaks out; the solver is passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from dpcs_compiler.cost.budget import RUNTIME_ALLOWANCE_BYTES
from dpcs_compiler.cost.memory_model import RECOMPUTE, MemoryProblem, plan_seconds
from dpcs_compiler.cost.step_model import (
    GraphLevels,
    GraphStep,
    LEVEL_GRID,
    OPTIMIZER,
    Solver,
    StepContext,
    StepPeak,
    StepShape,
    TorchLevels,
    boundary_level,
    contexts_for,
    kept_saved,
    lowest_boundary_decisions,
    step_peak,
)

# bisection steps on the target for the smallest step peak, when no plan fits, each trying the levels on LEVEL_GRID:
# a coarser grid missed the band of levels where the lowest plans lie (they hold more than least between phases)
TARGET_PROBES = 8
LEVEL_PROBES = 6  # then bisected between the highest feasible grid level and the next (1/512 of each range)
# Plans that stand are replaced, where the step frees what they count alive, by one that adds at least this share
# less time (each graph compiled again for it: not for a tie in the model's figures).
CHEAPER = 0.01
# A plan of one shared level whose step peaks more than this share below its target is refined graph by graph
# (`_LevelSearch.closer`), for at most CLOSER_GRAPHS graphs (those whose plans add the most time first).
CLOSER = 0.02
CLOSER_GRAPHS = 8


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The contexts each graph is compiled with, and what they give.

    feasible: every graph has a plan within its target in its context; level: the shared fraction of each
    graph's boundary range (None: the graphs' own plans already fit the step, no context needed); decisions
    and levels: each graph's plan in its context (as its compile will re-make it); peak: the step's peak (None,
    with no decisions or levels, for a level a graph fits no plan at: `_LevelSearch.attempt` stops there).
    """

    contexts: dict[str, StepContext | None]
    decisions: dict[str, tuple[str, ...]]
    levels: dict[str, GraphLevels]
    peak: StepPeak | None
    feasible: bool
    level: float | None
    solves: int
    alone: bool = False  # one call of one graph, nothing around it: the step is that graph's own plan
    # Torch's own partitions offered (`StepContext.torch_plan`): decisions and levels are those the offer was
    # made with (saving everything, or each graph's own partition: `_torch_offer`); each graph's compile decides.
    torch_plans: bool = False

    def holds_most(self, graphs: Mapping[str, GraphStep]) -> str:
        """The graph that holds the most for its backward while the others run."""
        return max(self.levels, key=lambda k: graphs[k].held(self.levels[k].boundary, self.levels[k].recomputed))


def frees_before_backward(shapes: Sequence[StepShape]) -> bool:
    """Whether a step frees some of a graph's own inputs or outputs before that graph's backward (measured)."""
    return any(freed > 0 for shape in shapes for freed in shape.call_backward_freed)


def plan_step(
    shapes: Sequence[StepShape],
    graphs: Mapping[str, GraphStep],
    current: Mapping[str, tuple[str, ...]],
    solver: Solver,
    settled: bool = True,
    find_lowest: bool = True,
    final: Solver | None = None,
    torch_limit: int | None = None,
) -> StepPlan:
    """Contexts under which every graph of the step has a plan and the step's peak fits, in every step shape
    seen (a data-dependent branch can make steps of different graphs).

    `current` holds each graph's plan as compiled. If those already fit the step (every call's own peak plus
    what the others hold stays within its target) and are `settled` (not first plans, made before the step's
    order was known), nothing changes (`level` None, `contexts` None each); a step of one call with nothing
    alive around it is that graph's own plan. Otherwise the highest shared
    level with a plan is searched (`_LevelSearch`); if no level has one, the result is infeasible, with the
    plans of the smallest step peak found (by bisection on the target).

    `final`: the solver each graph's compile will use, when the search used a cheaper one (`solve.fits`): the
    plan found is solved again with it in each graph's context, so its levels and peak are what compiles.

    `torch_limit` (None: not offered): no cost at no pressure. Where the plans that save everything, or else
    torch's own partitions (`GraphStep.torch_partition`), peak within `torch_limit` bytes (what torch's
    partition of one graph is held to; the runtime allowance of each other call of the step added,
    `cost.budget.torch_plan_limit`), each graph is given the contexts of those plans (what the others keep for
    their backward), marked `torch_plan`: its compile keeps torch's own partition where it fits there
    (`torch_plans`; the level search is not run; `_torch_offer`).
    """
    missing = {k for shape in shapes for k in shape.instances if k not in graphs}
    if missing or not shapes:
        raise ValueError(f"step graphs without a plan: {sorted(missing)}" if missing else "no step shape to plan")
    target = min(g.target for g in graphs.values())
    levels = {k: graphs[k].levels(current[k]) for k in graphs}
    peak = step_peak(shapes, graphs, levels)
    alone = all(len(s.instances) == 1 and s.outside_bytes == 0 and s.turn_bytes == 0 and not s.optimizer_bytes
                for s in shapes) and len(graphs) == 1
    if peak.bytes <= target and settled or alone:
        unchanged = StepPlan(dict.fromkeys(graphs), dict(current), levels, peak, peak.bytes <= target, None, 0, alone)
        if not frees_before_backward(shapes) and not any(g.observing for g in graphs.values()):
            return unchanged
        # The step frees some of a graph's own outputs (or inputs) before its backward (a model's logits, when
        # the loop keeps only the loss), which that graph's own plan counts alive through it: with them
        # counted freed a cheaper plan may fit, or one may fit where none did. Or a graph's plan kept saved what
        # would read its outputs, to see whether the step frees them: where it does not, reading them is free.
        return _cheaper_where_freed(unchanged, shapes, graphs, solver, final, target, torch_limit)
    found, search = _offer_or_search(shapes, graphs, solver, final, target, torch_limit)
    if found is not None:
        return found
    if peak.bytes <= target:
        # First plans (not settled) whose step fits where no level of the search does (HF GPT-2's two graphs at
        # 0.75x its unbudgeted peak, a graph break between: said infeasible after 17 s of bisection): they stand.
        return StepPlan(dict.fromkeys(graphs), dict(current), levels, peak, True, None, search.solves)
    if not find_lowest:  # only whether it fits (`find_lowest` False): the bisection below is the costly part
        return StepPlan(dict.fromkeys(graphs), dict(current), levels, peak, False, None, search.solves)
    # No plan fits: the smallest step peak reachable, by bisection on the target between the budget and the
    # step peak of plans that save everything (a bound that does not depend on the plans compiled first, so
    # the same step finds the same plan at every budget below it), so the error names it and
    # on_infeasible="best" compiles that plan.
    saved = {k: GraphLevels.of(g.problem, g.problem.all_saved()) for k, g in graphs.items()}
    lowest, found_at, lo, hi = None, 0, target, step_peak(shapes, graphs, saved).bytes
    for _ in range(TARGET_PROBES):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        plan = search.at(mid)
        if plan is None:
            lo = mid
        else:
            hi, lowest, found_at = plan.peak.bytes, plan, mid
    if lowest is None or lowest.peak.bytes >= peak.bytes:
        return StepPlan(dict.fromkeys(graphs), dict(current), levels, peak, False, None, search.solves)
    # Each graph is compiled for the target that plan was found at (its compile re-makes the same plan).
    contexts = {k: dataclasses.replace(c, target=found_at) for k, c in lowest.contexts.items()}
    lowest = _as_compiled(dataclasses.replace(lowest, contexts=contexts, solves=search.solves), shapes, graphs, final,
                          found_at)
    return dataclasses.replace(lowest, feasible=False)


def _offer_or_search(shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep], solver: Solver,
                     final: Solver | None, target: int, torch_limit: int | None) -> tuple[StepPlan | None, _LevelSearch | None]:
    """Torch's partitions where they fit within `torch_limit` (with no search: None), else the level search's
    plan at `target` as each graph's compile will re-make it (None: no level fits), and the search."""
    if torch_limit is not None:
        offered = _torch_offer(shapes, graphs, torch_limit)
        if offered is not None:
            return offered, None
    search = _LevelSearch(shapes, graphs, solver)
    found = search.at(target)
    if found is not None:
        found = search.closer(found, target)
        found = _as_compiled(dataclasses.replace(found, solves=search.solves), shapes, graphs, final, target)
    return found, search


def _cheaper_where_freed(unchanged: StepPlan, shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep],
                         solver: Solver, final: Solver | None, target: int, torch_limit: int | None) -> StepPlan:
    """`plan_step` where the graphs' own plans stand (`unchanged`: they fit, or one graph is the whole step) but
    the step frees some of a graph's own inputs or outputs before its backward, which its own plan counts
    alive. Torch's own partitions are kept where they were compiled, and offered where they now fit (within
    `torch_limit`); otherwise the level search's plan at `target` is taken if it fits and adds less time than
    the plans as compiled (or fits where they do not). Else `unchanged`."""
    if all(g.torch_kept for g in graphs.values()):
        return unchanged  # no cost at no pressure: nothing is cheaper than torch's own plan there
    found, search = _offer_or_search(shapes, graphs, solver, final, target, torch_limit)
    if search is None:
        return found  # torch's partitions fit

    def seconds(decisions: Mapping[str, tuple[str, ...]]) -> float:
        return sum(plan_seconds(graphs[k].problem, decisions[k]) for k in graphs)

    if found is not None and found.feasible and (
            not unchanged.feasible or seconds(found.decisions) < (1 - CHEAPER) * seconds(unchanged.decisions)):
        return found
    return dataclasses.replace(unchanged, solves=search.solves)


def _torch_offer(shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep], torch_limit: int) -> StepPlan | None:
    """Torch's own partitions offered (`plan_step`'s `torch_limit`), or None where they do not fit by the model:
    first as the plans saving everything, each keeping what any recomputation reads (no graph's partition keeps
    more; nothing to make), then, where those do not fit, as each graph's own partition
    (`GraphStep.torch_partition`: min-cut recomputes cheap values, which on HF GPT-2 held 34% less than saving
    everything), saving everything for a graph without one."""
    # Each graph's prediction counts its own runtime allowance and, inside the graphs and at the turn, that of
    # each other call of its step shape; a graph in several shapes is held with the fewest.
    others = {k: min(len(s.instances) - 1 for s in shapes if k in s.instances) for k in graphs}
    # Saving everything, and keeping every input or output a recomputation reads: no partition holds more
    # (torch's can recompute from such an input, which it then keeps alive, `GraphStep.held`).
    saved = {k: TorchLevels(g.problem.all_saved(), dataclasses.replace(
        GraphLevels.of(g.problem, g.problem.all_saved()),
        recomputed=frozenset(name for _, readers in g.freeable for name in readers))) for k, g in graphs.items()}

    def offer(chosen: Mapping[str, TorchLevels]) -> StepPlan | None:
        levels = {k: t.levels for k, t in chosen.items()}
        kept = _freeing_as_decided(shapes, graphs, {k: t.decisions for k, t in chosen.items()})
        peak = step_peak(kept, graphs, levels)
        counted = len(kept[peak.shape].instances) - 1 if peak.phase != OPTIMIZER else 0
        if peak.bytes > torch_limit + counted * RUNTIME_ALLOWANCE_BYTES:
            return None
        held = {k: graphs[k].held(levels[k].boundary, levels[k].recomputed) for k in graphs}
        contexts = {k: dataclasses.replace(c, torch_plan=True, other_calls=others[k])
                    for k, c in contexts_for(kept, graphs, held).items()}
        return StepPlan(dict(contexts), {k: t.decisions for k, t in chosen.items()}, levels, peak, True, 1.0, 0,
                        torch_plans=True)

    offered = offer(saved)
    if offered is not None:
        return offered
    own = {k: g.torch_partition() if g.torch_partition is not None else None for k, g in graphs.items()}
    return None if all(o is None for o in own.values()) else offer({k: own[k] or saved[k] for k in graphs})


def _freeing_as_decided(shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep],
                        decisions: Mapping[str, Sequence[str]]) -> list[StepShape]:
    """The shapes as a step of these plans runs: a call whose graph's plan recomputes a candidate its
    `call_keep_saved` names keeps alive what the step measured freed before its backward (its backward reads
    it), so nothing is freed there (`StepContext.for_decisions`). Measured with torch's partitions, the step
    shows that, and a step planned without it was planned again and its graph compiled again."""
    out = []
    for shape in shapes:
        if not shape.call_keep_saved:
            out.append(shape)
            continue
        freed, keep = list(shape.call_backward_freed or (0,) * len(shape.instances)), list(shape.call_keep_saved)
        for i, key in enumerate(shape.instances):
            if keep[i] and any(d == RECOMPUTE and c.name in keep[i]
                               for c, d in zip(graphs[key].problem.candidates, decisions[key])):
                freed[i], keep[i] = 0, frozenset()
        out.append(dataclasses.replace(shape, call_backward_freed=tuple(freed), call_keep_saved=tuple(keep)))
    return out


def _as_compiled(plan: StepPlan, shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep],
                 final: Solver | None, target: int) -> StepPlan:
    """`plan` with each graph's decisions solved again by `final` in its context (as its compile will)."""
    if final is None:
        return plan
    decisions, feasible = {}, True
    for k, g in graphs.items():
        decisions[k], ok = g.solve(plan.contexts[k], target, final)
        feasible = feasible and ok
    levels = {k: graphs[k].levels(decisions[k]) for k in graphs}
    peak = step_peak(shapes, graphs, levels)
    return dataclasses.replace(plan, decisions=decisions, levels=levels, peak=peak,
                               feasible=feasible and peak.bytes <= target)


class _LevelSearch:
    """Plans of the step at one shared level of every graph's boundary range (module docs), per target."""

    def __init__(self, shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep], solver: Solver) -> None:
        self.shapes, self.graphs, self.solver = shapes, graphs, solver
        # The lowest each can hold, with what it must keep saved for what the step frees (`keep_saved`).
        keep: dict[str, set[str]] = {}
        for shape in shapes:
            for key, names in zip(shape.instances, shape.call_keep_saved):
                keep.setdefault(key, set()).update(names)
        kept = {k: kept_saved(g.problem, keep.get(k, ())) for k, g in graphs.items()}
        self.low = {k: boundary_level(p, lowest_boundary_decisions(p)) for k, p in kept.items()}
        self.high = {k: boundary_level(g.problem, g.problem.all_saved()) for k, g in graphs.items()}
        self.solves = 0
        self.memo: dict[tuple, tuple[tuple[str, ...], bool]] = {}  # graphs repeated in a step: equal problems

    def solved(self, g: GraphStep, context: StepContext, target: int) -> tuple[tuple[str, ...], bool]:
        key = (_problem_key(g.problem), g.known_excess, context, target)
        if key not in self.memo:
            self.memo[key] = g.solve(context, target, self.solver)
            self.solves += 1
        return self.memo[key]

    def attempt(self, level: float, target: int) -> StepPlan:
        """The plans of every graph at the shared `level` of its boundary range."""
        caps = {k: int(self.low[k] + level * (self.high[k] - self.low[k])) for k in self.graphs}
        return self.at_caps(caps, target, level)

    def at_caps(self, caps: Mapping[str, int], target: int, level: float | None) -> StepPlan:
        """The plans of every graph with what it holds between its phases capped at `caps` (bytes)."""
        graphs = self.graphs
        contexts = contexts_for(self.shapes, graphs, {k: graphs[k].held(caps[k]) for k in graphs}, caps)
        decisions, feasible = {}, True
        for k, g in graphs.items():
            decisions[k], ok = self.solved(g, contexts[k], target)
            if not ok:  # a graph that fits no plan at this level: the level is out, the others need no solve
                return StepPlan(dict(contexts), {}, {}, None, False, level, self.solves)
        lv = {k: graphs[k].levels(decisions[k]) for k in graphs}
        peak = step_peak(self.shapes, graphs, lv)
        return StepPlan(dict(contexts), decisions, lv, peak, feasible and peak.bytes <= target, level, self.solves)

    def at(self, target: int, grid: int = LEVEL_GRID) -> StepPlan | None:
        """The plan of the highest feasible level within `target`, or None if no level fits. Holding least
        between phases does not give the lowest peaks (recomputing everything raises backward peaks): levels
        are tried on a grid first, then the highest feasible one is refined by bisection."""
        fits = [t for t in (self.attempt(i / grid, target) for i in range(grid + 1)) if t.feasible]
        if not fits:
            return None
        best = fits[-1]
        lo, hi = best.level, min(1.0, best.level + 1 / grid)
        for _ in range(LEVEL_PROBES if best.level < 1.0 else 0):
            mid = (lo + hi) / 2
            tried = self.attempt(mid, target)
            if tried.feasible:
                lo, best = mid, tried
            else:
                hi = mid
        return best

    def closer(self, plan: StepPlan, target: int) -> StepPlan:
        """`plan` (one shared level) with single graphs allowed to hold more where the step still fits and adds
        less time: one shared level leaves a step well under its target where the graphs' plans come in sizes
        (the graph-break net at 0.9x its peak: each of three graphs recomputed a 0.5 MiB value or a 2 MiB one,
        and the step measured 4.6% under its budget where keeping one graph's saved fit). Every graph's cap
        is set to what its plan holds (so each context counts what the others hold, not their caps); then, those
        whose plans add the most time first, one graph's cap is raised by what the step has to spare, while the
        step is more than CLOSER under its target."""
        def seconds(p: StepPlan) -> float:
            return sum(plan_seconds(self.graphs[k].problem, p.decisions[k]) for k in self.graphs)

        if plan.level is None or plan.peak is None or plan.peak.bytes >= (1 - CLOSER) * target:
            return plan
        added = {k: plan_seconds(g.problem, plan.decisions[k]) for k, g in self.graphs.items()}
        best, best_seconds = plan, sum(added.values())
        for key in sorted((k for k in self.graphs if added[k] > 0), key=lambda k: -added[k])[:CLOSER_GRAPHS]:
            spare = target - best.peak.bytes
            if spare <= (CLOSER * target) // 2:  # within half of CLOSER: nothing more worth a solve of every graph
                break
            caps = {k: lv.boundary for k, lv in best.levels.items()}
            caps[key] = min(self.high[key], caps[key] + spare)
            tried = self.at_caps(caps, target, plan.level)
            if tried.feasible and seconds(tried) < best_seconds:
                best, best_seconds = tried, seconds(tried)
        return dataclasses.replace(best, level=plan.level, solves=self.solves)


def _problem_key(problem: MemoryProblem) -> tuple:
    return (
        problem.base_bytes.tobytes(),
        problem.base_before_bytes.tobytes(),
        problem.step_seconds.tobytes(),
        problem.backward_start,
        problem.candidates,
    )
