"""Planning a step: the first graph's context before any step was seen, a context per graph from the step's
shapes (`plan_step`), the model-state lever and offloaded blocks chosen with it, and what a plan was made
from so a measured step can be held against it (`_AsPlanned`). `Planning` is the part of the `StepRecorder`
that plans; it reads and writes the recorder's state (`recorder.py`)."""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.step_model import (
    GraphLevels,
    GraphStep,
    StepContext,
    StepShape,
    boundary_level,
    predicted_levels,
    recomputed_names,
    with_offloaded,
)
from dpcs_compiler.cost.step_search import frees_before_backward, plan_step
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.heap import paused_collector
from dpcs_compiler.report import STEPS_FILE, StepRecord, add_step_record
from dpcs_compiler.cost.budget import torch_plan_limit
from dpcs_compiler.cost.memory_model import MemoryProblem, plan_seconds
from dpcs_compiler.cost.model_state import (
    StateLever,
    StateRates,
    added_seconds,
    block_forward_starts,
    codec_rates,
    device_bytes,
    estimated_step_transient,
    levers,
    offload_link_seconds,
    offload_seconds,
    overlapped_host_step_seconds,
)
from dpcs_compiler.model_states.compressed_optimizer import CompressedOptimizer, measured_state_rates
from dpcs_compiler.debug import progress
from dpcs_compiler.solve import fits, solved_decisions
from dpcs_compiler.solve.model_state import StepWithState, choose_state_lever
from dpcs_compiler.stages.job import at_sizes, describe_budget
from dpcs_compiler.step.calls import _counted, _node_name, _step_ids, _where
from dpcs_compiler.step.holdings import (
    _Block,
    _decoded,
    _distinct,
    _held_elsewhere,
    _make_cuda_workspaces,
    _offloaded_now,
    _one_state_bytes,
    _optimizers_of,
    _parameter_ids,
    _regime,
    _state_bytes,
    unseen_in_first_step,
)
from dpcs_compiler.step.participant import Participant
from dpcs_compiler.step.records import Dumped, _describe, _dump_step_record, _say_infeasible, _split

log = logging.getLogger("dpcs.step")


def _solve(problem: MemoryProblem, target: int) -> tuple[tuple[str, ...], bool]:
    """The step planner's solver, naming each solve in the progress shown: `solve.fits`, the fast solver.

    A step's planning solves tens to hundreds of times (a search over levels, per graph), and what it keeps
    of a solve is whether a graph fits a level and what it then holds: each graph's own plan under the context
    chosen is solved again when it compiles, by the solver its size calls for (exactly up to 60 candidates).
    The exact solver here took 126 s of a 2-layer GPT-2's step planning (155 solves); the fast one is within
    0.3% of it on average on the solver benchmark (`benchmarks/solver_gap.py`) and has not missed a budget
    the exact one met there."""
    progress.detail(f"{len(problem.candidates)} candidates within {format_bytes(target)}")
    return fits(problem, target)


@dataclasses.dataclass(frozen=True)
class _AsPlanned:
    """What a step plan's prediction was made from: the shapes as planned, the graphs (by name; weakly), and
    the budget a fitting plan holds (None for one that does not fit)."""

    shapes: list[StepShape]
    dispatchers: dict[str, weakref.ref[Participant]]
    budget: int | None
    # Planned again because compiled variants went over, or well under, the budget: how many times in a row
    # (`recorder._predict_as_compiled`: over, once; under, at most CLOSER_ROUNDS).
    after_mismatch: int = 0
    record: StepRecord | None = None  # the step plan's record (None: one graph's own plan)
    dumped: list[Dumped] = dataclasses.field(default_factory=list)  # its lines in STEPS_FILEs


def _offers_torch(dispatchers) -> bool:
    """Whether the step planner offers torch's own partitions (`plan_step`'s `torch_limit`): not where a graph
    would not keep its own anyway (`keep_torch_plan=False`, or a plan in bf16, fp16 or fp8:
    `memory_plan.torch_plan_refusal`). Offered only where the step fits by the model with plans saving
    everything or with each graph's own partition (`cost.step_search._torch_offer`). Offered up to 6% over it
    under Inductor (tried on the bench's graph-break net, whose step Inductor runs within the budget), a graph
    whose own partition Inductor's schedule put over in its context was planned by dpcs in a context counting
    the others saving everything, which did not fit, and the step compiled again."""
    jobs = [d.current_job() for d in dispatchers]
    return all(d.options.keep_torch_plan for d in dispatchers) and not any(j is None or j.plan.low_precision for j in jobs)


