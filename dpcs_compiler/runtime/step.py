"""Learning a training step's graphs, and planning them for one budget (`cost/step_model.py`).

A graph compiled with a memory_budget (and budget_scope "step", the default) takes part: its dispatcher hands
its calls to the `StepRecorder` while the recorder watches. For each forward call that builds an autograd
graph, the recorder notes the graph, its parameters (by storage, counted once for the step), the
gradients already in `.grad` (earlier micro-batches) and weak references to the storages of its inputs and
outputs its backward does not read, and puts a pre-hook on the call's backward node that reads which of those
the step has freed (and what other calls left alive that no graph counts) and queues an end-of-backward
callback. When every such backward has ended, one step is complete: its shape is
the graphs in forward call order.

The first step runs first plans (`GraphDispatcher`): a graph compiled in the middle of a step counts what the
graphs before it hold, and one whose compile ended at a graph break holds least between its phases. At the
first forward call after a step of a new shape, the recorder plans the step (`plan_step`) with each graph's
memory problem, kept by its dispatcher: if the graphs' own settled plans fit the step, nothing changes;
otherwise each graph gets a context
(what the others hold around it, and a cap on what it holds itself) and switches, at its next call, to the
variant compiled for it, between steps and without Dynamo, as runtime variants do. A step no plan fits raises
`BudgetInfeasibleError` naming the smallest step peak reached and the graph that holds the most (or warns,
under on_infeasible="best").

The step after a plan takes effect is measured (`_Meter`): what it holds beyond the plan at its turn (eager
code between the last forward and the first backward, such as a loss) or elsewhere is counted, and the step
planned again if that raises its predicted peak. In a distributed job every rank takes these decisions alike.

Watching stops after `STABLE_STEPS` steps of shapes already planned for; a newly compiled graph, a new size
bucket, a runtime decision that changes a graph's variant, or graphs called in an order not planned for
(`glance`: a list append per call while not watching) starts it again (the step it starts in can be
partly seen: planned together with the full ones, it never loosens their contexts). Shapes seen since the
process started are all planned for, so steps that alternate between branches hold the budget on each.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from gc import get_objects
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from torch.multiprocessing.reductions import StorageWeakRef

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.step_model import (
    OPTIMIZER,
    TURN,
    GraphLevels,
    GraphStep,
    OffloadBlocks,
    StepContext,
    StepShape,
    boundary_level,
    end_bytes,
    frees_before_backward,
    plan_step,
    predicted_levels,
    recomputed_names,
    step_peak,
    with_offloaded,
)
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.heap import paused_collector
from dpcs_compiler.passes.analysis.planning import Freeable, StepSharing
from dpcs_compiler.measure import BEFORE_PROFILING, CpuMemoryProfile, CudaMemoryTrace, optimizer_state_bytes
from dpcs_compiler.files import write_text_atomic
from dpcs_compiler.report import _ON_CLEAR, STEPS_FILE, StepRecord, add_step_record, compile_count, compile_records, compiles_raised
from dpcs_compiler.cost.budget import CORRECTION_MIN_BYTES, CORRECTION_MIN_FRACTION, torch_plan_limit
from dpcs_compiler.cost.memory_model import MemoryProblem, plan_seconds
from dpcs_compiler.cost.optimizer_state import anticipated_state_bytes, state_now_bytes
from dpcs_compiler.cost.model_state import (
    StateLever,
    StateRates,
    added_seconds,
    codec_rates,
    device_bytes,
    estimated_step_transient,
    levers,
    offload_seconds,
    step_transient_bytes,
)
from dpcs_compiler.model_states.compressed_optimizer import INSTANCES, CompressedOptimizer, measured_state_rates
from dpcs_compiler.model_states.param_offload import INSTANCES as OFFLOADS
from dpcs_compiler.model_states.param_offload import ParameterOffload
from dpcs_compiler.debug import progress
from dpcs_compiler.solve import fits, solved_decisions
from dpcs_compiler.solve.model_state import StepWithState, choose_state_lever
from dpcs_compiler.stages.job import BudgetInfeasibleError, describe_budget

if TYPE_CHECKING:
    from dpcs_compiler.runtime.variants import GraphDispatcher

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


FSDP_BLOCKS_IN_FLIGHT = 3  # FSDP2 backward: blocks' worth of gathers and reduce-scatters beside the one running
STABLE_STEPS = 2
# A measured planned step more than `cost.budget.measurement_tolerance` above its prediction is planned again
# with the excess counted.
MAX_CORRECTIONS = 2  # complete steps of known shapes after which the recorder stops watching
MAX_TRANSIENT_UPDATES = 4  # times an optimizer step's measured temporaries re-plan a step shape
MAX_PENDING_CALLS = 100_000  # forward calls without their backwards after which a recording is dropped
_step_ids = itertools.count()


@dataclasses.dataclass
class _Call:
    dispatcher: GraphDispatcher
    parameters: dict[int, int]  # storage pointer -> bytes
    gradients: dict[int, int]  # parameter storage pointer -> bytes of the .grad it already has
    inputs: dict[int, int]  # its other tensor inputs: storage pointer -> bytes
    held: dict[int, int]  # inputs and outputs its backward reads (it holds them): storage pointer -> bytes
    outside: dict[int, int]  # memory of the step outside graphs, by owner (DDP's gradient buckets)
    bucket: tuple[int, ...]  # the graph's size bucket at this call (dynamic shapes)
    own_gradients: int  # the gradients its backward leaves for the rest of the step (FSDP2: sharded)
    gathered: int  # FSDP2: parameter bytes gathered for this call only (its timeline counts them)
    fsdp: _Fsdp | None  # FSDP2's shards and sharded gradients, as seen at this call
    # ParameterOffload blocks (`_Block`): those whose parameters it takes, and those brought in beside it during
    # its forward and its backward (their prefetch).
    blocks: tuple[tuple[int, int], ...] = ()
    ahead: frozenset[tuple[int, int]] = frozenset()
    behind: frozenset[tuple[int, int]] = frozenset()
    # Its inputs and outputs its backward does not read (`StepSharing.freeable`), each with a weak reference to
    # its storage; and the bytes of those freed when its backward started, with the candidates that must not be
    # recomputed for them to stay free (`StepShape.call_backward_freed`, `call_keep_saved`).
    droppable: tuple[tuple[StorageWeakRef, int, Freeable], ...] = ()  # (reference, storage pointer, buffer)
    freed: int = 0
    keep_saved: frozenset[str] = frozenset()
    # The other calls' droppable buffers alive when its forward starts and when its backward starts: bytes no
    # graph counts there (each graph's holdings leave them out), such as the last graph's output a training loop
    # keeps through the backward (`StepShape.call_forward_others`, `call_backward_others`).
    forward_others: int = 0
    backward_others: int = 0
    # Of `held`: what it holds only because its plan recomputes from it (`_kept_for_recomputation`).
    kept: frozenset[int] = frozenset()

    def backward_starts(self, calls: Sequence[_Call], collect: bool) -> None:
        """Its backward starts: read which of its droppable buffers the step has freed, and what the others'
        still hold; with `collect`, after a garbage collection if outputs worth a correction are alive (a step in
        which Dynamo compiled frames, or a compile raised, leaves reference cycles, which can hold a graph's output
        the loop has dropped; `_compile_marks`)."""
        if collect and _alive_elsewhere(calls, None, set(), outputs_only=True) >= CORRECTION_MIN_BYTES:
            gc.collect()
        index = next((i for i, c in enumerate(calls) if c is self), len(calls))
        # One a call whose backward is still to run reads is freed or not as that call's plan saves it or
        # recomputes it: not counted (that call counts it while it holds it).
        held_elsewhere = {p for c in calls[:index] for p in c.held}
        gone = [(p, f) for ref, p, f in self.droppable if ref.expired() and p not in held_elsewhere]
        self.freed = sum(f.nbytes for _, f in gone)
        self.keep_saved = self.keep_saved | {name for _, f in gone for name in f.readers}
        # One the calls whose backwards are still to run could keep alive by recomputing from it: they keep
        # what would read it saved too.
        freed = {p for p, _ in gone}
        for c in calls[:index]:
            c.keep_saved = c.keep_saved | {name for _, p, f in c.droppable if p in freed for name in f.readers}
        # Calls before it run their backwards after it: what they hold for them is counted as theirs; its own
        # inputs and outputs, as its own.
        self.backward_others = _alive_elsewhere(calls, self, {p for c in calls[:index] for p in c.held}
                                                | {p for _, p, _ in self.droppable} | set(self.inputs) | set(self.held))


@dataclasses.dataclass
class _Block:
    """A module of a ParameterOffload, as the step sees it; named (id of the offload, id of the module)."""

    offload: weakref.ref[ParameterOffload]
    module: weakref.ref[torch.nn.Module]
    parameter_bytes: int
    parameter_elements: int
    gradient_bytes: int  # of its parameters that take a gradient
    held_gradient_bytes: int  # gradients it has from earlier micro-batches (on the device, or on the host)
    chosen: bool  # the planner chooses whether it is offloaded (`ParameterOffload(auto=True)`)


class StepRecorder:
    """Watches the calls of the graphs that take part in step planning, and plans steps (module docs)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every graph and step seen (their graphs stay as they are compiled)."""
        for d in list(getattr(self, "participants", ())):
            d._watch = False
        self.stop_measuring()
        self.participants: weakref.WeakSet[GraphDispatcher] = weakref.WeakSet()
        self.calls: list[_Call] = []
        self.marks = _compile_marks()  # read at the last step end or garbage collection (`_Call.backward_starts`)
        self.glanced: list[str] = []  # graph names called since watching stopped (`glance`)
        self.pending = 0
        self.partial = False
        # (graph names, size buckets) of the calls -> the step's shape and its graphs
        self.shapes: dict[tuple, tuple[StepShape, list[weakref.ref[GraphDispatcher]]]] = {}
        self.latest: tuple = ()  # the size buckets of the last complete step
        self.latest_key: tuple = ((), ())  # and its key
        # Measuring a planned step (`_Meter`): steps to let pass first (the one compiling the new variants),
        # the meter of the step being measured, and per shape what was measured beyond the plan, counted.
        self.verify_in: int | None = None
        self.meter: _Meter | None = None
        # (peak outside the step's turn, at its turn, held when its backwards end), and the step's peak, planned
        self.predicted: tuple[int, int, int] | None = None
        self.predicted_peak = 0
        self.predicted_state_bytes = 0  # the optimizers' state that prediction counts
        self.as_planned: _AsPlanned | None = None  # what the prediction was made from (`_predict_as_compiled`)
        self.replan_as_compiled = False  # the plan under way follows compiled variants over their budget
        # No cost at no pressure (`plan_step`'s `torch_limit`): whether the plan measured next keeps torch's own
        # partitions, and whether a step that kept them was measured over its prediction (not offered again).
        self.torch_planned = False
        self.torch_refused = False
        self.torch_budget: int | None = None  # the budget a step plan offering them holds (None: not offered)
        self.fitted_budget: int | None = None  # the budget the step plan measured next fits (None: none fits)
        self.measuring = False  # this step is measured (every rank alike; `meter` None where it cannot be)
        self.due: tuple[_Meter | None, tuple | None] | None = None  # a measured step waiting to be read
        self.outside_measured: dict[tuple, int] = {}
        self.turn_measured: dict[tuple, int] = {}
        # The optimizer step after a watched step (`_OptimizerMeter`): the step's key while one may follow, the
        # meter of the optimizer step under way, and the most its steps allocated beyond what they started and
        # ended with, per kind of step (steady; or making new state, a first step). Per shape: the temporaries
        # measured per way of keeping the model state (`_regime`) and whether from a steady step, how often they
        # were updated, and what the training loop held when the step's backwards ended beyond its plan
        # (`_correct`).
        self.optimizer_key: tuple | None = None
        self.optimizer_meter: _OptimizerMeter | None = None
        self.optimizer_seen: dict[bool, int] = {}
        self.transient_measured: dict[tuple, dict[tuple, tuple[int, bool]]] = {}  # step key -> `_regime` -> figure
        self.transient_updates: dict[tuple, int] = {}
        self.end_measured: dict[tuple, int] = {}
        self.corrections: dict[tuple, int] = {}
        self.quiet = 0
        self.to_plan = False
        self.plans = 0
        # Optimizers whose parameters the step's graphs take (their state is alive through the step), and the
        # bytes of their state the last plan counted.
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.planned_state: dict[tuple, tuple[set[int], int]] = {}  # step key -> (optimizers, state bytes) planned
        self.blocks: dict[tuple[int, int], _Block] = {}  # ParameterOffload modules the steps' graphs ran, by name

    def stop_measuring(self) -> None:
        """Drop a measurement under way or waiting to be read (no collective here): its CPU profiler is stopped.
        Also at the interpreter's exit: a process that ended while one ran (a script of 3 steps, whose last
        step was measured and not yet read) crashed in the profiler's teardown (exit status 139)."""
        for meter in (getattr(self, "meter", None), (getattr(self, "due", None) or (None,))[0],
                      getattr(self, "optimizer_meter", None)):
            if meter is not None:
                meter.discard()
        self.meter, self.due, self.optimizer_meter = None, None, None

    # -- watching ------------------------------------------------------------------------------------------
    def arm(self, dispatcher: GraphDispatcher | None = None) -> None:
        """Watch every participant from now on. A step already under way is partly seen (graphs that ran
        before are missed): its shape is planned with the others, whose larger contexts it never loosens,
        and the next full step is planned again."""
        if dispatcher is not None:
            self.participants.add(dispatcher)
        for d in self.participants:
            d._watch = True
        self.quiet = 0

    def disarm(self) -> None:
        for d in self.participants:
            d._watch = False
        self._reset()
        self.glanced = []

    def glance(self, dispatcher: GraphDispatcher) -> None:
        """An unwatched call of a participant (training, between plans): the order of calls since the last call
        of the step's first graph is compared with the orders planned for when that graph is called again, and
        an order not seen (graphs compiled before, run in another order) starts the watch at this step's start."""
        if dispatcher.forward_only:
            return  # no autograd graph: never in a step's order (a mask or rotary table made under grad mode)
        first = self.latest_key[0][0] if self.latest_key[0] else None
        if dispatcher.name == first and self.glanced:
            order, self.glanced = tuple(self.glanced), []
            if order not in _pieces({key[0] for key in self.shapes}, first):
                log.info("dpcs: a step of an order not planned for (%d calls); watching it", len(order))
                self.arm()
                return
        if len(self.glanced) < MAX_PENDING_CALLS:
            self.glanced.append(dispatcher.name)

    def _reset(self) -> None:
        self.calls, self.pending = [], 0
        self.marks = _compile_marks()
        self.optimizer_key, self.optimizer_seen = None, {}

    def call(self, dispatcher: GraphDispatcher, args: Sequence[Any]) -> Any:
        """Run one watched call, noting it when it starts an autograd graph."""
        if self.due is not None and self.pending == 0:
            self.finish_reading()  # the last step's measurement (CPU), now that it is over
            if not dispatcher._watch:  # it was the last step to watch: this one is only noted
                self.glance(dispatcher)
                return dispatcher._fn(*args)
        if self.pending == 0 and self.optimizer_key is not None:
            self._optimizer_measured()
        if not torch.is_grad_enabled():
            return dispatcher._fn(*args)
        if self.to_plan and self.pending == 0:
            self.plan()  # between steps: at the first forward call after a complete one
            if dispatcher._version != dispatcher.control.version:
                dispatcher._select(args)
        if self.verify_in == 0 and self.pending == 0 and not self.measuring:
            self.verify_in = None
            if self._predict_as_compiled():
                self.measuring = True
                self.meter = _Meter.start(args)
        from torch._subclasses.fake_tensor import is_fake

        parameters: dict[int, int] = {}
        gradients: dict[int, int] = {}
        inputs: dict[int, int] = {}
        held: dict[int, int] = {}
        job = dispatcher.current_job()
        sharing = job.step_sharing if job is not None else None
        outside, bucket_views = _ddp_buckets()
        fsdp = _fsdp_parameters()
        own_gradients = gathered = 0
        offloads = {id(p): (po, m) for po in list(OFFLOADS) for m in po.modules for p in po.params[m]}
        used: dict[tuple[int, int], tuple[ParameterOffload, torch.nn.Module]] = {}
        # Inputs and outputs its plan keeps alive for a recomputation are held by it through its backward too
        # (`GraphStep.held` counts them with that plan), not memory the other calls leave alive then; `kept`:
        # their storages, less those its backward reads anyway (at another position).
        kept_inputs, kept_outputs = _kept_for_recomputation(job, sharing)
        read_inputs = frozenset(sharing.held_inputs) if sharing is not None else frozenset()
        held_inputs = read_inputs | kept_inputs
        kept: set[int] = set()
        read: set[int] = set()
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                continue
            if is_fake(x):
                return dispatcher._fn(*args)  # DDP's graph splitting runs its pieces on fakes first
            storage = x.untyped_storage()
            if isinstance(x, torch.nn.Parameter):
                if id(x) in offloads:  # a block's: counted for the choices of what is offloaded (`_shape`)
                    po, module = offloads[id(x)]
                    used[(id(po), id(module))] = (po, module)
                    continue
                if fsdp is not None and id(x) in fsdp.gathered:  # freed after its block: not the step's
                    gathered += x.numel() * x.element_size()
                    own_gradients += fsdp.gathered[id(x)] if x.requires_grad else 0
                    continue
                if storage.data_ptr() not in parameters and x.requires_grad:
                    own_gradients += storage.nbytes()
                parameters[storage.data_ptr()] = storage.nbytes()
                if x.grad is not None and not bucket_views:  # (views of DDP's buckets are counted with them)
                    gradients[storage.data_ptr()] = x.grad.untyped_storage().nbytes()
                continue
            inputs[storage.data_ptr()] = storage.nbytes()
            if i in held_inputs:
                held[storage.data_ptr()] = storage.nbytes()
                (read if i in read_inputs else kept).add(storage.data_ptr())
        root = dispatcher.root() if dispatcher.root is not None else None
        if root is not None and fsdp is None:
            _count_unseen_parameters(root, args, parameters, offloads, bucket_views, outside)
        # What the earlier calls left that no graph counts while this one runs (not its own inputs: its own).
        # A storage an earlier call keeps for its plan's recomputation that a call before it lists as its own
        # droppable output (the first graph's output the middle graph recomputes from, on the bench's
        # graph-break net) is counted here too: during the step's forward the caller's frame still holds such an
        # output whatever the plans (measured with a plan that saves instead), so with the plan that keeps it the
        # forward is counted twice (over, never under), and the measured shape is the same under both plans.
        forward_others = _alive_elsewhere(self.calls, None, {p for c in self.calls for p in c.held if p not in c.kept}
                                          | set(inputs))
        # The optimizers of this step's parameters: their state is alive through it.
        found = _optimizers_of(parameters, [p for po, m in used.values() for p in po.params[m]])
        if not self.calls and fsdp is None and not offloads:
            device = next((x.device for x in args if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)
            if device is not None:  # on CUDA, what the process holds beside the step's own tensors (counted absolutely)
                elsewhere = _held_elsewhere(device, {**parameters, **gradients, **inputs, **outside}, found)
                if elsewhere:
                    outside[HELD_ELSEWHERE] = elsewhere
        if not self.calls:
            self.optimizers = weakref.WeakSet(found)
        else:
            self.optimizers.update(found)
        out = dispatcher._fn(*args)
        leaves = pytree.tree_leaves(out)
        node = next((t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if node is None:
            dispatcher.forward_only = True  # its calls are left out of the step's order (`glance`)
            return out
        outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        for i in (*sharing.held_outputs, *kept_outputs) if sharing is not None else ():
            if i < len(outputs):
                storage = outputs[i].untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
                (read if i in sharing.held_outputs else kept).add(storage.data_ptr())
        if len(self.calls) >= MAX_PENDING_CALLS:
            log.warning("dpcs: %d graph calls without their backwards; the step recording starts again", len(self.calls))
            self._reset()
            self.partial = True
            if self.meter is not None:
                self.meter.discard()
            self.meter, self.measuring = None, False
        for name, (po, module) in used.items():
            self.blocks[name] = _block(po, module)
        call = _Call(dispatcher, parameters, gradients, inputs, held, outside, dispatcher.bucket, own_gradients,
                     gathered, fsdp, tuple(used), *(frozenset((id(po), id(n)) for po, m in used.values()
                                                          for n in po.neighbours(m, direction)) for direction in (+1, -1)),
                     droppable=_droppable(sharing, args, outputs, held, parameters), forward_others=forward_others,
                     kept=frozenset(kept - read))
        self.calls.append(call)
        self.pending += 1
        if self.meter is not None:
            self.meter.mark(_Meter.FORWARD_END)
        # A pre-hook, not a hook: the engine keeps a node's gradient inputs alive through the node for its hooks,
        # which would hold the graph's incoming gradient for all its backward (a watched step would peak higher).
        def backward_starts(*_: Any) -> None:
            now = _compile_marks()  # collected once after Dynamo compiled, or a compile raised
            collect, self.marks = _marks_changed(self.marks, now), now
            call.backward_starts(self.calls, collect=collect)
            self._backward_starts()

        node.register_prehook(backward_starts)
        return out

    def _predict_as_compiled(self) -> bool:
        """Before a planned step is measured: predict it from the variants that compiled, each graph's problem
        and decisions as its compile made them. A plan made on a first variant that ran uncompiled (an
        Inductor graph's hold-least plan runs eagerly until the step is planned) is solved on that variant's
        problem, without Inductor's fusions; the Inductor compile solves its own and may decide otherwise (on
        HF GPT-2, one 3 MiB value saved instead of recomputed). Measured against the planned figures, that
        difference was counted at the step's turn as eager code's, for good. A compiled step predicted over its
        budget is planned again (from the compiled problems) instead of measured. Returns whether to measure."""
        planned, self.as_planned = self.as_planned, None
        if planned is None or self.predicted is None:
            return True
        graphs, levels = {}, {}
        for name, ref in planned.dispatchers.items():
            dispatcher = ref()
            step_graph = dispatcher.step_graph(credit=self.torch_planned) if dispatcher is not None else None
            if step_graph is None:
                return True  # gone, or no plan to read: measured against the plan's own figures
            g, decisions = step_graph
            graphs[name], levels[name] = g, GraphLevels.of(g.problem, decisions)
        compiled = predicted_levels(planned.shapes, graphs, levels)
        peak = step_peak(planned.shapes, graphs, levels).bytes  # every phase, the optimizer step's too
        if planned.record is not None:
            planned.record.compiled_peak_bytes = peak
            for at in planned.dumped:  # the dumped plan says it too
                _dump_step_record(at[0], planned.record, at)
        # Torch's partitions offered: the step is held to what torch's partitions are, with every call's runtime
        # allowance (`cost.budget.torch_plan_limit`), and checked even as planned (their compiles may differ).
        limit = planned.budget
        if self.torch_planned and limit is not None:
            limit = torch_plan_limit(limit, max((len(s.instances) for s in planned.shapes), default=1) - 1)
        if compiled == self.predicted and not self.torch_planned:
            return True
        log.info("dpcs: the compiled variants predict %s B (outside the turn, at it, at the end), the plan %s B",
                 compiled, self.predicted)
        fitted = planned.budget is not None and (self.predicted_peak <= planned.budget or self.torch_planned)
        self.predicted, self.predicted_peak = compiled, peak
        over = fitted and peak > limit and not planned.after_mismatch
        if self._ranks_agree():  # planning takes collectives: every rank decides alike
            over = any(rank_agreement.every_rank(over))
        if over:
            log.info("dpcs: the compiled variants predict %d B, over the budget of %d B; planned again",
                     peak, limit)
            self.torch_refused = self.torch_refused or self.torch_planned
            self.to_plan = self.replan_as_compiled = True
            self.quiet = 0  # not stable: the plan is due
            return False
        return True

    def _backward_done(self) -> None:
        self.pending -= 1
        if self.pending > 0:
            return
        calls, partial = self.calls, self.partial
        meter, self.meter = self.meter, None
        measuring, self.measuring = self.measuring, False
        if meter is not None:
            meter.mark(_Meter.STEP_END)
        self._reset()
        self.partial = False
        if partial or not calls:
            if measuring:
                self._due(meter, None)  # its profiler stops outside the backward
            return
        shape, refs = self._shape(calls, self.blocks)
        key = (shape.instances, tuple(c.bucket for c in calls))
        self.latest, self.latest_key = key[1], key
        self.optimizer_key, self.optimizer_seen = key, {}  # an optimizer step may follow: measured
        if self.verify_in is not None and self.verify_in > 0:
            self.verify_in -= 1
        if measuring:
            # Read outside the backward (`finish_reading`): at the next call, the optimizer's step, or a measure.
            # The optimizers' state is alive through the step: the prediction counted `predicted_state_bytes` of
            # it; what it holds beyond (made by a first optimizer step since) is planned for anyway (`grown`), so
            # it is left out of the reading, not counted again as memory outside the graphs.
            state = _state_bytes(self.optimizers)
            kept = with_offloaded(shape, _offloaded_now())  # as the blocks are now
            baseline = kept.parameter_bytes + kept.outside_bytes + sum(calls[0].inputs.values()) + state
            self._due(meter, (key, shape, refs, baseline, max(0, state - self.predicted_state_bytes)))
            return
        self._settle(key, shape, refs, None)

    def _backward_starts(self, *_: Any) -> None:
        """A call's backward starts: its end is counted when the backward pass that runs it ends."""
        if self.meter is not None:
            self.meter.mark(_Meter.BACKWARD_START)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _due(self, meter: _Meter | None, step: tuple | None) -> None:
        """A measured step to read (`finish_reading`) at the next call, the optimizer's step (`optimizer_starts`)
        or a measure."""
        self.due = (meter, step)
        _watch_optimizers()

    def optimizer_starts(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's step starts (every optimizer's step pre-hook): the step before it is read, what it holds
        now included, and the optimizer step is measured if it follows a watched step."""
        if _inner(optimizer):
            return
        if self.due is not None:
            self.finish_reading(at_optimizer_step=True)
        if self.optimizer_key is not None and self.optimizer_meter is None:
            # None where it cannot be measured (another profiler runs on CPU): nothing is learnt from this one.
            self.optimizer_meter = _OptimizerMeter.start(optimizer)

    def optimizer_ends(self, optimizer: torch.optim.Optimizer) -> None:
        meter = self.optimizer_meter
        if meter is not None and meter.optimizer() is optimizer:
            self.optimizer_meter = None
            transient, grown = meter.read()
            steady = grown <= max(CORRECTION_MIN_BYTES, int(CORRECTION_MIN_FRACTION * transient))
            self.optimizer_seen[steady] = max(self.optimizer_seen.get(steady, 0), transient)

    def _optimizer_measured(self) -> None:
        """The optimizer steps after the last watched step are over (its next forward call starts): what they
        allocated beyond their start and end is the step's optimizer-step temporaries under the way the model
        state is kept now (`_regime`; other ways are estimated from it, `_optimizer_bytes`). A step that made new
        state (a first step) counts only until a steady one is measured; a steady figure replaces what was known
        when it differs. The step is planned again when it changes. In a distributed job the ranks' figures are
        combined (the largest)."""
        key, seen = self.optimizer_key, self.optimizer_seen
        self.optimizer_key, self.optimizer_seen = None, {}
        if self.optimizer_meter is not None:  # a step that never ended (it raised)
            self.optimizer_meter.discard()
            self.optimizer_meter = None
        steady = True in seen
        value = seen[True] if steady else seen.get(False)
        if self._ranks_agree():
            everyone = [v for v in rank_agreement.every_rank((value, steady)) if v[0] is not None]
            steady = any(s for _, s in everyone)
            value = max((v for v, s in everyone if s == steady), default=None)
        if value is None or key not in self.shapes:
            return
        regime = _regime(self.optimizers, _offloaded_now())
        table = self.transient_measured.setdefault(key, {})
        known, known_steady = table.get(regime, (None, False))
        tolerance = max(CORRECTION_MIN_BYTES, int(CORRECTION_MIN_FRACTION * value))
        if known is not None and (known_steady and not steady or steady == known_steady and abs(value - known) <= tolerance
                                  or self.transient_updates.get(key, 0) > MAX_TRANSIENT_UPDATES):
            return
        table[regime] = (value, steady)
        self.transient_updates[key] = self.transient_updates.get(key, 0) + 1
        shape, refs = self.shapes[key]
        self.shapes[key] = (dataclasses.replace(shape, optimizer_bytes=self._optimizer_bytes(key)), refs)
        log.info("dpcs: the optimizer step after the step allocated %d B beyond its start and end (%s)%s", value,
                 "steady" if steady else "making its state", "; planned again" if not self.to_plan else "")
        self.quiet = 0
        self.to_plan = True

    def _transients(self, key: tuple) -> dict[tuple, int]:
        """A step shape's measured optimizer-step temporaries by `_regime`: the steady ones once there are any
        (a first step's, making its state, says little about a later one's)."""
        table = self.transient_measured.get(key, {})
        steady = any(s for _, s in table.values())
        return {regime: nbytes for regime, (nbytes, s) in table.items() if s or not steady}

    def _optimizer_bytes(self, key: tuple) -> int | None:
        """A step shape's `optimizer_bytes` as the model state is kept now: its optimizer step's temporaries
        (measured, or estimated from other regimes) and what the loop held beyond its plan at its end."""
        transient = estimated_step_transient(self._transients(key), _regime(self.optimizers, _offloaded_now()),
                                             _decoded(self.optimizers, self.blocks))
        return None if transient is None else transient + self.end_measured.get(key, 0)

    def finish_reading(self, at_optimizer_step: bool = False) -> None:
        """Read the measured step (from the training thread, outside a backward: a CPU profiler is stopped
        here), and count what it shows; read at an optimizer's step, what the step holds at its end too. In a
        distributed job every rank reads at the same point of its training loop and the ranks' readings are
        combined (the largest), so every rank decides alike."""
        due, self.due = self.due, None
        if due is None:
            return
        meter, step = due
        reading = meter.read(step[3], at_optimizer_step) if meter is not None and step is not None else None
        if reading is not None:
            reading = tuple(None if r is None else r - step[4] for r in reading)
            reading = self._with_reserved_excess(meter, reading)
        if meter is not None:
            meter.discard()
        if self._ranks_agree():
            readings = [r for r in rank_agreement.every_rank(reading) if r is not None]
            reading = tuple(max((r[i] for r in readings if r[i] is not None), default=None) for i in range(3)) \
                if readings else None
        if step is not None:
            key, shape, refs, _, _ = step
            self._settle(key, shape, refs, reading)

    def _with_reserved_excess(self, meter: _Meter, reading: tuple) -> tuple:
        """On CUDA, a measured step whose caching allocator reserved more than the budget (allocated bytes
        within it, the allocator's share exceeded): the excess counted as memory held outside the graphs through
        the step, so the step is planned again with that much less room (`_correct`)."""
        budgets = [b for d in self.participants if (b := d.current_reserved_budget_bytes) is not None]
        if meter.reserved_peak is None or meter.trace is None or not budgets:
            return reading
        budget = min(budgets)
        # Only what the step itself reserved beyond the budget counts: memory reserved before it (by earlier
        # plans, or the user's code) is the allocator's cache, given back here instead.
        excess = meter.reserved_peak - max(budget, meter.trace.reserved)
        if int(torch.cuda.memory_reserved(meter.device)) > budget:
            torch.cuda.empty_cache()  # cached blocks no tensor uses go back to the device
            log.info("dpcs: the caching allocator held more than the budget of %d B: its unused cache given back "
                     "(now %d B reserved)", budget, torch.cuda.memory_reserved(meter.device))
        if excess <= 0:
            return reading
        log.warning("dpcs: the step reserved %d B on the device, %d B over its budget of %d B (the allocator's "
                    "share of the budget was too small): planned again with that much less", meter.reserved_peak,
                    excess, budget)
        return (reading[0] + excess, reading[1] + excess, reading[2])

    def _settle(self, key: tuple, shape: StepShape, refs: list, measured: tuple[int, int, int | None] | None) -> None:
        """A complete step of `shape`: count what its measurement (if any) shows beyond the plan, then plan it
        if it is new or more demanding than the shape known, or count it towards stopping the watch."""
        shape = dataclasses.replace(
            shape,
            outside_bytes=shape.outside_bytes + self.outside_measured.get(key, 0),
            turn_bytes=shape.turn_bytes + self.turn_measured.get(key, 0),
            optimizer_bytes=self._optimizer_bytes(key),
        )
        corrected = False
        if measured is not None and self.predicted is not None:
            self._correct(key, shape, measured, refs)
            corrected = self.to_plan
        # Known only for the same graphs (a new compile may reuse the names of graphs gone).
        same = key in self.shapes and [r() for r in self.shapes[key][1]] == [r() for r in refs]
        known = self.shapes[key][0] if same else None
        covered = _covering(known, shape) if known is not None else shape
        # Other optimizers than this step's plan counted, or their state made by a first step (or grown) since:
        # planned for.
        planned_ids, planned_bytes = self.planned_state.get(key, (None, 0))
        grown = ({id(o) for o in self.optimizers} != planned_ids
                 or _state_bytes(self.optimizers) > planned_bytes + CORRECTION_MIN_BYTES)
        new = (covered != known or grown) and not corrected
        if self._ranks_agree():
            # Whether a step needs planning is decided by every rank alike (planning takes collectives): a
            # figure read from storages (which inputs an earlier call holds) can differ between ranks.
            new = any(rank_agreement.every_rank(new))
        if corrected:
            return
        if not new:
            self.quiet += 1
            if self.quiet >= STABLE_STEPS:
                log.info("dpcs: step order stable; step watching stops")
                self.disarm()
            return
        self.shapes[key] = (covered, refs)
        self.quiet = 0
        self.to_plan = True

    def _ranks_agree(self) -> bool:
        """In a distributed job whose graphs agree on plans, every rank takes the step recorder's decisions."""
        return rank_agreement.world() is not None and all(d.options.rank_agreement for d in self.participants)

    def _correct(self, key: tuple, shape: StepShape, measured: tuple[int, int, int | None], refs: list) -> None:
        """Count what a measured planned step held beyond its plan, and plan it again (at most twice a shape).

        `measured` and `self.predicted` are (the peak outside the step's turn, at its turn, held when its
        backwards ended; measured only when an optimizer step follows). Beyond the plan outside the turn
        (memory no graph shows: collectives in flight, eager code between graphs) counts as alive throughout
        the step; beyond it at the turn (a loss in eager code) counts at the turn only; beyond it at the end
        (what the training loop holds then: a loss's logits) counts in the optimizer step."""
        assert self.predicted is not None
        predicted_graphs, predicted_turn, predicted_end = self.predicted
        tolerance = max(CORRECTION_MIN_BYTES, int(CORRECTION_MIN_FRACTION * max(self.predicted)))
        if self.fitted_budget is not None and max(measured[0], measured[1]) > self.fitted_budget:
            tolerance = 0  # a plan that fit its budget measured over it: any excess counts, however small
        outside = max(0, measured[0] - predicted_graphs)
        outside = outside if outside > tolerance else 0
        turn = max(0, measured[1] - predicted_turn - outside)  # the turn's prediction counts `outside` too
        turn = turn if turn > tolerance else 0
        end = max(0, measured[2] - predicted_end - outside) if measured[2] is not None else 0
        end = end if end > tolerance and shape.optimizer_bytes is not None else 0
        if not outside and not turn and not end:
            return
        if self.corrections.get(key, 0) >= MAX_CORRECTIONS:
            participants = list(self.participants)
            budget = self.fitted_budget if self.fitted_budget is not None else min(
                (b for d in participants if (b := d.current_budget_bytes) is not None), default=None)
            peak = max(measured[0], measured[1])
            if budget is not None and peak > budget:  # the budget is not held: said as a plan no budget fits is
                _say_infeasible(
                    f"{describe_budget(budget)} is not held by the training step: it measured {format_bytes(peak)} "
                    f"({peak} B) after {MAX_CORRECTIONS} plans counting what it held beyond each, "
                    f"{max(outside, turn, end)} B beyond the last", participants)
            log.warning("dpcs: the step measured %d B beyond its plan again; not planned again", max(outside, turn, end))
            return
        self.outside_measured[key] = self.outside_measured.get(key, 0) + outside
        self.turn_measured[key] = self.turn_measured.get(key, 0) + turn
        self.end_measured[key] = self.end_measured.get(key, 0) + end
        shape = dataclasses.replace(
            shape, outside_bytes=shape.outside_bytes + outside, turn_bytes=shape.turn_bytes + turn,
            optimizer_bytes=None if shape.optimizer_bytes is None else shape.optimizer_bytes + end)
        self.shapes[key] = (shape, refs)
        # Planned again only if what was counted raises the step's predicted peak (a turn below the graphs' peak
        # changes nothing now; later plans of the step count it).
        optimizer_peak = (predicted_end + outside + shape.optimizer_bytes) if shape.optimizer_bytes is not None else 0
        corrected_peak = max(predicted_graphs + outside, predicted_turn + outside + turn, optimizer_peak)
        replan = corrected_peak > self.predicted_peak
        # Torch's partitions measured within the budget are kept: what they held beyond the model is counted
        # (later plans see it) and nothing is compiled again (on HF GPT-2 at compile's own peak they measured
        # 1.1 MB over their compiled prediction, exactly that peak: the same graphs torch.compile runs).
        # (Every rank reads the same step: its readings are combined in `finish_reading`.)
        kept = (replan and self.torch_planned and self.torch_budget is not None
                and max(measured[0], measured[1], optimizer_peak) <= self.torch_budget)
        replan = replan and not kept
        log.info(
            "dpcs: the step measured %d B beyond its plan's %d B outside its turn (counted as memory outside its "
            "graphs), %d B beyond its %d B at its turn (counted as eager code's there) and %d B beyond its %d B "
            "at its end (counted in the optimizer step)%s",
            outside, predicted_graphs, turn, predicted_turn, end, predicted_end,
            "; planned again" if replan else f"; torch's partitions kept, within the budget of {self.torch_budget} B"
            if kept else "",
        )
        if replan:
            if self.torch_planned and outside:  # torch's partitions held more than their compiles read: dpcs plans
                self.torch_refused = True  # from now on (what eager code holds at the turn or the end is not theirs)
            self.corrections[key] = self.corrections.get(key, 0) + 1
            self.quiet = 0
            self.to_plan = True

    @staticmethod
    def _shape(calls: list[_Call], blocks: dict[tuple[int, int], _Block]) -> tuple[StepShape, list[weakref.ref[GraphDispatcher]]]:
        parameters: dict[int, int] = {}
        gradients: dict[int, int] = {}
        held_before: set[int] = set()  # storages an earlier call holds for its backward
        inputs_held_before, held_twice = [], []
        outside: dict[int, int] = {}
        for c in calls:
            parameters.update(c.parameters)
            gradients.update(c.gradients)
            outside.update(c.outside)
            # (What a call keeps only for its plan's recomputation is left out: a plan that saves instead does
            # not hold it, and the model counts it with the plans that do, `GraphStep.held`.)
            inputs_held_before.append(sum(n for p, n in c.inputs.items() if p in held_before))
            held_twice.append(sum(n for p, n in c.held.items() if p in held_before and p in c.inputs and p not in c.kept))
            held_before.update(p for p in c.held if p not in c.kept)
        for key in [k for k in outside if k in parameters]:
            del outside[key]  # a parameter one call does not take and another does (its gradient counted with it)
        fsdp = next((c.fsdp for c in reversed(calls) if c.fsdp is not None), None)
        offload = _offload_blocks(calls, blocks)
        shape = StepShape(
            instances=tuple(c.dispatcher.name for c in calls),
            # FSDP2: every rank keeps its shards; each block's gathered parameters live for its call only.
            parameter_bytes=sum(parameters.values()) + (fsdp.shard_bytes if fsdp else 0),
            outside_bytes=sum(gradients.values()) + sum(outside.values()) + (fsdp.gradient_bytes if fsdp else 0),
            accumulated_bytes=sum(gradients.values()) + (fsdp.gradient_bytes if fsdp else 0),
            bucket_bytes=sum(outside.values()),
            inputs_held_before=tuple(inputs_held_before),
            held_twice=tuple(held_twice),
            call_parameter_bytes=tuple(sum(c.parameters.values()) for c in calls),
            call_gradient_bytes=tuple(c.own_gradients for c in calls),
            call_backward_freed=tuple(c.freed for c in calls),
            call_keep_saved=tuple(c.keep_saved for c in calls),
            call_forward_others=tuple(c.forward_others for c in calls),
            call_backward_others=tuple(c.backward_others for c in calls),
            # FSDP2 works ahead of the block that runs: the next block's gather in its forward; in its backward,
            # the next gather, the reduce-scatter input of the gradients just made and the one before it, not
            # yet waited for (measured on gloo: one to three blocks' worth, by the ranks' timing).
            forward_extra_bytes=max((c.gathered for c in calls), default=0) if fsdp else 0,
            backward_extra_bytes=FSDP_BLOCKS_IN_FLIGHT * max((c.gathered for c in calls), default=0) if fsdp else 0,
        )
        if offload is not None:  # every block counted as kept on the device; `with_offloaded` counts a choice
            shape = dataclasses.replace(
                shape,
                parameter_bytes=shape.parameter_bytes + sum(offload.parameter_bytes),
                outside_bytes=shape.outside_bytes + sum(offload.held_gradient_bytes),
                accumulated_bytes=shape.accumulated_bytes + sum(offload.held_gradient_bytes),
                call_parameter_bytes=tuple(n + sum(offload.parameter_bytes[b] for b in offload.uses[i])
                                           for i, n in enumerate(shape.call_parameter_bytes)),
                call_gradient_bytes=tuple(n + sum(offload.gradient_bytes[b] for b in offload.uses[i])
                                          for i, n in enumerate(shape.call_gradient_bytes)),
                offload_blocks=offload,
            )
        return shape, [weakref.ref(c.dispatcher) for c in calls]

    def first_graph_context(self, example_inputs: Sequence[Any]) -> StepContext | None:
        """For the step's first graph, compiled before any step of it was seen: what the rest of the step holds
        around it from the first step on, which no graph shows, so that its first plan already fits: the state
        its optimizers hold once they have stepped (torch's optimizers' first-step state anticipated,
        `cost/optimizer_state.py`), and on CUDA what the process holds beyond the graph's inputs (other
        models, and the cuBLAS workspaces each thread makes at its first matrix product, made here first:
        `_make_cuda_workspaces`). None when that is nothing, or the inputs are fake (DDP's graph splitting)."""
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
        around = state + elsewhere
        if around == 0:
            return None
        log.info("dpcs: the step's first graph is planned with %d B held around it (optimizer state %d B, on the "
                 "device beside its inputs %d B)", around, state, elsewhere)
        return StepContext(forward_bytes=around, backward_bytes=around)

    def provisional_context(self, example_inputs: Sequence[Any]) -> StepContext | None:
        """For a graph compiled in the middle of a step (its order not known yet): what the graphs that ran
        before it in this step hold, as their plans say (None at the start of a step, or if unknown)."""
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
        return StepContext(forward_bytes=common + held, backward_bytes=common + held, first_step=True)

    # -- planning ------------------------------------------------------------------------------------------
    def plan(self) -> StepRecord | None:
        """Plan the step shapes seen with the latest one (those sharing a graph with it, at its sizes) for one
        budget, and switch the graphs whose plans change."""
        self._planned: dict[str, GraphDispatcher] = {}
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
        after_mismatch, self.replan_as_compiled = self.replan_as_compiled, False
        candidates: list[tuple[tuple, StepShape, list[GraphDispatcher]]] = []
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
                out = set(chosen_blocks(self.blocks, shapes)[:chosen["offloaded_blocks"]])
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
    def _decide(shapes: list[StepShape], dispatchers: dict[str, GraphDispatcher],
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
            shapes=len(shapes),
            contexts={k: (c.to_json() if c else None) for k, c in plan.contexts.items()},
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
        message = (
            f"{describe_budget(budget or 0)} cannot be met for the training step of {len(record.calls)} graph calls "
            f"({', '.join(_counted(record.calls))}): the smallest step peak dpcs can reach is "
            f"{format_bytes(peak.bytes)} ({peak.bytes} B), {_where(peak.phase, peak.graph, peak_node)}; "
            f"{holds_most} holds the most for its backward while the others run ({format_bytes(held)})"
            f"{_split(record)}"
        )
        return record, message, shapes


Dumped = tuple[Path, int, str]  # a step plan's line in a STEPS_FILE: the file, the line's index, its text


@dataclasses.dataclass(frozen=True)
class _AsPlanned:
    """What a step plan's prediction was made from: the shapes as planned, the graphs (by name; weakly), and
    the budget a fitting plan holds (None for one that does not fit)."""

    shapes: list[StepShape]
    dispatchers: dict[str, weakref.ref[GraphDispatcher]]
    budget: int | None
    after_mismatch: bool = False  # planned again because compiled variants went over: not again for this
    record: StepRecord | None = None  # the step plan's record (None: one graph's own plan)
    dumped: list[Dumped] = dataclasses.field(default_factory=list)  # its lines in STEPS_FILEs


@contextlib.contextmanager
def _steps_file_lock(path: Path) -> Iterator[None]:
    """Hold a lock on `path` for a read-then-write (ranks of one job may share a dump folder): an advisory
    lock on a hidden file beside it, where the platform has fcntl."""
    try:
        import fcntl
    except ImportError:  # not POSIX: unlocked
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _dump_step_record(path: Path, record: StepRecord, at: Dumped | None = None) -> Dumped | None:
    """Write `record` to the STEPS_FILE `path`: appended (`at` None; on a line of its own even after a line a
    killed process left unended), or in place of the line `at` says it wrote before, if that line is still
    its text (the file rewritten whole through a temporary beside it: a reader never sees half a file).
    Returns where the line is; None if it could not be written: a dump is a report, and training goes on
    (logged)."""
    text = json.dumps(record.to_json())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _steps_file_lock(path):
            data = path.read_text() if path.is_file() else ""
            if at is None:
                lead = "\n" if data and not data.endswith("\n") else ""
                with open(path, "a") as f:
                    f.write(lead + text + "\n")
                return path, len((data + lead).splitlines()), text
            lines = data.splitlines()
            line, written = at[1], at[2]
            if line >= len(lines) or lines[line] != written:
                log.warning("dpcs: the step plan's line in %s is gone; not updated", path)
                return None
            lines[line] = text
            write_text_atomic(path, "\n".join(lines) + "\n")
            return path, line, text
    except OSError as error:
        log.warning("dpcs: the step plan could not be written to %s: %s", path, error)
        return None


class _Meter:
    """The absolute peak of one step, from its first forward call to the end of its last backward, in two
    parts: at the step's turn (after its last forward call returned, before its first backward started: eager
    code there, such as a loss) and elsewhere.

    CUDA: the caching allocator's history between marks (`measure.CudaMemoryTrace`: everything allocated
    counts, optimizer state and memory outside the graphs included; the allocator's peak statistics, the
    user's, are not touched), and the most it reserved over the step (`reserved_peak`). CPU: the profiler's
    memory events, with the marks recorded in its timeline, above `baseline`: what the step's own tensors hold
    when it starts, counted from its calls (parameters, gradients already there, DDP's buckets, FSDP2's
    shards, the first call's inputs). Memory allocated before the step for anything else (optimizer state) is
    not seen on CPU. The profiler is stopped later, outside the backward (`read`): one stopped inside a
    backward hook stays on for its thread. No CPU step is measured while another profiler runs.
    """

    FORWARD_END, BACKWARD_START, STEP_END = "dpcs::forward_end", "dpcs::backward_start", "dpcs::step_end"

    def __init__(self, device: torch.device, profile: CpuMemoryProfile | None = None,
                 trace: CudaMemoryTrace | None = None) -> None:
        self.device, self.profile, self.trace = device, profile, trace
        self.backward_started = False
        self.reserved_peak: int | None = None  # CUDA, once read: the most reserved over the step

    @classmethod
    def start(cls, args: Sequence[Any]) -> _Meter | None:
        device = next((x.device for x in args if isinstance(x, torch.Tensor)), torch.device("cpu"))
        if device.type == "cuda":
            return cls(device, trace=CudaMemoryTrace(device).start())
        if device.type == "cpu" and not CpuMemoryProfile.busy():
            return cls(device, CpuMemoryProfile().start())
        return None

    def mark(self, name: str) -> None:
        if name == self.BACKWARD_START:
            if self.backward_started:
                return
            self.backward_started = True
        if self.profile is not None:
            CpuMemoryProfile.mark(name)
        elif self.trace is not None:
            self.trace.mark(name)

    def discard(self) -> None:
        """Stop measuring (a CPU profiler is stopped; call outside a backward)."""
        if self.profile is not None:
            self.profile.stop()
        elif self.trace is not None:
            self.trace.stop()

    def read(self, baseline: int, at_end: bool = False) -> tuple[int, int, int | None] | None:
        """(the step's absolute peak outside its turn, at its turn, and, `at_end`, what is allocated now: the
        step ended, an optimizer step starts), outside the backward (a CPU profiler is stopped here); None if it
        was not measured to its end."""
        if self.profile is not None:
            ends, starts, done = (self.profile.mark_times(n) for n in (self.FORWARD_END, self.BACKWARD_START, self.STEP_END))
            if not (ends and starts and done) or ends[0] > starts[0]:
                return None
            turn_start = max(t for t in ends if t <= starts[0])
            before, turn, after, _ = self.profile.window_peaks([turn_start, starts[0], done[0]])
            return baseline + max(before, after), baseline + turn, baseline + self.profile.level() if at_end else None
        windows = self.trace.windows() if self.trace is not None else None
        if windows is None:
            return None
        closed = [w.closed_by for w in windows]
        if self.STEP_END not in closed or self.BACKWARD_START not in closed:
            return None
        turn = closed.index(self.BACKWARD_START)
        if windows[turn].opened_by != self.FORWARD_END:
            return None
        last = closed.index(self.STEP_END)
        self.reserved_peak = max(w.reserved_peak for w in windows[: last + 1])
        others = [w.allocated_peak for i, w in enumerate(windows[: last + 1]) if i != turn]
        if at_end:
            torch.cuda.synchronize(self.device)
        return max(others), windows[turn].allocated_peak, int(torch.cuda.memory_allocated(self.device)) if at_end else None


class _OptimizerMeter:
    """What one optimizer step allocates beyond what it starts and ends with: its temporaries (a first step's
    new state, alive at its end, is not among them). CUDA: the caching allocator's history over it
    (`measure.CudaMemoryTrace`); CPU: the profiler's memory events."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, start: int,
                 profile: CpuMemoryProfile | None, trace: CudaMemoryTrace | None = None) -> None:
        self.optimizer, self.device, self.start_bytes, self.profile = weakref.ref(optimizer), device, start, profile
        self.trace = trace

    @classmethod
    def start(cls, optimizer: torch.optim.Optimizer) -> _OptimizerMeter | None:
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        device = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
        if device.type == "cuda":
            trace = CudaMemoryTrace(device).start()
            return cls(optimizer, device, trace.allocated, None, trace)
        if CpuMemoryProfile.busy():
            return None
        return cls(optimizer, device, 0, CpuMemoryProfile().start())

    def read(self) -> tuple[int, int]:
        """(bytes allocated at its peak beyond both its start and its end, bytes it left allocated beyond its start)."""
        if self.profile is not None:
            peak, end = self.profile.peak_increase_bytes(), self.profile.level()
        else:
            torch.cuda.synchronize(self.device)
            windows = self.trace.windows() if self.trace is not None else None
            end = int(torch.cuda.memory_allocated(self.device)) - self.start_bytes
            peak = windows[0].allocated_peak - self.start_bytes if windows else max(0, end)
        return max(0, peak - max(0, end)), max(0, end)

    def discard(self) -> None:
        if self.profile is not None:
            self.profile.stop()
        elif self.trace is not None:
            self.trace.stop()


@dataclasses.dataclass(frozen=True)
class _Fsdp:
    """FSDP2's parameters as the step sees them: the gathered (unsharded) parameters by id, with the bytes of
    their shard (what their gradient leaves after its reduce-scatter), every shard's bytes (kept all step),
    and the sharded gradients already there (earlier micro-batches)."""

    gathered: dict[int, int]
    shard_bytes: int
    gradient_bytes: int


def _fsdp_parameters() -> _Fsdp | None:
    """FSDP2's states (`fully_shard`) in this process, read from torch's composable-state registry; None
    without any."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # a torch without FSDP2
        return None
    states = {id(st): st for ref in list(_module_state_mapping.values()) if isinstance(st := ref(), FSDPState)}
    if not states:
        return None
    gathered: dict[int, int] = {}
    shards = gradients = 0
    for state in states.values():
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                shard = fsdp_param.sharded_param
                local = shard._local_tensor if hasattr(shard, "_local_tensor") else shard
                nbytes = local.numel() * local.element_size()
                shards += nbytes
                if shard.grad is not None:
                    grad = shard.grad._local_tensor if hasattr(shard.grad, "_local_tensor") else shard.grad
                    gradients += grad.numel() * grad.element_size()
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    gathered[id(unsharded)] = nbytes
    return _Fsdp(gathered, shards, gradients)


def _ddp_buckets() -> tuple[dict[int, int], bool]:
    """Inside a DistributedDataParallel forward: its gradient buckets ({id: bytes}; one flat copy of every
    gradient, allocated when DDP was made and alive throughout), and whether `.grad`s are views of them."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return {}, False
    nbytes = sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)
    return {id(ddp): nbytes}, bool(getattr(ddp, "gradient_as_bucket_view", False))


def _kept_for_recomputation(job: Any, sharing: StepSharing | None) -> tuple[frozenset[int], frozenset[int]]:
    """The positions of a call's inputs and of its outputs that its backward does not read but that its plan
    keeps alive for a recomputation (`StepSharing.freeable`'s readers, by name: a stand-in's step view names
    its candidates as the stand-in does)."""
    if job is None or sharing is None or job.problem is None or not any(f.readers for f in sharing.freeable):
        return frozenset(), frozenset()
    recomputed = recomputed_names(job.problem, job.plan.decisions)
    kept = [f for f in sharing.freeable if not recomputed.isdisjoint(f.readers)]
    return frozenset(i for f in kept for i in f.inputs), frozenset(i for f in kept for i in f.outputs)


def _droppable(sharing: StepSharing | None, args: Sequence[Any], outputs: Sequence[torch.Tensor],
               held: dict[int, int], parameters: dict[int, int]) -> tuple[tuple[StorageWeakRef, Freeable], ...]:
    """Weak references to the storages of a call's droppable buffers (`StepSharing.freeable`): one of its
    tensors at the positions that point into each. Those a backward or a parameter holds stay alive anyway and
    are left out."""
    found = []
    for f in sharing.freeable if sharing is not None else ():
        tensors = [args[i] for i in f.inputs if i < len(args)] + [outputs[i] for i in f.outputs if i < len(outputs)]
        t = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in held and storage.data_ptr() not in parameters and storage.nbytes() > 0:
            found.append((StorageWeakRef(storage), storage.data_ptr(), f))
    return tuple(found)


def _compile_marks() -> tuple[Any, int, int]:
    """What tells that a compile may have left reference cycles holding a graph's output since it was read:
    the frames Dynamo set out to compile (its own counter, and the counter itself: clearing Dynamo's counters
    makes another), and the dpcs compiles that raised (`report.compiles_raised`: a re-plan, a failed variant).
    A full garbage collection takes 0.4-0.8 s in a 12-layer Hugging Face GPT-2 process, and a variant compiled
    between steps without either left none (measured on benchmarks/compile_time.py: 51.5 MB of outputs alive
    before and after it, the loss graph's logits its backward reads), so a step that only compiled variants
    is read without one (`_marks_changed`)."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return frames, frames["total"], compiles_raised()


def _marks_changed(before: tuple[Any, int, int], now: tuple[Any, int, int]) -> bool:
    return before[0] is not now[0] or before[1:] != now[1:]


def _alive_elsewhere(calls: Sequence[_Call], this: _Call | None, counted: set[int], *, outputs_only: bool = False) -> int:
    """Bytes of the droppable buffers of `calls` (other than `this`) still alive, each storage once, those in
    `counted` (held by a graph, or the running call's own) left out; with `outputs_only`, only graph outputs
    (what a garbage collection could free that the step counts as freed: a user's batch stays alive anyway)."""
    seen, total = set(counted), 0
    for c in calls:
        if c is this:
            continue
        for ref, ptr, f in c.droppable:
            if ptr not in seen and not ref.expired() and (f.outputs or not outputs_only):
                seen.add(ptr)
                total += f.nbytes
    return total


def _pieces(orders: set[tuple[str, ...]], first: str) -> set[tuple[str, ...]]:
    """The planned orders of calls cut before each call of `first`: what an unwatched step shows between two
    calls of that graph (a graph called once per layer starts many pieces of one step)."""
    pieces = set()
    for order in orders:
        start = 0
        for i, name in enumerate(order):
            if name == first and i > start:
                pieces.add(order[start:i])
                start = i
        pieces.add(order[start:])
    return pieces


def _offload_blocks(calls: Sequence[_Call], blocks: dict[tuple[int, int], _Block]) -> OffloadBlocks | None:
    """The ParameterOffload blocks the calls take, and those prefetched beside them, as a step shape counts
    them (None without any)."""
    names = list(dict.fromkeys(name for c in calls for name in (*c.blocks, *c.ahead, *c.behind) if name in blocks))
    if not names:
        return None
    index = {name: i for i, name in enumerate(names)}

    def indices(group) -> frozenset[int]:
        return frozenset(index[name] for name in group if name in index)

    return OffloadBlocks(
        names=tuple(names),
        parameter_bytes=tuple(blocks[n].parameter_bytes for n in names),
        gradient_bytes=tuple(blocks[n].gradient_bytes for n in names),
        held_gradient_bytes=tuple(blocks[n].held_gradient_bytes for n in names),
        uses=tuple(indices(c.blocks) for c in calls),
        ahead=tuple(indices(c.ahead) for c in calls),
        behind=tuple(indices(c.behind) for c in calls),
    )


def _covering(a: StepShape, b: StepShape) -> StepShape:
    """One shape for two steps of the same calls (micro-batches with and without earlier gradients): each
    figure at its more demanding value, so a plan for it holds for both."""
    def most(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(map(max, x, y)) if x and y else x or y

    def least(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(map(min, x, y)) if x and y else ()

    return dataclasses.replace(
        a,
        parameter_bytes=max(a.parameter_bytes, b.parameter_bytes),
        outside_bytes=max(a.outside_bytes, b.outside_bytes),
        # what is held at the end (outside less what the new gradients are added into) at its larger value
        accumulated_bytes=max(a.outside_bytes, b.outside_bytes) - max(a.outside_bytes - a.accumulated_bytes,
                                                                      b.outside_bytes - b.accumulated_bytes),
        bucket_bytes=max(a.bucket_bytes, b.bucket_bytes),
        optimizer_bytes=max((x for x in (a.optimizer_bytes, b.optimizer_bytes) if x is not None), default=None),
        inputs_held_before=least(a.inputs_held_before, b.inputs_held_before),
        held_twice=least(a.held_twice, b.held_twice),
        call_parameter_bytes=least(a.call_parameter_bytes, b.call_parameter_bytes),
        call_gradient_bytes=most(a.call_gradient_bytes, b.call_gradient_bytes),
        forward_extra_bytes=max(a.forward_extra_bytes, b.forward_extra_bytes),
        backward_extra_bytes=max(a.backward_extra_bytes, b.backward_extra_bytes),
        call_forward_extra_bytes=most(a.call_forward_extra_bytes, b.call_forward_extra_bytes),
        call_backward_extra_bytes=most(a.call_backward_extra_bytes, b.call_backward_extra_bytes),
        # per call the step that freed less before its backward, with what that needs kept saved (a plan that
        # recomputes from an input keeps it alive: what is freed is seen only under plans that do not)
        **_least_freed(a, b),
        call_forward_others=most(a.call_forward_others, b.call_forward_others),
        call_backward_others=most(a.call_backward_others, b.call_backward_others),
        turn_bytes=max(a.turn_bytes, b.turn_bytes),
        offload_blocks=(dataclasses.replace(b.offload_blocks, held_gradient_bytes=most(
            a.offload_blocks.held_gradient_bytes, b.offload_blocks.held_gradient_bytes))
            if a.offload_blocks and b.offload_blocks and a.offload_blocks.names == b.offload_blocks.names
            else b.offload_blocks),
    )


def _least_freed(a: StepShape, b: StepShape) -> dict[str, tuple]:
    if not (a.call_backward_freed and b.call_backward_freed):
        return {"call_backward_freed": (), "call_keep_saved": ()}
    keep_a = a.call_keep_saved or (frozenset(),) * len(a.instances)
    keep_b = b.call_keep_saved or (frozenset(),) * len(b.instances)
    pairs = [(fa, ka) if fa <= fb else (fb, kb)
             for fa, fb, ka, kb in zip(a.call_backward_freed, b.call_backward_freed, keep_a, keep_b)]
    return {"call_backward_freed": tuple(f for f, _ in pairs), "call_keep_saved": tuple(k for _, k in pairs)}


def _node_name(dispatcher: GraphDispatcher, step: int) -> str | None:
    """The schedule node at `step` of the dispatcher's current plan (the plan's own problem, no boundary step)."""
    job = dispatcher.current_job()
    names = job.step_node_names if job is not None else ()
    return names[step] if 0 <= step < len(names) else None


def _where(phase: str, graph: str, node: str | None) -> str:
    if phase == OPTIMIZER:
        return (f"in the optimizer step after the backward of {graph} (its temporaries, and what the training "
                "loop holds then, included)")
    if phase == TURN:
        return f"at the step's turn, after the forward of {graph} (eager code there, such as a loss, included)"
    return f"in the {phase} of {graph} at {node}"


def _counted(calls: Sequence[str]) -> list[str]:
    """Graph names with their call counts, in first-call order."""
    counts: dict[str, int] = {}
    for c in calls:
        counts[c] = counts.get(c, 0) + 1
    return [f"{name} x{n}" if n > 1 else name for name, n in counts.items()]


def _say_infeasible(message: str, dispatchers: Iterable[GraphDispatcher]) -> None:
    """on_infeasible's verdict on a step's plan (or on a graph's own, left to the step): the error if any of its
    graphs asks for one, else a warning (from the step planner, called in a graph's first call of the step)."""
    if any(d.options.on_infeasible == "error" for d in dispatchers):
        raise BudgetInfeasibleError(f"{message}; raise the budget, or pass on_infeasible='best' to compile that plan")
    warnings.warn(f"{message}; compiling that plan (on_infeasible='best')", category=DpcsWarning, stacklevel=5)


def warn_verdicts_never_given() -> list[str]:
    """At exit: the budget verdicts graphs' compiles left to a step that never came (`GraphJob.defers_infeasible`:
    a script that ran one step, or stopped before its second). That step may have gone over the budget, unless
    it dropped the graphs' outputs before their backward; nothing said so. Warned, not raised (the steps ran);
    the messages, for tests."""
    left = [r.infeasible_deferred for r in compile_records() if r.infeasible_deferred]
    for message in left:
        warnings.warn(f"{message}, unless the step dropped the graph's outputs before its backward; the verdict waited "
                      "for the step's plan at the second step, which never ran", category=DpcsWarning, stacklevel=1)
    return left


STEPS = StepRecorder()
_ON_CLEAR.append(STEPS.reset)
atexit.register(STEPS.stop_measuring)
atexit.register(warn_verdicts_never_given)
BEFORE_PROFILING.append(STEPS.finish_reading)


def _count_unseen_parameters(root: torch.nn.Module, args: Sequence[Any], parameters: dict[int, int],
                             offloads: dict, bucket_views: bool, outside: dict[int, int]) -> None:
    """Add to `outside` (by storage) the parameters of the compiled module on the call's device that this call
    does not take, and their gradients: alive through the step whoever reads them. A graph break in a layer
    leaves the embedding to eager code (Hugging Face models), which no graph counted: the step went over its
    budget by the embedding's bytes. (A parameter a later call takes is counted once, with it: `_shape`.)"""
    device = next((x.device for x in args if isinstance(x, torch.Tensor)), None)
    for p in root.parameters():
        if p.device != device or id(p) in offloads:
            continue
        storage = p.untyped_storage()
        if storage.data_ptr() in parameters or not storage.nbytes():
            continue
        gradient = p.grad.untyped_storage().nbytes() if p.grad is not None and not bucket_views else 0
        outside[storage.data_ptr()] = storage.nbytes() + gradient  # by the parameter, as `gradients` is


def _optimizers_of(parameters: dict[int, int], offloaded: Sequence[torch.Tensor] = ()) -> list[torch.optim.Optimizer]:
    """The optimizers (CompressedOptimizers, torch optimizers seen stepping, and those that have not stepped yet,
    found once per compile among the live objects) that step some of these parameters (by storage), or of these
    ParameterOffload parameters (by identity)."""
    _watch_optimizers()
    _find_optimizers()
    found = []
    ids = {id(p) for p in offloaded}
    for optimizer in [*INSTANCES, *_STEPPED]:
        if any(id(p) in ids or (p.untyped_storage().nbytes() and p.untyped_storage().data_ptr() in parameters)
               for g in optimizer.param_groups for p in g["params"]):
            found.append(optimizer)
    return found


def _block(po: ParameterOffload, module: torch.nn.Module) -> _Block:
    params = po.params[module]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return _Block(
        weakref.ref(po), weakref.ref(module), nbytes, sum(p.numel() for p in params),
        sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        sum(p.numel() * p.element_size() for p in params if p.grad is not None or po.has_gradient(p)),
        po.auto,
    )


HELD_ELSEWHERE = -1  # the key in a call's `outside` of what a CUDA process holds beside the step's own tensors


def _held_elsewhere(device: torch.device, counted: dict[int, int], optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """What the process has allocated on the CUDA `device` beyond the storages `counted` and the optimizers'
    state there now: other models, cuBLAS's workspaces, a data loader's batches."""
    state = sum(state_now_bytes(o, "cuda") for o in optimizers if not isinstance(o, CompressedOptimizer))
    return max(0, int(torch.cuda.memory_allocated(device)) - sum(counted.values()) - state)


def _make_cuda_workspaces(device: torch.device) -> None:
    """Run a matrix product forward and backward on `device`, so that the cuBLAS (and cuBLASLt) workspaces of
    this thread and of the autograd engine's thread for the device exist: each thread's first product
    allocates them (about 33 MiB each on an H200, torch 2.11) and keeps them, and the first plan counts them."""
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            torch.nn.functional.linear(x, w, w[0]).sum().backward()
    torch.cuda.synchronize(device)


def _state_bytes(optimizers: Any) -> int:
    """Bytes of the optimizers' state on the device once each has stepped: as it is now, with what a torch
    optimizer's first step will make anticipated (`cost/optimizer_state.py`). A wrapper that shares another's
    state (accelerate's AcceleratedOptimizer, Lightning's) is counted once, through the optimizer it wraps."""
    return sum(_one_state_bytes(optimizer) for optimizer in _distinct(optimizers))


def _distinct(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The optimizers with one per state: of a wrapper and the optimizer it wraps (sharing its state), the one
    it wraps."""
    by_state: dict[int, torch.optim.Optimizer] = {}
    for optimizer in list(optimizers):
        key = id(optimizer.state)
        if key not in by_state or _wraps(by_state[key]):
            by_state[key] = optimizer
    return list(by_state.values())


def _wraps(optimizer: Any) -> bool:
    """Whether `optimizer` wraps another optimizer (and shares its state): `optimizer.optimizer` is one."""
    return isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)


def _one_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if callable(getattr(optimizer, "state_bytes", None)):  # a CompressedOptimizer counts its own
        return optimizer_state_bytes(optimizer)
    anticipated, known = anticipated_state_bytes(optimizer)
    if not known and not optimizer.state and id(optimizer) not in _UNKNOWN_SAID:
        _UNKNOWN_SAID.add(id(optimizer))
        log.warning("dpcs: the state %s makes at its first step cannot be anticipated (not one of torch's "
                    "optimizers): the step is planned for it once it exists, and may run over its budget until "
                    "then", type(optimizer).__name__)
    return anticipated


_UNKNOWN_SAID: set[int] = set()


# torch optimizers seen stepping, or found before their first step (`_find_optimizers`); CompressedOptimizers
# register themselves when made.
_STEPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_FOUND_AT: list[int] = [-1]  # the compile count when the live objects were last searched for optimizers


def _find_optimizers() -> None:
    """Add the live torch optimizers to `_STEPPED`, once per compile: an optimizer made before the first step
    has not stepped, and its state, made at its first step, is planned for from the first plan on."""
    count = compile_count()
    if _FOUND_AT[0] == count:
        return
    _FOUND_AT[0] = count
    for obj in get_objects():
        kind = type(obj)  # (isinstance would look through a dead weak proxy and raise)
        if (issubclass(kind, torch.optim.Optimizer) and not issubclass(kind, CompressedOptimizer) and not _inner(obj)
                and not _wraps(obj)):  # a wrapper's state is the optimizer's it wraps, found on its own
            _STEPPED.add(obj)
_WATCHING: list[Any] = []


def _parameter_ids(blocks: dict[tuple[int, int], _Block], names) -> frozenset[int]:
    """The ids of the parameters of the named ParameterOffload blocks (those still alive)."""
    ids = set()
    for name in names:
        block = blocks.get(name)
        po, module = (block.offload(), block.module()) if block is not None else (None, None)
        if po is not None and module is not None:
            ids.update(id(p) for p in po.params[module])
    return frozenset(ids)


def _regime(optimizers: Any, offloaded: Any) -> tuple:
    """How the model state is kept, as an optimizer step's temporaries depend on it: the lever of the "auto"
    CompressedOptimizers (None without one; they share it) and the ParameterOffload blocks offloaded."""
    lever = next((o.lever() for o in list(optimizers) if isinstance(o, CompressedOptimizer) and o.auto), None)
    return lever, frozenset(offloaded)


def _decoded(optimizers: Any, blocks: dict[tuple[int, int], _Block]):
    """A regime's (`_regime`) full-precision chunk bytes, decoded at once by the "auto" CompressedOptimizers'
    steps (`cost.model_state.step_transient_bytes`)."""
    auto = [o for o in list(optimizers) if isinstance(o, CompressedOptimizer) and o.auto]

    def decoded(regime: tuple) -> int:
        lever, offloaded = regime
        if lever is None:
            return 0
        ids = _parameter_ids(blocks, offloaded)
        return sum(step_transient_bytes(o.state_shape(ids), lever) for o in auto)

    return decoded


def _inner(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is the one a CompressedOptimizer wraps (stepped by it, chunk by chunk)."""
    return any(optimizer is c.inner for c in INSTANCES)


def _watch_optimizers() -> None:
    if _WATCHING:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def starts(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        STEPS.optimizer_starts(optimizer)

    def stepped(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not isinstance(optimizer, CompressedOptimizer) and not _inner(optimizer):
            _STEPPED.add(optimizer)
        STEPS.optimizer_ends(optimizer)

    _WATCHING.append(register_optimizer_step_pre_hook(starts))
    _WATCHING.append(register_optimizer_step_post_hook(stepped))


def _offers_torch(dispatchers) -> bool:
    """Whether the step planner offers torch's own partitions (`plan_step`'s `torch_limit`): not where a graph
    would not keep its own anyway (`keep_torch_plan=False`, or a plan in bf16, fp16 or fp8:
    `memory_plan.torch_plan_refusal`). Offered only where the step fits by the model with plans saving
    everything or with each graph's own partition (`cost.step_model._torch_offer`). Offered up to 6% over it
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


def _offloaded_now() -> set[tuple[int, int]]:
    """The ParameterOffload blocks offloaded now, by name (id of the offload, id of the module)."""
    return {(id(po), id(m)) for po in list(OFFLOADS) for m in po.offloaded_modules()}


def chosen_blocks(blocks: dict[tuple[int, int], _Block], shapes: Sequence[StepShape]) -> list[tuple[int, int]]:
    """The blocks the planner chooses about (`ParameterOffload(auto=True)`) in the order it offloads them: the
    largest first (the fewest transfers for the bytes), then in the order the steps take them. The same on
    every rank of a job running the same model."""
    names = list(dict.fromkeys(n for s in shapes if s.offload_blocks for n in s.offload_blocks.names))
    chosen = [n for n in names if n in blocks and blocks[n].chosen]
    return sorted(chosen, key=lambda n: -blocks[n].parameter_bytes)


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
    candidates = chosen_blocks(blocks, shapes)
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
        rates = StateRates(encode, decode, link_bytes_per_second, timed.host_step_seconds if timed else 0.0)
    offloadable = len(candidates) if link_bytes_per_second is not None else 0
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
        moved = sum(offload_seconds(blocks[n].parameter_bytes, blocks[n].gradient_bytes,
                                    blocks[n].parameter_elements, rates) for n in candidates[:k])
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
        "bytes": state_of[choice.lever], "seconds": choice.state_seconds,
        "activation_seconds": choice.step.activation_seconds,
        "options": [[_describe(o, len(candidates)), nbytes, seconds] for o, nbytes, seconds in options],
    }


def _describe(option: tuple, candidates: int) -> str:
    lever, k = option
    parts = [lever.describe()] if lever is not None else []
    if candidates:
        parts.append(f"{k} of {candidates} blocks offloaded")
    return ", ".join(parts)


def _split(record: StepRecord) -> str:
    """The predicted peak's parts, for a message."""
    parts = record.split()
    lever = record.optimizer_state or {}
    kept = f" kept {lever['format']}{' in host memory' if lever.get('on_host') else ''}" if lever.get("chosen") else ""
    buckets = parts["buckets"]
    return (f"; of it: parameters {format_bytes(parts['parameters'])}, optimizer state{kept} "
            f"{format_bytes(parts['optimizer_state'])}, "
            + (f"DistributedDataParallel's gradient buckets {format_bytes(buckets)}, " if buckets else "")
            + f"other memory alive through the step {format_bytes(parts['outside_graphs'])}, gradients "
            f"{format_bytes(parts['gradients'])}, activations {format_bytes(parts['activations'])}"
            + (f", the optimizer step's temporaries {format_bytes(parts['optimizer_step'])}"
               if parts["optimizer_step"] else ""))
