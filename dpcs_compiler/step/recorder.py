"""The step recorder: the object that watches the calls of the graphs taking part in step planning, learns
each step's shape from them, and hands it to its planning (`planning.py`) and measuring (`measuring.py`)
halves. `STEPS` is the one recorder of the process."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.step_model import (
    GraphLevels,
    StepShape,
    predicted_levels,
    step_peak,
    with_offloaded,
)
from dpcs_compiler.measure import BEFORE_PROFILING
from dpcs_compiler.report import _ON_CLEAR
from dpcs_compiler.cost.budget import measurement_tolerance, torch_plan_limit
from dpcs_compiler.cost.step_search import CLOSER
from dpcs_compiler.model_states.param_offload import INSTANCES as OFFLOADS
from dpcs_compiler.model_states.param_offload import ParameterOffload
from dpcs_compiler.step.calls import (
    MAX_PENDING_CALLS,
    _Call,
    _alive_elsewhere,
    _compile_marks,
    _droppable,
    _kept_for_recomputation,
    _marks_changed,
    _offload_blocks,
    _pieces,
    fsdp_in_flight,
)
from dpcs_compiler.step.holdings import (
    HELD_ELSEWHERE,
    OBSERVERS,
    _watch_optimizers,
    _Block,
    _block,
    _count_unseen_parameters,
    _ddp_buckets,
    _fsdp_parameters,
    _held_elsewhere,
    _offloaded_now,
    _optimizers_of,
    _state_bytes,
)
from dpcs_compiler.step.measuring import Measuring
from dpcs_compiler.step.meter import _Meter, _OptimizerMeter
from dpcs_compiler.step.participant import Participant
from dpcs_compiler.step.planning import Planning, _AsPlanned
from dpcs_compiler.step.records import _dump_step_record, warn_verdicts_never_given

log = logging.getLogger("dpcs.step")
# Rounds of planning a step again, knowing more, where its compiled variants predict it well under its budget
# after a compile read its plan over (`_predict_as_compiled`): each knows the plans read over in the rounds before.
CLOSER_ROUNDS = 2


class StepRecorder(Measuring, Planning):
    """Watches the calls of the graphs that take part in step planning, and plans steps (`dpcs_compiler.step`)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every graph and step seen (their graphs stay as they are compiled)."""
        for d in list(getattr(self, "participants", ())):
            d._watch = False
        self.stop_measuring()
        self.participants: weakref.WeakSet[Participant] = weakref.WeakSet()
        self.calls: list[_Call] = []
        self.marks = _compile_marks()  # read at the last step end or garbage collection (`_Call.backward_starts`)
        self.glanced: list[str] = []  # graph names called since watching stopped (`glance`)
        self.pending = 0
        self.partial = False
        # (graph names, size buckets) of the calls -> the step's shape and its graphs
        self.shapes: dict[tuple, tuple[StepShape, list[weakref.ref[Participant]]]] = {}
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
        self.replan_as_compiled = 0  # the plan under way follows compiled variants off their budget (`_AsPlanned`)
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
    def arm(self, dispatcher: Participant | None = None) -> None:
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

    def glance(self, dispatcher: Participant) -> None:
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

    def call(self, dispatcher: Participant, args: Sequence[Any]) -> Any:
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
        block: set[int] = set()  # FSDP2: the gathered parameters it takes (its block)
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
                    block.add(id(x))
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
                     kept=frozenset(kept - read), block=frozenset(block))
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
            step_graph = (dispatcher.step_graph(credit=self.torch_planned, as_compiled=True)
                          if dispatcher is not None else None)
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
            # Torch's partitions are offered where a budget is at or above their measured step: predicted over it
            # by less than a measurement can tell apart, they stand (HF GPT-2 at its own step peak: predicted
            # 7.4 KB over, measured at it), and the measured step holds them to it.
            limit = torch_plan_limit(limit, max((len(s.instances) for s in planned.shapes), default=1) - 1)
            limit += measurement_tolerance(limit)
        if compiled == self.predicted and not self.torch_planned:
            return True
        log.info("dpcs: the compiled variants predict %s B (outside the turn, at it, at the end), the plan %s B",
                 compiled, self.predicted)
        fitted = planned.budget is not None and (self.predicted_peak <= planned.budget or self.torch_planned)
        planned_peak, self.predicted, self.predicted_peak = self.predicted_peak, compiled, peak
        over = fitted and peak > limit and not planned.after_mismatch
        # Or well under its budget, where a compile read its plan over and planned again for less (counting what
        # that plan held for every plan): the step is planned again knowing it (`GraphStep.known_excess`).
        under = (fitted and planned.after_mismatch < CLOSER_ROUNDS and not self.torch_planned
                 and peak < (1 - CLOSER) * planned.budget and peak < planned_peak
                 and any(g.known_excess for g in graphs.values()))
        if self._ranks_agree():  # planning takes collectives: every rank decides alike
            over, under = (any(flags) for flags in zip(*rank_agreement.every_rank((over, under))))
        if over or under:
            log.info("dpcs: the compiled variants predict %d B, %s the budget of %d B; planned again",
                     peak, "over" if over else "well under", limit)
            self.torch_refused = self.torch_refused or self.torch_planned
            self.to_plan, self.replan_as_compiled = True, planned.after_mismatch + 1
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

    @staticmethod
    def _shape(calls: list[_Call], blocks: dict[tuple[int, int], _Block]) -> tuple[StepShape, list[weakref.ref[Participant]]]:
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
        # FSDP2: the models whose gathered parameters the calls take (another alive in the process is not the step's).
        seen = next((c.fsdp for c in reversed(calls) if c.fsdp is not None), None)
        fsdp = seen is not None and any(c.block for c in calls)
        shards, sharded_gradients = seen.of(p for c in calls for p in c.block) if fsdp else (0, 0)
        offload = _offload_blocks(calls, blocks)
        shape = StepShape(
            instances=tuple(c.dispatcher.name for c in calls),
            # FSDP2: every rank keeps its shards; each block's gathered parameters live for its call only.
            parameter_bytes=sum(parameters.values()) + shards,
            outside_bytes=sum(gradients.values()) + sum(outside.values()) + sharded_gradients,
            accumulated_bytes=sum(gradients.values()) + sharded_gradients,
            bucket_bytes=sum(outside.values()),
            inputs_held_before=tuple(inputs_held_before),
            held_twice=tuple(held_twice),
            call_parameter_bytes=tuple(sum(c.parameters.values()) for c in calls),
            call_gradient_bytes=tuple(c.own_gradients for c in calls),
            call_gathered_bytes=tuple(c.gathered for c in calls) if fsdp else (),
            call_backward_freed=tuple(c.freed for c in calls),
            call_keep_saved=tuple(c.keep_saved for c in calls),
            call_forward_others=tuple(c.forward_others for c in calls),
            call_backward_others=tuple(c.backward_others for c in calls),
            # FSDP2 works ahead of the block that runs: the next block's gather in its forward; in its backward,
            # the gather of the block before it and the reduce-scatter of the block after it (`fsdp_in_flight`).
            forward_extra_bytes=max((c.gathered for c in calls), default=0) if fsdp else 0,
            call_backward_extra_bytes=fsdp_in_flight([c.block for c in calls], [c.gathered for c in calls],
                                                     seen.late_collectives(p for c in calls for p in c.block))
            if fsdp else (),
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


STEPS = StepRecorder()
_ON_CLEAR.append(STEPS.reset)
atexit.register(STEPS.stop_measuring)
atexit.register(warn_verdicts_never_given)
BEFORE_PROFILING.append(STEPS.finish_reading)
OBSERVERS.append(STEPS)