def _planning_profile(dispatchers) -> Any:
    """The hardware profile the step's graphs are planned with (None if no graph has one yet)."""
    for d in dispatchers:
        resolved = getattr(d.current_job(), "resolved_profile", None)
        if resolved is not None:
            return resolved.profile
    return None


def _host_link(profile: Any) -> float | None:
    """The host link's bytes per second (the slower way) of a planning profile; None where the host is the
    device's own memory (or without a profile)."""
    if profile is None or profile.host_to_device is None or profile.device_to_host is None:
        return None
    return min(profile.host_to_device, profile.device_to_host)


def chosen_blocks(blocks: dict[tuple[int, int], _Block], shapes: Sequence[StepShape],
                  overlapped: frozenset[tuple[int, int]] = frozenset()) -> list[tuple[int, int]]:
    """The blocks the planner chooses about (`ParameterOffload(auto=True)`) in the order it offloads them: the
    largest first (the fewest transfers for the bytes), then in the order the steps take them, but the last
    first among blocks whose host step overlaps the next forward (`overlapped`: the later a block's forward,
    the more of its step that forward hides). The same on every rank of a job running the same model."""
    names = list(dict.fromkeys(n for s in shapes if s.offload_blocks for n in s.offload_blocks.names))
    chosen = [n for n in names if n in blocks and blocks[n].chosen]
    position = {n: i for i, n in enumerate(chosen)}
    return sorted(chosen, key=lambda n: (-blocks[n].parameter_bytes, -position[n] if n in overlapped else position[n]))


def overlapped_blocks(optimizers: Sequence[torch.optim.Optimizer],
                      blocks: dict[tuple[int, int], _Block]) -> frozenset[tuple[int, int]]:
    """The blocks whose optimizer step, when they are offloaded, runs beside the next forward: those of the
    ParameterOffload of a `CompressedOptimizer(overlap=True)` of the step."""
    offloads = {id(o.offload) for o in _distinct(optimizers)
                if isinstance(o, CompressedOptimizer) and o.overlap and o.offload is not None}
    return frozenset(n for n, b in blocks.items() if id(b.offload()) in offloads)


def forward_starts(shapes: Sequence[StepShape], graphs: dict[str, GraphStep]) -> dict[tuple[int, int], float]:
    """When each ParameterOffload block's forward starts, in seconds after the step's first forward starts
    (`cost.model_state.block_forward_starts`, from the forward seconds the graphs' cost model gives each call):
    the earliest over the step's shapes, which credits overlap least."""
    starts: dict[tuple[int, int], float] = {}
    for shape in shapes:
        blocks = shape.offload_blocks
        if blocks is None:
            continue
        seconds = [float(graphs[k].problem.step_seconds[:graphs[k].problem.backward_start].sum())
                   for k in shape.instances]
        at = block_forward_starts(seconds, shape.call_parameter_bytes, [sorted(u) for u in blocks.uses],
                                  blocks.parameter_bytes)
        for name, start in zip(blocks.names, at):
            starts[name] = min(start, starts.get(name, start))
    return starts


def offloading_seconds(chosen: Sequence[tuple[int, int]], forced: frozenset[tuple[int, int]],
                       blocks: dict[tuple[int, int], _Block], rates: StateRates,
                       overlapped: frozenset[tuple[int, int]], starts: dict[tuple[int, int], float]) -> float:
    """Seconds offloading the `chosen` blocks adds to a step where the `forced` ones are offloaded anyway: their
    copies, and their optimizer steps on the host, in the foreground or, for the `overlapped` blocks, beside the
    next forward (the wait they add to the forced blocks' own, the blocks stepped in the order the forward
    starts them, `starts`)."""
    if not chosen:
        return 0.0
    seconds = sum(offload_link_seconds(blocks[n].parameter_bytes, blocks[n].gradient_bytes, rates) if n in overlapped
                  else offload_seconds(blocks[n].parameter_bytes, blocks[n].gradient_bytes,
                                       blocks[n].parameter_elements, rates) for n in chosen)

    def behind(out: Sequence[tuple[int, int]]) -> float:
        queue = sorted((n for n in out if n in overlapped), key=lambda n: starts.get(n, 0.0))
        return overlapped_host_step_seconds([blocks[n].parameter_elements for n in queue],
                                            [starts.get(n, 0.0) for n in queue], rates)

    return seconds + max(0.0, behind([*forced, *chosen]) - behind(list(forced)))


