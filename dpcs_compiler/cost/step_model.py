"""One budget for a whole training step: the graphs of a step share it, each planned against what the others
keep alive while it runs.

A step with graph breaks (or DDP's bucket pieces, or a block compiled once and called per layer) runs several
compiled graphs. Their forwards run in call order and their backwards in reverse, so while instance `i` runs,
every earlier instance sits between its forward and its backward, holding what it saved for its backward,
and every later instance whose backward already ran has left its parameter gradients behind. Per graph,
planning works on its own `MemoryProblem`; this module adds the others as a `StepContext`:

- `forward_bytes` / `backward_bytes`: bytes the other graphs (and the step outside graphs) hold during this
  graph's forward / backward, added to each of its steps;
- `backward_freed`: bytes of this graph's own inputs and outputs (its backward does not read them) that the
  step's code has freed when its backward starts (measured: a loss's logits passed between two graphs and
  dropped before the backward); its own problem counts them alive through its backward, so they come off
  each of its backward steps;
- `boundary_cap`: the most this graph may hold between its forward and its backward (its boundary level),
  held to by a zero-second step inserted there (`in_step`): what it holds there is what every later graph
  counts in its own context, so a cap chosen for the step keeps every context true.

`plan_step` (`step_search.py`) chooses the caps: each graph's boundary level lies between its lowest
(everything that can be recomputed or offloaded is) and its highest (everything saved); one fraction `level`
of that range for all graphs, the largest for which every graph has a plan within the budget, found on a grid
and refined by bisection (feasibility is not monotone near the lowest level: recomputing everything raises
backward peaks). The step's predicted peak is then one number, the largest over its graph instances of own peak plus context, with the
graph and node where it happens; the step's turn (eager code between its last forward and first backward) and
the optimizer step after it (what the step holds at its end plus the optimizer's temporaries) are phases too.

Everything here is pure: problems and plain numbers in, contexts and peaks out; the solver is passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence, Set

import numpy as np

from dpcs_compiler.cost.memory_model import OFFLOAD, RECOMPUTE, SAVE, MemoryProblem, plan_memory

LEVEL_GRID = 8  # the shared level is tried at 0, 1/8, ..., 1


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the rest of the step holds around one graph, in bytes (see the module docs)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    boundary_cap: int | None = None
    target: int | None = None  # the peak to plan for, when no step plan fits the budget: the lowest reached
    # Before the step's order is known, for a graph that ends at a graph break (more graphs follow while it
    # holds what it saved): hold as little as its plans within the target can (`least_held_cap`).
    hold_least: bool = False
    backward_freed: int = 0
    # Candidates (by name) its plans may not recompute: their recomputation would read an input or output the
    # step frees before this graph's backward (`backward_freed` counts it freed).
    keep_saved: tuple[str, ...] = ()
    # No pressure: the step fits, by the model, with every graph's plans saving everything or with each graph's
    # own partition (`plan_step`, `_torch_offer`): the graph keeps torch's own partition if it fits in this
    # context (`stages/memory_plan.py`, `_torch_solution`); else dpcs plans it.
    torch_plan: bool = False
    # With `torch_plan`: the step's other graph calls around this one, each counted in the context with its
    # runtime allowance, which torch's partition, measured with them, is not held to (`torch_plan_limit`).
    other_calls: int = 0
    # A graph compiled in the middle of the step's first run (after others of it: its inputs can be their
    # outputs): where a plan fits so, it keeps saved what would read an input or output the step may free
    # before its backward (`StepSharing.freeable`), so the step recorder sees whether the step frees it (a plan
    # that recomputes from it holds it alive: the recorder sees it held, and the step plans count it alive).
    # The step planner then plans either way knowingly. (Not for the step's first graph, whose inputs are the
    # loop's: on a 24-layer GPT-2 its 48 such readers doubled its first solve, 0.7 s.)
    first_step: bool = False
    # Plans of this graph whose compiled graphs were read and held more than the plan model counts (Inductor's
    # fused kernels), by `decisions_code`, with those bytes per phase: a plan the solver finds that one of these
    # puts over its target is solved again with them counted (`solve_knowing`), as its compile would plan again
    # once it read them (`pipeline._count_replan`), not compiled to be refused. (The graph-break net at 0.7x its
    # peak: the step gave its middle graph a plan whose backward Inductor scheduled 1.5 MiB over the model; its
    # compile planned again, counting those 1.5 MiB for every plan, and the step measured 11% under its budget.)
    known_excess: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.keep_saved, (str, bytes)) or not all(isinstance(n, str) for n in self.keep_saved):
            raise ValueError(f"StepContext.keep_saved={self.keep_saved!r} is not valid; valid choices: candidate "
                             "names, as a sequence of str")
        object.__setattr__(self, "keep_saved", tuple(self.keep_saved))
        object.__setattr__(self, "known_excess", _known_excess(self.known_excess))
        for name in ("forward_bytes", "backward_bytes", "backward_freed", "other_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StepContext.{name}={value!r} is not valid; valid choices: bytes as an int >= 0")
        for name in ("hold_least", "torch_plan", "first_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StepContext.{name}={getattr(self, name)!r} is not valid; valid choices: True, False")
        for name in ("boundary_cap", "target"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"StepContext.{name}={value!r} is not valid; valid choices: None or bytes as an int >= 0")

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def for_decisions(self, problem: MemoryProblem, decisions: Sequence[str]) -> StepContext:
        """This context for a plan made without it (torch's own): one that recomputes a candidate of
        `keep_saved` keeps what the step frees alive, so nothing freed is counted."""
        keep = frozenset(self.keep_saved)
        if keep and any(d == RECOMPUTE and c.name in keep for c, d in zip(problem.candidates, decisions)):
            return dataclasses.replace(self, backward_freed=0, keep_saved=())
        return self

    @classmethod
    def parse(cls, value: object) -> StepContext | None:
        if value is None or isinstance(value, StepContext):
            return value
        if isinstance(value, Mapping) and set(value) <= {f.name for f in dataclasses.fields(cls)}:
            return cls(**value)
        raise ValueError(
            f"dpcs option 'step_context'={value!r} is not valid; valid choices: None, or a dict with keys "
            "'forward_bytes', 'backward_bytes', 'boundary_cap', 'target', 'hold_least', 'backward_freed', "
            "'keep_saved', 'torch_plan', 'other_calls', 'first_step', 'known_excess' (set by dpcs's step planner)"
        )


def _known_excess(value: object) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """`StepContext.known_excess` as tuples (its JSON form has lists), checked."""
    try:
        known = tuple((code, tuple((phase, nbytes) for phase, nbytes in excess)) for code, excess in value)
    except (TypeError, ValueError):
        known = None
    if known is None or not all(
            isinstance(code, str) and set(code) <= set(DECISION_CODES.values())
            and all(phase in EXCESS_PHASES and isinstance(n, int) and not isinstance(n, bool) for phase, n in excess)
            for code, excess in known):
        raise ValueError(f"StepContext.known_excess={value!r} is not valid; valid choices: pairs of a decisions code "
                         f"(one of {sorted(DECISION_CODES.values())} per candidate) and ((phase, bytes), ...) with "
                         f"phases of {EXCESS_PHASES}")
    return known


# `decisions_code`: one letter per candidate's decision.
DECISION_CODES = {SAVE: "s", RECOMPUTE: "r", OFFLOAD: "o"}
EXCESS_PHASES = ("forward", "backward", "boundary")  # as the compile reads it (`MemoryProblem.with_excess`)


def decisions_code(decisions: Sequence[str]) -> str:
    """A plan's decisions as a short string, one letter per candidate (`DECISION_CODES`)."""
    return "".join(DECISION_CODES[d] for d in decisions)


def merged_excess(planned: Mapping[str, int], *read: Mapping[str, int]) -> dict[str, int]:
    """`planned` (bytes per phase counted beyond the model) with what compiled graphs were `read` holding counted
    too: per phase the most of them, a phase not counted yet standing at 0 (as a re-plan counts them: never less
    than read before, `pipeline._count_replan`)."""
    out = dict(planned)
    for excess in read:
        for phase, nbytes in excess.items():
            out[phase] = max(out.get(phase, 0), nbytes)
    return out


# `solve_knowing`: between the excess a plan was made with and that excess with a known plan's counted too, the
# points tried for the plan closest to its target (`KNOWN_GRID` parts of the known plan's excess).
KNOWN_GRID = 8


def solve_knowing(
    known: Mapping[str, Mapping[str, int]],
    planned: Mapping[str, int],
    solve: Callable[[Mapping[str, int]], tuple[Sequence[str], bool]],
    over: Callable[[Sequence[str], Mapping[str, int]], bool],
) -> tuple[Mapping[str, int], bool]:
    """Plan as a compile does when some plans were compiled and read before: `solve(excess)` plans with `excess`
    (bytes per phase beyond the model) counted and gives (decisions, feasible); where its plan is one of `known`
    (by `decisions_code`: what its compiled graphs held beyond the model) and `over(decisions, that excess)`,
    it is planned again counting more, at most that excess too (`merged_excess`), as its compile would after
    reading it. How much more: the least of `KNOWN_GRID` steps up to that known excess (bisected) whose plan is
    not known over. Counting all of it for every plan left HF DeBERTa-v2 4.3% under its budget: one plan's
    compiled backward held 64 KiB beyond the model, others about a quarter of that, and a plan that another
    budget's compile measured 2.1% under this budget was never planned. A plan found so is compiled and read
    like any other: one over its target is planned again knowing it (`GraphJob.hold_to_budget`). Returns the
    excess the last plan was made with and whether that plan stands (False: known over, with every known excess
    counted). `solve`'s last call is the plan."""
    planned = dict(planned)

    def known_over(decisions: Sequence[str], feasible: bool) -> Mapping[str, int] | None:
        held = known.get(decisions_code(decisions))
        return held if feasible and held is not None and over(decisions, held) else None

    rounds = 0
    while True:
        held = known_over(*solve(planned))
        if held is None:
            return planned, True
        more = merged_excess(planned, held)
        if more == planned or rounds > len(known):  # each round counts more of a known excess: then none is new
            return planned, False
        rounds += 1

        def parts(k: int, base: Mapping[str, int] = planned, of: Mapping[str, int] = held) -> dict[str, int]:
            return merged_excess(base, {phase: nbytes * k // KNOWN_GRID for phase, nbytes in of.items()})

        low, high = 0, KNOWN_GRID  # at `low` parts the plan is known over; at `high` it may not be
        while high - low > 1:
            mid = (low + high) // 2
            trial = parts(mid)
            if trial == planned or known_over(*solve(trial)) is not None:
                low = mid
            else:
                high = mid
        planned = parts(high)


def in_step(problem: MemoryProblem, context: StepContext | None, target: int) -> MemoryProblem:
    """`problem` inside its step: the context's bytes added to each forward / backward step (less, in the
    backward, `backward_freed`), and, with a
    boundary cap, a zero-second step between forward and backward whose bytes are the graph's boundary level
    plus `target - cap` (so a plan within `target` holds at most the cap there). The boundary step is the last
    forward step; backward steps move one on."""
    if context is None:
        return problem
    start = problem.backward_start
    forward, backward = context.forward_bytes, context.backward_bytes - context.backward_freed
    extra = np.where(np.arange(problem.steps) < start, forward, backward).astype(np.int64)
    base, before, seconds = problem.base_bytes + extra, problem.base_before_bytes + extra, problem.step_seconds
    candidates = problem.candidates
    if context.keep_saved:
        candidates = kept_saved(problem, context.keep_saved).candidates
    if context.boundary_cap is not None:
        level = boundary_base(problem) + max(0, target - context.boundary_cap)
        base = np.insert(base, start, level)
        before = np.insert(before, start, level)
        seconds = np.insert(seconds, start, 0.0)
        candidates = tuple(
            dataclasses.replace(c, first_backward_use=c.first_backward_use + 1, last_use=c.last_use + 1) for c in candidates
        )
        start += 1
    return MemoryProblem(
        base_bytes=base, base_before_bytes=before, step_seconds=seconds, backward_start=start, candidates=candidates
    )


def kept_saved(problem: MemoryProblem, names: Iterable[str]) -> MemoryProblem:
    """`problem` with the candidates named in `names` not recomputed (`StepContext.keep_saved`)."""
    keep = frozenset(names)
    if not keep:
        return problem
    return dataclasses.replace(problem, candidates=tuple(
        dataclasses.replace(c, can_recompute=False) if c.name in keep else c for c in problem.candidates))


def boundary_base(problem: MemoryProblem) -> int:
    """Bytes the graph holds between its forward and backward, its candidates left out."""
    start = problem.backward_start
    if start >= problem.steps:
        return int(problem.base_bytes[-1]) if problem.steps else 0
    return int(problem.base_before_bytes[start])


def boundary_level(problem: MemoryProblem, decisions: Sequence[str]) -> int:
    """What the graph holds between its forward and its backward under `decisions`: the boundary base and
    the candidates alive there (saved ones; offloaded ones whose copy has not finished)."""
    start = problem.backward_start
    level = boundary_base(problem)
    for i, (c, d) in enumerate(zip(problem.candidates, decisions)):
        if d == SAVE or (d == OFFLOAD and problem.offload_free_step(i) >= start):
            level += c.nbytes
    return level


def lowest_boundary_decisions(problem: MemoryProblem) -> tuple[str, ...]:
    """Each candidate recomputed where it can be, else offloaded where it can be, else saved: the plan that
    holds least between forward and backward."""
    return tuple(RECOMPUTE if c.can_recompute else OFFLOAD if c.can_offload else SAVE for c in problem.candidates)


def least_held_cap(problem: MemoryProblem, context: StepContext, target: int, solver: Solver) -> int | None:
    """The lowest cap on what `problem` holds between its forward and backward under which it has a plan within
    `target` in `context`, tried at LEVEL_GRID + 1 levels of its range, lowest first (holding least is not
    always feasible: recomputing everything raises backward peaks); None if no level has a plan."""
    kept = kept_saved(problem, context.keep_saved)
    low = boundary_level(kept, lowest_boundary_decisions(kept))
    high = boundary_level(problem, problem.all_saved())
    for i in range(LEVEL_GRID + 1):
        cap = int(low + i / LEVEL_GRID * (high - low))
        if solver(in_step(problem, dataclasses.replace(context, boundary_cap=cap, hold_least=False), target), target)[1]:
            return cap
    return None


@dataclasses.dataclass(frozen=True)
class GraphLevels:
    """One graph's plan as the step sees it: own peaks per phase (with their steps), the boundary level."""

    forward_peak: int
    forward_peak_step: int
    backward_peak: int
    backward_peak_step: int
    boundary: int
    recomputed: frozenset[str] = frozenset()  # the candidates the plan recomputes, by name (`GraphStep.held`)

    @classmethod
    def of(cls, problem: MemoryProblem, decisions: Sequence[str]) -> GraphLevels:
        during = plan_memory(problem, decisions).bytes_during
        start = problem.backward_start
        fwd, bwd = during[:start], during[start:]
        f = int(np.argmax(fwd)) if len(fwd) else -1
        b = int(np.argmax(bwd)) + start if len(bwd) else -1
        return cls(
            forward_peak=int(fwd[f]) if len(fwd) else 0,
            forward_peak_step=f,
            backward_peak=int(during[b]) if len(bwd) else 0,
            backward_peak_step=b,
            boundary=boundary_level(problem, decisions),
            recomputed=recomputed_names(problem, decisions),
        )


def recomputed_names(problem: MemoryProblem, decisions: Sequence[str]) -> frozenset[str]:
    """The names of the candidates `decisions` recompute."""
    return frozenset(c.name for c, d in zip(problem.candidates, decisions) if d == RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class TorchLevels:
    """Torch's own partition of one graph in the step planner's terms: one decision per candidate of the
    graph's problem (saved where torch saves it) and the levels its partitioned graphs reach."""

    decisions: tuple[str, ...]
    levels: GraphLevels

    @classmethod
    def of(cls, problem: MemoryProblem, decisions: Sequence[str], excess: Mapping[str, int]) -> TorchLevels:
        """The partition of `decisions` whose graphs hold `excess` (per phase) beyond the model of `problem`."""
        # Before Inductor compiles them, what they leave between the phases is not read: their backward's excess
        # stands for it (`MemoryProblem.with_schedule_excess`; on HF GPT-2 the partitioned forward's own level
        # there modelled a step 3% over what it measured, and the offer was refused).
        own = problem.with_schedule_excess(excess["forward"], excess["backward"])
        return cls(tuple(decisions), GraphLevels.of(own, decisions))


@dataclasses.dataclass(frozen=True)
class GraphStep:
    """One compiled graph of the step, as the step planner sees it.

    problem: its own memory problem (no context); target: the peak its plans are held to (the budget less
    the workspace allowance); parameter_bytes: its parameters (counted once for the whole step: the others'
    contexts count them); shared_bytes: what its boundary level holds that is not its own to keep (its
    parameters, its inputs the backward does not read, its outputs: the next graph counts them as inputs);
    gradient_bytes: the parameter gradients its backward leaves behind; gradient_steps: (the step of its
    problem that makes it, bytes) of each of them (empty: not known), for the split of a peak.
    """

    name: str
    problem: MemoryProblem
    target: int
    parameter_bytes: int
    shared_bytes: int
    gradient_bytes: int
    gradient_steps: tuple[tuple[int, int], ...] = ()
    # Torch's own partition of this graph (min-cut) as the step planner offers it (`plan_step`'s `torch_limit`):
    # its decisions and its levels (its partitioned graphs' own, what they hold beyond the model counted in);
    # made at the first call (a min-cut of the graph: only when the step's plans saving everything do not fit),
    # None there when it cannot be had. None: not known, plans saving everything stand for it.
    torch_partition: Callable[[], TorchLevels | None] | None = None
    # Its inputs and outputs its backward does not read (in `shared_bytes`) that a recomputation reads: (bytes,
    # the candidates whose recomputation reads it). A plan that recomputes one of those keeps it alive for its
    # backward (`held`): on the bench's graph-break net, a 2 MiB input of the middle graph, which its first
    # plans kept alive by recomputing `neg` from it, was counted as other calls' memory for every later plan.
    freeable: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # Its plan as compiled is torch's own partition (kept: it fit), not one dpcs solved.
    torch_kept: bool = False
    # Its plan, made alone (the step's first graph), keeps saved every candidate whose recomputation would read
    # one of its outputs that the step may free (`stages/memory_plan.py::_solve_in_step`), so the step recorder
    # sees whether the step frees it; a step that does not free it is planned again, a recomputation reading
    # it being free there (`plan_step`).
    observing: bool = False
    # `problem` is `unplanned` with `planned_excess` counted (what its compiled graphs held beyond the model;
    # None: nothing counted); `known_excess`: its other plans compiled and read before (`StepContext.known_excess`).
    unplanned: MemoryProblem | None = None
    planned_excess: tuple[tuple[str, int], ...] = ()
    known_excess: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()

    def planned_with(self, excess: Mapping[str, int]) -> MemoryProblem:
        """Its problem with `excess` counted beyond the model instead of `planned_excess`."""
        return (self.problem if self.unplanned is None else self.unplanned).with_excess(excess, planning=True)

    def problem_for(self, decisions: Sequence[str]) -> MemoryProblem:
        """The problem that predicts the plan of `decisions`: with what its compiled graphs held, where known."""
        if not self.known_excess:  # (the step search's every attempt asks: no code built then)
            return self.problem
        held = dict(self.known_excess).get(decisions_code(decisions))
        return self.problem if held is None else self.planned_with(dict(held))

    def levels(self, decisions: Sequence[str]) -> GraphLevels:
        """`GraphLevels` of the plan of `decisions` (`problem_for`)."""
        return GraphLevels.of(self.problem_for(decisions), decisions)

    def solve(self, context: StepContext | None, target: int, solver: Solver) -> tuple[tuple[str, ...], bool]:
        """Its plan within `target` in `context`, as its compile in that context makes it (`solve_knowing`)."""
        if not self.known_excess:
            return solver(in_step(self.problem, context, target), target)
        first = dict(self.planned_excess)
        found: list[tuple[tuple[str, ...], bool]] = []

        def solve(excess: Mapping[str, int]) -> tuple[tuple[str, ...], bool]:
            problem = self.problem if excess == first else self.planned_with(excess)
            found.append(solver(in_step(problem, context, target), target))
            return found[-1]

        def over(decisions: Sequence[str], held: Mapping[str, int]) -> bool:
            return plan_memory(in_step(self.planned_with(held), context, target), decisions).peak_bytes > target

        _, stands = solve_knowing({code: dict(e) for code, e in self.known_excess}, first, solve, over)
        decisions, feasible = found[-1]
        return decisions, feasible and stands

    def gradients_at(self, step: int) -> int:
        """Bytes of its parameter gradients made by `step` of its problem (they stay to the step's end)."""
        return sum(nbytes for at, nbytes in self.gradient_steps if at <= step)

    def held(self, boundary: int, recomputed: Set[str] = frozenset()) -> int:
        """Bytes this graph keeps alive for its backward while the others run, with a plan whose boundary level
        is `boundary` and that recomputes the candidates named `recomputed` (what they read is kept too)."""
        kept = sum(nbytes for nbytes, readers in self.freeable if recomputed and not recomputed.isdisjoint(readers))
        return max(0, boundary - self.shared_bytes) + kept


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The order of one training step: graph keys of its forward calls, in call order (a graph called per
    layer appears once per call), the distinct parameter bytes of the whole step, and what is alive
    throughout that no graph shows (gradients from earlier micro-batches, memory measured outside graphs)."""

    instances: tuple[str, ...]
    parameter_bytes: int
    outside_bytes: int = 0
    # Per call (empty: none): bytes of its inputs that an earlier call of the step already holds (counted
    # there, not again while this call runs), and the part of those this call holds itself too.
    inputs_held_before: tuple[int, ...] = ()
    held_twice: tuple[int, ...] = ()
    # Per call (empty: the graph's own figures): the bytes of `parameter_bytes` its graph takes (its timeline
    # counts them), and the gradients its backward leaves for the rest of the step. FSDP2 gathers a block's
    # parameters for its call only (they are not in `parameter_bytes`, which holds the shards) and leaves
    # sharded gradients.
    call_parameter_bytes: tuple[int, ...] = ()
    call_gradient_bytes: tuple[int, ...] = ()
    # Per call (empty: none): FSDP2's parameters gathered for it, of what its graph's timeline counts (for messages).
    call_gathered_bytes: tuple[int, ...] = ()
    forward_extra_bytes: int = 0  # alive during every forward besides (FSDP2's prefetched next gather)
    backward_extra_bytes: int = 0  # and every backward
    # Per call (empty: none), alive during its forward / its backward besides: parameters brought in for other
    # blocks while it runs (ParameterOffload's prefetch of its neighbours; FSDP2's gathers and reduce-scatters
    # beside a block's backward, `step.calls.fsdp_in_flight`).
    call_forward_extra_bytes: tuple[int, ...] = ()
    call_backward_extra_bytes: tuple[int, ...] = ()
    # Allocated at the step's turn, between its last forward and its first backward, by code outside the graphs
    # (a loss in eager code: its logits, its softmax, their gradients); measured, as `outside_bytes` can be.
    turn_bytes: int = 0
    # Blocks whose parameters may be offloaded (counted above as kept); `with_offloaded` counts a choice.
    offload_blocks: OffloadBlocks | None = None
    # The optimizer step after the step's last backward (None: none follows, as after a micro-batch): what it
    # allocates beyond what the step holds when its backwards end (its temporaries, a compressed state's
    # decoded chunk), and what the training loop holds then that no graph shows (a loss's logits); measured.
    optimizer_bytes: int | None = None
    # Of `outside_bytes`: gradients from earlier micro-batches that this step's gradients are added into (both
    # alive while its backward runs, one of them once it ended).
    accumulated_bytes: int = 0
    bucket_bytes: int = 0  # of `outside_bytes`: DistributedDataParallel's gradient buckets (for messages)
    # Per call (empty: none): bytes of its inputs and outputs that its backward does not read and that were freed
    # when its backward started (measured; `StepContext.backward_freed`): its graph's problem counts them there.
    call_backward_freed: tuple[int, ...] = ()
    # Per call (empty: none): the candidates of its graph whose recomputation would read what it freed (kept
    # alive for the backward then): held to be saved or offloaded while its context counts those bytes freed.
    call_keep_saved: tuple[frozenset[str], ...] = ()
    # Per call (empty: none), alive during its forward / its backward besides: other calls' inputs and outputs
    # that no graph counts as its holdings (a graph's output the training loop keeps; measured).
    call_forward_others: tuple[int, ...] = ()
    call_backward_others: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.offload_blocks is not None and (
                len(self.offload_blocks.uses) != len(self.instances)
                or len(self.call_parameter_bytes) != len(self.instances)
                or len(self.call_gradient_bytes) != len(self.instances)):
            raise ValueError("StepShape.offload_blocks needs per-call uses, parameter and gradient bytes")
        for name in ("inputs_held_before", "held_twice", "call_parameter_bytes", "call_gradient_bytes",
                     "call_forward_extra_bytes", "call_backward_extra_bytes", "call_backward_freed",
                     "call_keep_saved", "call_forward_others", "call_backward_others", "call_gathered_bytes"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.instances):
                raise ValueError(f"StepShape.{name} needs one entry per call")


@dataclasses.dataclass(frozen=True)
class OffloadBlocks:
    """Blocks of a step whose parameters may live in host memory between uses (`model_states/param_offload.py`),
    for a `StepShape` that counts every one of them as kept on the device. Per block: a name (any hashable),
    its parameter bytes, the gradient bytes its call's backward makes, and the gradients it already has
    (earlier micro-batches). Per call of the shape: the blocks whose parameters it takes, and those brought in
    beside it during its forward and during its backward (their prefetch), as block indices."""

    names: tuple[Hashable, ...]
    parameter_bytes: tuple[int, ...]
    gradient_bytes: tuple[int, ...]
    held_gradient_bytes: tuple[int, ...]
    uses: tuple[frozenset[int], ...]
    ahead: tuple[frozenset[int], ...]
    behind: tuple[frozenset[int], ...]

    def __post_init__(self) -> None:
        n = len(self.names)
        if not len(self.parameter_bytes) == len(self.gradient_bytes) == len(self.held_gradient_bytes) == n:
            raise ValueError("OffloadBlocks needs parameter, gradient and held-gradient bytes for every block")
        if not len(self.uses) == len(self.ahead) == len(self.behind):
            raise ValueError("OffloadBlocks needs uses, ahead and behind for every call")
        if any(not 0 <= b < n for b in set().union(*self.uses, *self.ahead, *self.behind)):
            raise ValueError(f"OffloadBlocks names a block outside 0..{n - 1}")


def with_offloaded(shape: StepShape, offloaded: Set[Hashable]) -> StepShape:
    """`shape` (its `offload_blocks` counted as kept on the device) with the blocks named in `offloaded` in host
    memory between uses: their parameters, gradients and held gradients leave the step's memory; each call
    counts those of its own blocks (its graph's timeline does) and those brought in beside it, in the phase
    that brings them."""
    blocks = shape.offload_blocks
    out = frozenset(i for i, name in enumerate(blocks.names) if name in offloaded) if blocks else frozenset()
    if not out:
        return shape
    n = len(shape.instances)
    p, g = blocks.parameter_bytes, blocks.gradient_bytes
    ahead = shape.call_forward_extra_bytes or (0,) * n
    behind = shape.call_backward_extra_bytes or (0,) * n
    held = sum(blocks.held_gradient_bytes[b] for b in out)
    return dataclasses.replace(
        shape,
        parameter_bytes=shape.parameter_bytes - sum(p[b] for b in out),
        outside_bytes=shape.outside_bytes - held,
        accumulated_bytes=max(0, shape.accumulated_bytes - held),
        call_parameter_bytes=tuple(
            shape.call_parameter_bytes[i] - sum(p[b] for b in blocks.uses[i] & out) for i in range(n)),
        call_gradient_bytes=tuple(
            shape.call_gradient_bytes[i] - sum(g[b] for b in blocks.uses[i] & out) for i in range(n)),
        call_forward_extra_bytes=tuple(ahead[i] + sum(p[b] for b in (blocks.ahead[i] & out) - blocks.uses[i])
                                       for i in range(n)),
        call_backward_extra_bytes=tuple(behind[i] + sum(p[b] for b in (blocks.behind[i] & out) - blocks.uses[i])
                                        for i in range(n)),
    )


TURN = "turn"  # the phase of a step's turn: after its last forward, before its first backward (eager code there)
OPTIMIZER = "optimizer"  # the optimizer step after the step's last backward (its temporaries on top of the step's end)


def _call_gradients(shape: StepShape, graphs: Mapping[str, GraphStep]) -> tuple[int, ...]:
    """The gradients each call's backward leaves for the rest of the step."""
    return shape.call_gradient_bytes or tuple(graphs[k].gradient_bytes for k in shape.instances)


def end_bytes(shape: StepShape, graphs: Mapping[str, GraphStep]) -> int:
    """What the step holds once its last backward ended: its parameters, the memory outside its graphs (the
    optimizers' state among it) and the gradients its calls left, those added into gradients already held
    counted once."""
    gradients = sum(_call_gradients(shape, graphs))
    return shape.parameter_bytes + shape.outside_bytes + gradients - min(shape.accumulated_bytes, gradients)


@dataclasses.dataclass(frozen=True)
class StepPeak:
    """The step's predicted peak and where it happens."""

    bytes: int
    graph: str  # the graph key
    shape: int  # which step shape (index into the shapes planned for)
    instance: int  # which call of that step (index into StepShape.instances)
    phase: str  # "forward", "backward", TURN (then graph/step: the last forward call, at its boundary), or
    # OPTIMIZER (then graph/step: the first call, whose backward ends the step, at its last step)
    step: int  # the schedule step in that graph's own problem
    # Of `bytes`: the parameter gradients this step made that are alive there (the graph's own made by then,
    # the later calls'; earlier micro-batches' are memory outside the graphs).
    gradient_bytes: int = 0
    # Of `bytes`: FSDP2's parameters gathered there (the running block's, and those gathered ahead or reduced
    # behind it: `StepShape.call_gathered_bytes`, `forward_extra_bytes`, `backward_extra_bytes`).
    gathered_bytes: int = 0


def _calls(shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep], held: Mapping[str, int]):
    """Per call of every shape: (shape index, call index, graph key, what the others hold in its forward,
    what they hold in its backward, what of its own the step freed before its backward)."""
    for s, shape in enumerate(shapes):
        n = len(shape.instances)
        before = shape.inputs_held_before or (0,) * n
        twice = shape.held_twice or (0,) * n
        kept = [max(0, held[k] - twice[j]) for j, k in enumerate(shape.instances)]  # each call's own holdings
        own_parameters = shape.call_parameter_bytes or tuple(graphs[k].parameter_bytes for k in shape.instances)
        gradients = shape.call_gradient_bytes or tuple(graphs[k].gradient_bytes for k in shape.instances)
        ahead = shape.call_forward_extra_bytes or (0,) * n
        behind = shape.call_backward_extra_bytes or (0,) * n
        freed = shape.call_backward_freed or (0,) * n
        ahead = [x + y for x, y in zip(ahead, shape.call_forward_others or (0,) * n)]
        behind = [x + y for x, y in zip(behind, shape.call_backward_others or (0,) * n)]
        for i, key in enumerate(shape.instances):
            common = max(0, shape.parameter_bytes - own_parameters[i]) + shape.outside_bytes
            earlier = max(0, sum(kept[:i]) - before[i])  # its inputs held by an earlier call: counted as its own
            later = sum(gradients[i + 1 :]) + shape.backward_extra_bytes + behind[i]
            yield s, i, key, common + earlier + shape.forward_extra_bytes + ahead[i], common + earlier + later, freed[i]


def contexts_for(
    shapes: Sequence[StepShape],
    graphs: Mapping[str, GraphStep],
    held: Mapping[str, int],
    caps: Mapping[str, int | None] | None = None,
) -> dict[str, StepContext]:
    """Each graph's context: the largest over its calls (in every step shape seen) of what the others hold
    during its forward and its backward, given what each graph holds between its phases (`held`); in the
    backward net of what the step freed of its own (below zero: `backward_freed`)."""
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    net: dict[str, int] = {}  # the largest of what the others hold less what it freed, over its calls
    for _, _, key, during_forward, during_backward, freed in _calls(shapes, graphs, held):
        forward[key] = max(forward.get(key, 0), during_forward)
        backward[key] = max(backward.get(key, 0), during_backward)
        net[key] = max(net[key], during_backward - freed) if key in net else during_backward - freed
    keep: dict[str, set[str]] = {}
    for shape in shapes:
        for key, names in zip(shape.instances, shape.call_keep_saved):
            keep.setdefault(key, set()).update(names)
    caps = caps or {}
    return {k: StepContext(forward[k], backward[k], caps.get(k), backward_freed=backward[k] - net[k],
                           keep_saved=tuple(sorted(keep.get(k, ()))) if backward[k] > net[k] else ())
            for k in forward}


def _gathered(shape: StepShape, i: int, phase: str) -> int:
    """FSDP2's gathered parameters alive at call `i`'s `phase`: its own in its forward and backward, and those
    its neighbours' gathers and reduce-scatters hold beside it (at the turn, the next forward's prefetch)."""
    if not shape.call_gathered_bytes:
        return 0
    own = shape.call_gathered_bytes[i] if phase != TURN else 0
    if phase != "backward":
        return own + shape.forward_extra_bytes
    # (A step with ParameterOffload blocks counts their prefetch in the same per-call figure: not FSDP2's.)
    behind = shape.call_backward_extra_bytes[i] if shape.call_backward_extra_bytes and not shape.offload_blocks else 0
    return own + shape.backward_extra_bytes + behind


def step_peak(
    shapes: Sequence[StepShape],
    graphs: Mapping[str, GraphStep],
    levels: Mapping[str, GraphLevels],
    phases: Sequence[str] = ("forward", "backward", TURN, OPTIMIZER),
) -> StepPeak:
    """The step's peak under each graph's plan: at every call, its own peak plus what the others hold; at
    each shape's turn, what the last call holds at its boundary, plus what the others hold, plus `turn_bytes`;
    and in the optimizer step that follows a shape, what the step holds at its end plus `optimizer_bytes`."""
    held = {k: graphs[k].held(levels[k].boundary, levels[k].recomputed) for k in levels}
    best: StepPeak | None = None
    for s, i, key, during_forward, during_backward, freed in _calls(shapes, graphs, held):
        lv = levels[key]
        last = i == len(shapes[s].instances) - 1
        for phase, own, at, extra in (
            ("forward", lv.forward_peak, lv.forward_peak_step, during_forward),
            ("backward", lv.backward_peak, lv.backward_peak_step, during_backward - freed),
            (TURN, lv.boundary, graphs[key].problem.backward_start, during_forward + shapes[s].turn_bytes),
        ):
            if phase == TURN and not last or phase not in phases:
                continue
            if at >= 0 and (best is None or own + extra > best.bytes):
                gradients = (graphs[key].gradients_at(at) + sum(_call_gradients(shapes[s], graphs)[i + 1:])
                             if phase == "backward" else 0)
                best = StepPeak(own + extra, key, s, i, phase, at, gradients, _gathered(shapes[s], i, phase))
    for s, shape in enumerate(shapes):
        if OPTIMIZER in phases and shape.optimizer_bytes is not None and shape.instances:
            nbytes = end_bytes(shape, graphs) + shape.optimizer_bytes
            if best is None or nbytes > best.bytes:
                first = shape.instances[0]
                made = sum(_call_gradients(shape, graphs))
                best = StepPeak(nbytes, first, s, 0, OPTIMIZER, graphs[first].problem.steps - 1,
                                made - min(shape.accumulated_bytes, made))
    if best is None:
        raise ValueError("a step needs at least one graph call")
    return best


def predicted_levels(
    shapes: Sequence[StepShape], graphs: Mapping[str, GraphStep], levels: Mapping[str, GraphLevels]
) -> tuple[int, int, int]:
    """What a measured step is checked against: the highest predicted bytes inside the graphs' forwards and
    backwards, at the step's turn, and held when its last backward ended (before an optimizer step)."""
    return (step_peak(shapes, graphs, levels, ("forward", "backward")).bytes,
            step_peak(shapes, graphs, levels, (TURN,)).bytes,
            max(end_bytes(s, graphs) for s in shapes))


Solver = Callable[[MemoryProblem, int], tuple[tuple[str, ...], bool]]  # (problem, target) -> (decisions, feasible)