def _plan_with_model_state(
    shapes: list[StepShape], graphs: dict[str, GraphStep], current: dict[str, tuple[str, ...]], settled: bool,
    optimizers: Sequence[torch.optim.Optimizer], blocks: dict[tuple[int, int], _Block],
    link_bytes_per_second: float | None, transients: Sequence[dict[tuple, int]] | None = None,
    memory_bandwidth: float | None = None, torch_limit: int | None = None,
) -> tuple[list[StepShape], Any, dict[str, Any] | None]:
    """The step plan with the model state alive through the step (the optimizers' state; the parameters of the
    ParameterOffload blocks kept on the device), and the model-state levers dpcs chooses: how the "auto"
    CompressedOptimizers keep their state (`cost/model_state.py`), and how many of the auto ParameterOffload
    blocks are offloaded (`chosen_blocks`, offloaded in that order), at the least added time, theirs plus the
    activation plan's (`solve/model_state.py`). Host levers and offloaded blocks are offered only where the
    planning profile has a host link (`link_bytes_per_second`; on CPU the host is the device's memory). Each
    shape's `optimizer_bytes` counts the optimizer step's temporaries as the state is kept now; `transients`
    (per shape, by `_regime`) are those measured, from which each option's are estimated. Encoding and
    decoding cost what the planning profile's `memory_bandwidth` gives them (`cost.model_state.codec_rates`),
    so a pinned profile chooses alike on every machine; only an offloaded block's host step is timed here
    (on CUDA, where blocks are offloaded).
    Returns the shapes as planned (the choice counted in), the plan, and what was chosen (None without
    optimizers or blocks)."""
    now = _offloaded_now()
    overlapped = overlapped_blocks(optimizers, blocks) if link_bytes_per_second is not None else frozenset()
    candidates = chosen_blocks(blocks, shapes, overlapped)
    forced = frozenset(n for s in shapes if s.offload_blocks for n in s.offload_blocks.names
                       if n in now and n not in candidates)
    auto = [o for o in optimizers if isinstance(o, CompressedOptimizer) and o.auto]
    if not optimizers and not candidates:
        counted = [with_offloaded(s, now) for s in shapes]
        return counted, plan_step(counted, graphs, current, _solve, settled, final=solved_decisions,
                                  torch_limit=torch_limit), None
    rates = None
    if auto or (candidates and link_bytes_per_second is not None):
        device = next((o.device() for o in optimizers if isinstance(o, CompressedOptimizer)), torch.device("cpu"))
        # Timed here only what the profile does not give: the codecs without a profile, the host step with a link.
        timed = (measured_state_rates(str(device))
                 if memory_bandwidth is None or link_bytes_per_second is not None else None)
        encode, decode = (codec_rates(memory_bandwidth) if memory_bandwidth is not None
                          else (timed.encode_seconds, timed.decode_seconds))
        rates = StateRates(encode, decode, link_bytes_per_second, timed.host_step_seconds if timed else 0.0,
                           timed.device_step_seconds if timed else 0.0)
    offloadable = len(candidates) if link_bytes_per_second is not None else 0
    starts = forward_starts(shapes, graphs) if overlapped else {}
    state_levers: list[StateLever | None] = list(levers(host_is_device=link_bytes_per_second is None)) if auto else [None]

    plans: dict[tuple, tuple[list[StepShape], Any]] = {}
    state_of: dict[tuple, int] = {}
    options = []
    for k in range(offloadable + 1):
        out = forced | frozenset(candidates[:k])
        ids = _parameter_ids(blocks, out)
        fixed = sum(o.device_state_bytes(ids) if isinstance(o, CompressedOptimizer) else _one_state_bytes(o)
                    for o in _distinct(optimizers) if o not in auto)
        kept = sum(b.parameter_bytes + b.gradient_bytes for n, b in blocks.items() if n in candidates[k:])
        moved = offloading_seconds(candidates[:k], forced, blocks, rates, overlapped, starts)
        counts = [o.state_shape(ids) for o in auto]
        for lever in state_levers:
            state = fixed + (sum(device_bytes(c, lever) for c in counts) if lever is not None else 0)
            seconds = moved + (sum(added_seconds(c, lever, rates) for c in counts) if lever is not None else 0.0)
            state_of[(lever, k)] = state
            options.append(((lever, k), state + kept, seconds))

    # The optimizer step's temporaries, measured as the state is kept now, estimated as each option keeps it.
    decoded = _decoded(optimizers, blocks)
    regime_now = _regime(optimizers, now)

    def plan_with(option: tuple, find_lowest: bool = False) -> StepWithState:
        out = forced | frozenset(candidates[:option[1]])
        counted = []
        for s, table in zip(shapes, transients or [{}] * len(shapes)):
            s = with_offloaded(s, out)
            optimizer = s.optimizer_bytes
            if optimizer is not None and table:
                optimizer += (estimated_step_transient(table, (option[0], out), decoded)
                              - estimated_step_transient(table, regime_now, decoded))
            counted.append(dataclasses.replace(s, outside_bytes=s.outside_bytes + state_of[option],
                                               optimizer_bytes=optimizer))
        plan = plan_step(counted, graphs, current, _solve, settled, find_lowest, final=solved_decisions,
                         torch_limit=torch_limit)
        plans[option] = (counted, plan)
        seconds = sum(plan_seconds(graphs[k].problem, plan.decisions[k]) for k in counted[plan.peak.shape].instances)
        return StepWithState(plan.feasible, seconds, plan.peak.bytes)

    if len(options) == 1 and not candidates:  # nothing to choose: the state as it is
        (option, _, _), = options
        plan_with(option, find_lowest=True)
        counted, plan = plans[option]
        return counted, plan, {"chosen": False, "bytes": state_of[option]}
    choice = choose_state_lever(options, plan_with)
    if not choice.step.feasible:
        plan_with(choice.lever, find_lowest=True)  # the plans of the smallest step peak, for the message
    counted, plan = plans[choice.lever]
    lever, k = choice.lever
    return counted, plan, {
        "chosen": True, "format": lever.format if lever else None, "on_host": lever.on_host if lever else None,
        "offloaded_blocks": k, "offloadable_blocks": len(candidates),
        "host_step_overlapped": bool(overlapped & set(candidates)),
        "bytes": state_of[choice.lever], "seconds": choice.state_seconds,
        "activation_seconds": choice.step.activation_seconds,
        "options": [[_describe(o, len(candidates)), nbytes, seconds] for o, nbytes, seconds in options],
    }


class Planning:
    """The `StepRecorder`'s planning of steps (module docs)."""

    def first_graph_context(self, example_inputs: Sequence[Any], root: torch.nn.Module | None = None,
                            follows: bool = False) -> StepContext | None:
        """For the step's first graph, compiled before any step of it was seen: what the rest of the step holds
        around it from the first step on, which no graph shows, so that its first plan already fits: the state
        its optimizers hold once they have stepped (torch's optimizers' first-step state anticipated,
        `cost/optimizer_state.py`), the compiled module `root`'s parameters it does not take and, where more
        graphs `follows`, their gradients (`unseen_in_first_step`), and on CUDA what the process holds beyond
        the graph's inputs (other models, and the cuBLAS workspaces each thread makes at its first matrix
        product, made here first: `_make_cuda_workspaces`). None when that is nothing, or the inputs are fake
        (DDP's graph splitting). `example_inputs`: its inputs and its own parameters."""
        from torch._subclasses.fake_tensor import is_fake

        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        if any(is_fake(x) for x in tensors):
            return None
        parameters = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors
                      if isinstance(x, torch.nn.Parameter)}
        optimizers = _optimizers_of(parameters)
        state = _state_bytes(optimizers)
        device = next((x.device for x in tensors if x.device.type == "cuda"), None)
        elsewhere = 0
        if device is not None:
            _make_cuda_workspaces(device)
            inputs = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors}
            elsewhere = _held_elsewhere(device, inputs, optimizers)
        unseen, later = unseen_in_first_step(root, tensors, follows, device)
        if device is not None:  # allocated, so counted in `elsewhere` already
            elsewhere = max(0, elsewhere - unseen)
        around = state + elsewhere + unseen
        if around + later == 0:
            return None
        log.info("dpcs: the step's first graph is planned with %d B held around it (optimizer state %d B, on the "
                 "device beside its inputs %d B, of which the module's parameters it does not take and their "
                 "gradients %d B), and %d B more in its backward (their gradients to come)", around, state,
                 elsewhere + unseen, unseen, later)
        return StepContext(forward_bytes=around, backward_bytes=around + later)

    def provisional_context(self, example_inputs: Sequence[Any], root: torch.nn.Module | None = None,
                            follows: bool = False) -> StepContext | None:
        """For a graph compiled in the middle of a step (its order not known yet): what the graphs that ran
        before it in this step hold, as their plans say, and the compiled module `root`'s parameters no graph
        so far takes, with, where more graphs `follows`, their gradients in its backward
        (`unseen_in_first_step`); None at the start of a step, or if unknown."""
        if not self.calls or self.partial:
            return None
        try:
            own = {x.untyped_storage().data_ptr() for x in example_inputs if isinstance(x, torch.nn.Parameter)}
        except Exception:  # fake parameters (DDP's graph splitting): planned alone first
            return None
        held, parameters, gradients = 0, {}, {}
        for c in self.calls:
            graph = c.dispatcher.step_graph()
            if graph is None:
                return None
            g, decisions = graph
            held += g.held(boundary_level(g.problem, decisions), recomputed_names(g.problem, decisions))
            parameters.update(c.parameters)
            gradients.update(c.gradients)
        common = sum(v for k, v in parameters.items() if k not in own) + sum(gradients.values())
        unseen, later = unseen_in_first_step(root, example_inputs, follows, taken=parameters)
        common += unseen
        return StepContext(forward_bytes=common + held, backward_bytes=common + held + later, first_step=True)

    # -- planning ------------------------------------------------------------------------------------------
    def plan(self) -> StepRecord | None:
        """Plan the step shapes seen with the latest one (those sharing a graph with it, at its sizes) for one
        budget, and switch the graphs whose plans change."""
        self._planned: dict[str, Participant] = {}
        try:
            with progress.task("dpcs: planning the step"):
                return self._plan()
        finally:
            for dispatcher in self._planned.values():  # first plans that ran uncompiled are compiled now
                dispatcher.step_was_planned()

    def _plan(self) -> StepRecord | None:
        self.to_plan = False
        self.torch_planned = False
        self.as_planned = None
        after_mismatch, self.replan_as_compiled = self.replan_as_compiled, 0
        candidates: list[tuple[tuple, StepShape, list[Participant]]] = []
        for key, (shape, refs) in list(self.shapes.items()):
            alive = [r() for r in refs]
            if any(d is None for d in alive):  # a graph of this shape is gone (recompiled): the shape is stale
                del self.shapes[key]
                continue
            if key == self.latest_key or key[1] == self.latest:  # other sizes: each bucket its own plans
                candidates.append((key, shape, alive))
        # Steps of other models (no graph in common with the latest step's) are not this step's.
        names = set(self.latest_key[0])
        grown = True
        while grown:
            grown = False
            for _, shape, _ in candidates:
                if names & set(shape.instances) and not set(shape.instances) <= names:
                    names |= set(shape.instances)
                    grown = True
        shapes, dispatchers, planned = [], {}, []
        for key, shape, alive in candidates:
            if set(shape.instances) <= names:
                shapes.append(shape)
                planned.append(key)
                dispatchers.update({d.name: d for d in alive})
        if not shapes:
            return None
        self._planned = dispatchers
        # In a distributed job rank 0 plans and every rank applies its plan (the ranks run the same graphs).
        agreeing = rank_agreement.world() is not None and all(d.options.rank_agreement for d in dispatchers.values())

        optimizers = list(self.optimizers)

        offer_torch = not (after_mismatch or self.torch_refused) and _offers_torch(dispatchers.values())

        def decide() -> tuple[StepRecord | None, str | None, list[StepShape] | None]:
            with paused_collector():  # as in a graph's passes (`heap`)
                return self._decide(shapes, dispatchers, optimizers, self.blocks, [self._transients(k) for k in planned],
                                    offer_torch)

        record, message, counted = rank_agreement.from_rank_zero(decide, "step plan") if agreeing else decide()
        self.plans += 1
        if record is None or record.optimizer_state is None or not record.optimizer_state.get("chosen"):
            self._note_planned(planned, optimizers)
        if record is None:
            (only,) = dispatchers.values() if len(dispatchers) == 1 else (None,)
            graph = only.step_graph() if only is not None else None
            if graph is not None:
                # One graph alone: its own plan is the step's. Measure this step against its prediction, so
                # what the step allocates outside the graph (a loss in eager code) is counted if it goes over.
                if only.bucket in only.provisional:  # a first plan (it ended at a graph break): its own from now,
                    only.set_step_context(None)  # checked at the next step
                    self.to_plan = True
                    return None
                # Its compile left the budget's verdict to the step (its outputs might have been dropped before
                # its backward): they were not, so its own plan's verdict stands.
                deferred = only.take_deferred_infeasible()
                if deferred is not None:
                    _say_infeasible(deferred, [only])
                g, decisions = graph
                levels = {only.name: GraphLevels.of(g.problem, decisions)}
                self.verify_in, self.predicted = 0, predicted_levels(shapes, {only.name: g}, levels)
                self.predicted_peak = max(self.predicted[:2])
                self.predicted_state_bytes = 0
                # Re-predicted from its compiled variant, not planned again (a plan of one graph is its own).
                self.as_planned = _AsPlanned(shapes, {only.name: weakref.ref(only)}, None)
                self.fitted_budget = None
            return None
        add_step_record(record)
        for d in dispatchers.values():  # the step's plan decides instead (and its message, below, if it does not fit)
            d.take_deferred_infeasible()
        chosen = record.optimizer_state or {}
        if chosen.get("chosen"):  # every rank its own optimizers and blocks, as rank 0's plan says
            if chosen["format"] is not None:
                lever = StateLever(chosen["format"], chosen["on_host"])
                for optimizer in optimizers:
                    if isinstance(optimizer, CompressedOptimizer) and optimizer.auto:
                        optimizer.use(lever)
            if chosen["offloadable_blocks"]:
                order = chosen_blocks(self.blocks, shapes, overlapped_blocks(optimizers, self.blocks))
                out = set(order[:chosen["offloaded_blocks"]])
                for po in {b.offload() for b in self.blocks.values() if b.chosen} - {None}:
                    po.use([m for m in po.modules if (id(po), id(m)) in out])
            self._note_planned(planned, optimizers)  # as they keep their state now
        dumped = [_dump_step_record(root / STEPS_FILE, record)
                  for root in {d.options.dump_dir for d in dispatchers.values() if d.options.dump_dir is not None}]
        dumped = [d for d in dumped if d is not None]
        log.info(
            "dpcs: %s of %d graph calls: predicted peak %d B at %s (%s, %s)%s",
            record.step, len(record.calls), record.predicted_peak_bytes, record.peak_graph, record.peak_phase,
            record.peak_node, ", re-planned" if record.replanned else "",
        )
        if message is not None:
            _say_infeasible(message, dispatchers.values())
        if record.replanned:
            for name, d in dispatchers.items():
                d.set_step_context(StepContext.parse(record.contexts.get(name)))
        # Whether the graphs run in contexts offered torch's partitions: this plan's, or kept from an earlier one.
        self.torch_planned = any(d.step_context is not None and d.step_context.torch_plan for d in dispatchers.values())
        self.torch_budget = record.budget_bytes if self.torch_planned and record.feasible else None
        self.fitted_budget = record.budget_bytes if record.feasible else None
        # Measure the step after the next one (the next compiles the new variants) against the prediction.
        self.verify_in, self.predicted = 1, (record.graphs_peak_bytes, record.turn_peak_bytes, record.end_bytes)
        self.predicted_peak = record.predicted_peak_bytes
        self.predicted_state_bytes = (record.optimizer_state or {}).get("bytes", 0)
        self.as_planned = _AsPlanned(counted or shapes, {n: weakref.ref(d) for n, d in dispatchers.items()},
                                     record.budget_bytes if record.feasible else None, after_mismatch, record,
                                     dumped)
        return record

    def _note_planned(self, keys: list[tuple], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for key in keys:
            self.planned_state[key] = ({id(o) for o in optimizers}, _state_bytes(optimizers))

    @staticmethod
    def _decide(shapes: list[StepShape], dispatchers: dict[str, Participant],
                optimizers: Sequence[torch.optim.Optimizer] = (),
                blocks: dict[tuple[int, int], _Block] | None = None,
                transients: Sequence[dict[tuple, int]] | None = None,
                offer_torch: bool = False,
                ) -> tuple[StepRecord | None, str | None, list[StepShape] | None]:
        """The step plan as a record, the error message when no plan fits (None when it does), and the shapes
        as planned (the model state's choice counted in; None without a record)."""
        started = time.perf_counter()
        graphs: dict[str, GraphStep] = {}
        current: dict[str, tuple[str, ...]] = {}
        for name, d in dispatchers.items():
            step_graph = d.step_graph()
            if step_graph is None:
                warnings.warn(
                    f"dpcs cannot plan the training step of {len(dispatchers)} graphs for one budget: {name} has no "
                    "memory plan to re-make (it fell back, or is not a training graph); each graph keeps its own plan",
                    category=DpcsWarning, stacklevel=5,
                )
                return None, None, None
            graphs[name], current[name] = step_graph
        settled = not any(d.bucket in d.provisional for d in dispatchers.values())
        profile = _planning_profile(dispatchers.values())
        budget = min(int(d.current_budget_bytes or 0) for d in dispatchers.values()) or None
        torch_limit = torch_plan_limit(budget) if offer_torch and budget is not None else None
        shapes, plan, state = _plan_with_model_state(shapes, graphs, current, settled, optimizers, blocks or {},
                                                     _host_link(profile), transients,
                                                     profile.memory_bandwidth if profile is not None else None,
                                                     torch_limit)
        if plan.alone and not frees_before_backward(shapes):
            return None, None, None  # one graph: its own plan is the step's (its compile raised or warned already)
        # One graph whose step frees some of its outputs before its backward (a loss's logits): its plan stands,
        # but its own prediction counts those alive; the step's is recorded (and, if it does not fit, said).
        peak = plan.peak
        peak_node = _node_name(dispatchers[peak.graph], peak.step)
        graphs_peak, turn_peak, end = predicted_levels(shapes, graphs, plan.levels)
        holds_most = plan.holds_most(graphs)
        record = StepRecord(
            step=f"step_{next(_step_ids):03d}",
            calls=list(shapes[peak.shape].instances),
            budget_bytes=budget,
            predicted_peak_bytes=peak.bytes,
            peak_graph=peak.graph,
            peak_node=peak_node,
            peak_phase=peak.phase,
            feasible=plan.feasible,
            replanned=plan.level is not None,
            holds_most=holds_most,
            outside_bytes=max(s.outside_bytes for s in shapes),
            turn_bytes=max(s.turn_bytes for s in shapes),
            graphs_peak_bytes=graphs_peak,
            turn_peak_bytes=turn_peak,
            end_bytes=end,
            optimizer_bytes=max((s.optimizer_bytes for s in shapes if s.optimizer_bytes is not None), default=None),
            gradient_bytes=peak.gradient_bytes,
            gathered_bytes=peak.gathered_bytes,
            shapes=len(shapes),
            # Each compile told what its graph's plans compiled before held beyond the model (it plans as the step did).
            contexts={k: (dataclasses.replace(c, known_excess=graphs[k].known_excess).to_json() if c else None)
                      for k, c in plan.contexts.items()},
            parameter_bytes=max(s.parameter_bytes for s in shapes),
            bucket_bytes=max(s.bucket_bytes for s in shapes),
            optimizer_state=state,
            planning_seconds=time.perf_counter() - started,
            solves=plan.solves,
            torch_plans=plan.torch_plans,
        )
        if plan.feasible:
            return record, None, shapes
        held = graphs[holds_most].held(plan.levels[holds_most].boundary, plan.levels[holds_most].recomputed)
        # Dynamic shapes: the sizes planned for (a step is planned per size bucket of its graphs).
        sizes = dict(sorted({s.name: b for d in dispatchers.values() for s, b in zip(d.size_symbols, d.bucket)}.items()))
        message = (
            f"{describe_budget(budget or 0)} cannot be met for the training step of {len(record.calls)} graph calls "
            f"({', '.join(_counted(record.calls))}){at_sizes(sizes)}: the smallest step peak dpcs can reach is "
            f"{format_bytes(peak.bytes)} ({peak.bytes} B), {_where(peak.phase, peak.graph, peak_node)}; "
            f"{holds_most} holds the most for its backward while the others run ({format_bytes(held)})"
            f"{_split(record)}"
        )
        return record, message, shapes
