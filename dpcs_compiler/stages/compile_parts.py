"""Final stage: each partitioned graph's rewrites (forward, backward, inference), then the final compiler
(Inductor, holding its schedule to the budget, or "eager"), wired through AOTAutograd by `aot_compile`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.options import DpcsOptions
from dpcs_compiler.passes.analysis import Schedule, memory_timeline, op_cost
from dpcs_compiler.passes.analysis.inductor_schedule import (
    ScheduledPeak,
    probe_available,
    probe_scheduled_peak,
    recording_buffer_reuses,
    with_reuses,
)
from dpcs_compiler.passes.analysis.tensor_bytes import size_hints
from dpcs_compiler.passes.infra import Rewrite, copy_graph_module
from dpcs_compiler.passes.rewrite.backward_order import apply_order, sunk_order
from dpcs_compiler.passes.rewrite.fusion_guard import (
    planned_fusion_choices,
    scheduled_guarded_if_over,
    scheduled_under_each_rule,
)
from dpcs_compiler.passes.rewrite.overflow_check import OverflowCheck
from dpcs_compiler.cost.budget import measurement_tolerance
from dpcs_compiler.stages.job import GraphJob, has_symbolic_shapes
from dpcs_compiler.stages.partition import JointPartitioner

log = logging.getLogger("dpcs.pipeline")

# The rewrites of each partitioned graph, in order. Empty stages are the hooks later capabilities fill.
FORWARD_REWRITES: tuple[Rewrite, ...] = ()
BACKWARD_REWRITES: tuple[Rewrite, ...] = (OverflowCheck(),)
INFERENCE_REWRITES: tuple[Rewrite, ...] = ()


class _Scheduled(Exception):
    """Ends a candidate's compile once Inductor has scheduled it (`PartCompiler.lowest_scheduled_backward`)."""

    def __init__(self) -> None:
        super().__init__("scheduled")


@contextlib.contextmanager
def lowering_as_planned(torchs: bool, producers_apart: bool = False, guarded: bool = True) -> Iterator[Any]:
    """Inductor's settings for lowering a partitioned graph; yields the fusion guard (None for torch's plan).

    Inductor's buffer pool keeps a dead buffer allocated until a later one of the same size takes it over,
    which can hold memory across the peak the plan was made for (measured: +8% on a 2-layer GPT with two
    recomputed MLP inputs), so it is off for dpcs's plans; in-place reuse of dying inputs stays on, and on
    CUDA the caching allocator reuses freed memory anyway. Fusions that would raise the planned peak are
    refused (`planned_fusion_choices`; `producers_apart`: its producer/consumer rule too). Torch's own
    partition (kept: it fits) is lowered as plain Inductor lowers it. `guarded` False: no guard here (the
    caller schedules with it only where Inductor's own fusions do not fit: `scheduled_guarded_if_over`).
    """
    with torch._inductor.config.patch(allow_buffer_reuse=torchs and torch._inductor.config.allow_buffer_reuse), \
            (contextlib.nullcontext(None) if torchs or not guarded else planned_fusion_choices(producers_apart)) as guard:
        yield guard


@contextlib.contextmanager
def without_unused_repro_copy() -> Iterator[bool]:
    """Inductor's compile_fx_inner wraps its compile in the minifier's `wrap_compiler_debug`, which first
    deep-copies the graph (measured: 0.7-0.9 s for HF GPT-2's 12-layer backward) for a repro it writes only
    with `torch._dynamo.config.repro_after="aot"`; otherwise the wrapper returns the compiled graph as it is,
    and the copy is never read. dpcs lowers a planned backward up to five times (its candidates,
    `PartCompiler.lowest_scheduled_backward`): without repro_after="aot" its compiles skip that wrapper.
    Yields whether it is skipped (with "aot", or a torch without the wrapper there, it is kept)."""
    from torch._dynamo import config as dynamo_config
    from torch._inductor import compile_fx as compile_fx_module

    if dynamo_config.repro_after == "aot" or not hasattr(compile_fx_module, "wrap_compiler_debug"):
        yield False
        return
    wrapper = compile_fx_module.wrap_compiler_debug
    compile_fx_module.wrap_compiler_debug = _unwrapped
    try:
        yield True
    finally:
        compile_fx_module.wrap_compiler_debug = wrapper


def _unwrapped(compiler_fn: Callable, compiler_name: str) -> Callable:
    return compiler_fn


def _preferred(peaks: dict[tuple[str, bool], int], tolerance: int) -> tuple[str, bool]:
    """The candidate backward to compile, of {(order, producers apart): scheduled peak} in order of precedence:
    the lowest, where the fusion guard's rule (producers apart) is taken only if it is lower than every
    candidate with Inductor's fusions by more than `tolerance`, what a measurement can tell apart: its refused
    fusions cost kernels, an order costs nothing. Ties go to Inductor's fusions, then to the first."""
    precedence = list(peaks)
    return min(precedence, key=lambda c: (peaks[c] + (tolerance if c[1] else 0), c[1], precedence.index(c)))


class PartCompiler:
    """The forward / backward / inference stage: rewrites, then the final compiler."""

    def __init__(self, job: GraphJob) -> None:
        self.job = job
        self.compiling_chosen = False  # a candidate backward is being compiled as the backward itself

    def prepare(self, kind: str, gm: fx.GraphModule) -> fx.GraphModule:
        """dpcs's work on one part, guarded: if any of it fails (and not strict), the part compiles as given.

        The backward can compile lazily, at the first backward call, outside the backend's own fail-safe;
        rewrites work on a copy, so the graph given here is intact for that fallback.
        """
        job = self.job
        try:
            with size_hints(job.options.size_hints):  # a lazily compiled backward runs outside compile_graph
                return self._prepare(kind, gm)
        except Exception as error:
            if job.options.strict:
                raise
            job.record.fallback = f"{kind} stage skipped: {type(error).__name__}: {error}"
            warnings.warn(
                f"dpcs {kind} stage failed for {job.record.graph}; compiling its {kind} graph without it: "
                f"{type(error).__name__}: {error} (dump folder: {job.record.dump_dir or 'none (set dump_dir)'})",
                category=DpcsWarning, stacklevel=2,
            )
            with contextlib.suppress(Exception):  # the summary is best effort here: the dump may be what failed
                job.finish()
            return gm

    def _prepare(self, kind: str, gm: fx.GraphModule) -> fx.GraphModule:
        job = self.job
        if kind == "inference":
            job.record.mode = "inference"
            job.record.forward_nodes = len(gm.graph.nodes)
            with job.ctx.instrumented("inference", "analyses"):
                schedule = job.as_compiled(Schedule.of_graph(gm, parameter_indices=job.parameter_indices))
                timeline = job.ctx.analyses.get(memory_timeline, schedule)
                job.record.total_flops = job.ctx.analyses.get(op_cost, gm).total_flops
                job.record.symbolic_shapes = has_symbolic_shapes(gm)
            job.record_timeline("inference_memory_timeline", timeline)
        rewrites = {"forward": FORWARD_REWRITES, "backward": BACKWARD_REWRITES, "inference": INFERENCE_REWRITES}[kind]
        gm = job.rewrite(kind, gm, rewrites)
        job.dump_graph(f"{kind}.final", gm)
        job.finish()
        return gm

    def inductor_inner(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any, **kwargs: Any):
        """Stands in for Inductor's compile_fx_inner: dpcs rewrites first, then compile_fx_inner."""
        from torch._inductor.compile_fx import compile_fx_inner

        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        gm = self.prepare(kind, gm)
        if self.job.options.memory_budget is None or kind == "inference":
            return compile_fx_inner(gm, example_inputs, *args, **kwargs)
        if kind == "backward" and self.job.schedule_backward:
            started = time.perf_counter()
            self.compiling_chosen = False
            try:
                gm, compiled = self.lowest_scheduled_backward(gm, example_inputs, *args, **kwargs)
            except Exception as error:  # optional lowerings: the plan compiles as it is
                if self.job.options.strict or self.compiling_chosen:  # the compile's own error (or a re-plan)
                    raise
                warnings.warn(
                    f"dpcs could not schedule the candidate backwards of {self.job.record.graph} "
                    f"({type(error).__name__}: {error}); compiling autograd's order",
                    category=DpcsWarning, stacklevel=2,
                )
                compiled = None
            if compiled is not None:  # the last candidate scheduled was the preferred, compiled as it was
                return compiled
            self.job.ctx.account("backward", "order_by_schedule", time.perf_counter() - started)
        producers_apart = kind == "backward" and self.job.record.backward_fusion == "producers apart"
        return self.compile_planned(kind, gm, example_inputs, *args, producers_apart=producers_apart, **kwargs)

    def compile_planned(self, kind: str, gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any,
                        producers_apart: bool = False, gate: Callable[[dict[bool, int]], bool] | None = None,
                        **kwargs: Any):
        """compile_fx_inner on a planned graph: lowered as planned (`lowering_as_planned`) and its schedule
        held to the budget (`check_schedule`) as soon as Inductor has fused it.

        `gate` (a candidate backward, `lowest_scheduled_backward`): the graph is scheduled from one lowering
        under both fusion rules where they differ (`scheduled_under_each_rule`; `producers_apart` is not read),
        and `gate` is given each rule's scheduled increase above the start, {producers apart: bytes}: it returns
        the rule to go on with, or raises `_Scheduled` (possibly inside Inductor's `InductorError`), which ends
        the compile there. A graph whose schedule is not read (`probe.errors`) is compiled with Inductor's
        fusions without asking it, and returned as it is (the caller, not asked, does not use it).

        Without `gate`, a plan that is not torch's is scheduled with Inductor's own fusions where they fit its
        budget, with the fusion guard only where they do not and its schedule holds measurably less
        (`scheduled_guarded_if_over`, `schedule_fits`, `measurably_lower`, `may_improve`)."""
        from torch._inductor.compile_fx import compile_fx_inner

        probing = kind in self.job.graph_inputs and probe_available()
        guard_if_over = probing and gate is None and not self.job.plan.torch_plan
        with lowering_as_planned(self.job.plan.torch_plan, producers_apart, guarded=not guard_if_over) as guard, \
                contextlib.ExitStack() as stack:
            probe = None
            if probing:
                resident, present = self.job.graph_inputs[kind]
                # Checked as soon as Inductor has fused it: a plan over the budget is re-made before any code
                # is generated for it.
                probe = stack.enter_context(probe_scheduled_peak(
                    resident=resident, present=present, workspace=self.job.kernel_workspace,
                    storages=self.job.input_storages.get(kind),
                    check=None if gate is not None or guard_if_over else lambda peak: self.check_schedule(kind, peak),
                ))
                if guard_if_over:
                    used = stack.enter_context(scheduled_guarded_if_over(
                        probe, lambda peak: self.schedule_fits(kind, peak), lambda peak: self.check_schedule(kind, peak),
                        producers_apart, lower=lambda peak, than: self.measurably_lower(kind, peak, than),
                        may_improve=lambda peak: self.may_improve(kind, peak)))
                elif gate is not None:
                    def choose(readings: dict[bool, tuple[ScheduledPeak, Any]]) -> bool:
                        apart = gate({rule: peak.increase_bytes for rule, (peak, _) in readings.items()})
                        probe.checked = readings[apart][0]
                        self.check_schedule(kind, probe.checked)
                        return apart

                    rules = stack.enter_context(scheduled_under_each_rule(probe, choose))
            stack.enter_context(without_unused_repro_copy())
            reuses = stack.enter_context(recording_buffer_reuses())
            compiled = compile_fx_inner(gm, example_inputs, *args, **kwargs)
        if gate is not None:
            if probe is None or probe.checked is None:
                return compiled  # not asked: a candidate the caller does not use (`_candidate`)
            guard = next(g for peak, g in rules.values() if peak is probe.checked)
        elif guard_if_over:
            guard = used[0] if used else None
        self.job.record.fusions_refused += guard.refused if guard is not None else 0
        if probe is None:
            # The partitioned graphs were held to the budget instead (`JointPartitioner`).
            warnings.warn(
                "this torch's Inductor has no post-fusion scheduler hook (config._post_fusion_custom_pass): dpcs "
                "holds the partitioned FX graphs to memory_budget, not the schedule Inductor generates",
                category=DpcsWarning, stacklevel=2,
            )
        elif probe.errors:
            message = f"dpcs could not read Inductor's schedule of the {kind} graph of {self.job.record.graph}"
            if self.job.options.strict:
                raise RuntimeError(f"{message}: {probe.errors[0]}")
            warnings.warn(f"{message} ({probe.errors[0]}): holding the partitioned graphs to the budget",
                          category=DpcsWarning, stacklevel=2)
            self.job.hold_to_budget(dict(self.job.partition_excess), "its partitioned graphs")
        elif probe.peaks:
            graph = max(probe.peaks, key=lambda p: p.kernels)  # the graph itself, not a subgraph
            # Read again with the reuses its generated code made (decided after the reading that was checked).
            read = with_reuses(graph, reuses)
            if graph is not probe.checked or read.peak_bytes != graph.peak_bytes:
                self.check_schedule(kind, read)
        else:  # Inductor scheduled nothing (no kernels): the partitioned graph is what runs
            self.job.hold_to_budget(dict(self.job.partition_excess), "its partitioned graphs")
        return compiled

    def lowest_scheduled_backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any,
                                  **kwargs: Any) -> tuple[fx.GraphModule, Any]:
        """The backward as Inductor schedules it to the lowest peak, of: autograd's order or its sunk order
        (`passes.rewrite.backward_order`, when it simulates lower: `GraphJob.order_by_schedule`), each lowered
        with Inductor's producer/consumer fusions or with the fusion guard keeping producers apart from later
        consumers (`planned_fusion_choices`). Under Inductor the order given steers its fusion and reordering,
        and a fusion moves kernels, so the FX simulation cannot tell (measured both ways: the guard's rule
        lowers the bench Llama's lowest plan by 1 MB and raises Hugging Face GPT-2's by 5 MB). Only for plans
        over their budget, where a lower peak is what is missing.

        The candidate compiled is the lowest, except that the guard's rule must be lower than Inductor's fusions
        by more than the measurement tolerance (`_preferred`): a peak lower by less than a measured step can
        tell is not worth the guard's kernels (on Hugging Face GPT-2's 12 layers at 0.9 of Inductor's peak, the
        guard's rule was 0.79 MB lower in 1.08 GB, for 76 more kernels).

        Each order is lowered once and scheduled under both rules from that lowering (the guard's rule only
        where it would refuse a fusion, else it schedules the same: `scheduled_under_each_rule`), and the
        preferred kept. The last order is lowered as the compile itself: if one of its rules is the preferred
        of all, code is generated for it and it is returned compiled, else it stops there and the preferred is
        compiled after. So no more lowering of the backward where the last order is preferred, one more
        otherwise. The choice is the record's `backward_order`
        and `backward_fusion`, which the compile reads.

        Returns the backward to compile and None, or the chosen backward and its compiled form."""
        job, started = self.job, time.perf_counter()
        resident, present = job.graph_inputs["backward"]
        orders = {"autograd": gm}
        if job.order_by_schedule:
            sunk = copy_graph_module(gm)
            if apply_order(sunk.graph, sunk_order(sunk.graph, resident)):
                sunk.recompile()
                orders["sunk"] = sunk
        # (order, producers apart) -> scheduled increase, in order of precedence (`_preferred`).
        peaks: dict[tuple[str, bool], int | None] = {}
        last_order = list(orders)[-1]

        def note_scheduled() -> None:
            job.record.backward_order_scheduled = {
                order + (", producers apart" if rule else ""): peak for (order, rule), peak in peaks.items()
            }
            log.info("%s: backward scheduled above its start: %s", job.record.graph,
                     job.record.backward_order_scheduled)

        def choose(name: str, apart: bool) -> None:
            job.record.backward_order = name
            job.record.backward_fusion = "producers apart" if apart else "inductor"
            note_scheduled()

        tolerance = measurement_tolerance(job.limit)
        for name, graph in orders.items():
            def gate(increases: dict[bool, int], name: str = name) -> bool:
                """This order's preferred rule if this order is the one to compile: the last, and the preferred
                of all (`_preferred`); else the compile ends here (`_Scheduled`)."""
                earlier = list(peaks.values())
                peaks.update(((name, rule), increase) for rule, increase in increases.items())
                if name == last_order and None not in earlier:
                    chosen, apart = _preferred(peaks, tolerance)
                    if chosen == name:
                        # The time spent choosing ends here; code generation is the compile's own.
                        job.ctx.account("backward", "order_by_schedule", time.perf_counter() - started)
                        self.compiling_chosen = True
                        choose(name, apart)
                        return apart
                raise _Scheduled()

            compiled = self._candidate(graph, example_inputs, gate, *args, **kwargs)
            read = (name, False) in peaks  # the gate was asked: Inductor's fusions are always read first
            if compiled is not None and read:  # it went on past its schedule: the chosen one
                return graph, compiled
            if not read:  # its schedule was not read: the plan compiles as it is
                peaks[(name, False)] = None
                break
        if None in peaks.values():  # a schedule not read: the plan compiles as it is
            note_scheduled()
            return gm, None
        name, apart = _preferred(peaks, tolerance)
        choose(name, apart)
        return orders[name], None

    def _candidate(self, gm: fx.GraphModule, example_inputs: Sequence[Any], gate: Callable[[dict[bool, int]], bool],
                   *args: Any, **kwargs: Any) -> Any:
        """One candidate backward (a copy of `gm`) compiled up to Inductor's schedules under both fusion rules,
        where `gate` decides: the compiled graph if it let the compile go on, None if it stopped it. A compile
        whose schedule is not read returns without asking `gate`; its caller does not use it."""
        from torch._inductor.exc import InductorError

        try:
            return self.compile_planned("backward", copy_graph_module(gm), example_inputs, *args, gate=gate, **kwargs)
        except InductorError as error:
            if isinstance(error.inner_exception, _Scheduled):
                return None
            raise
        except _Scheduled:
            return None

    def check_schedule(self, kind: str, scheduled: ScheduledPeak) -> None:
        """Hold Inductor's schedule of a planned graph to the budget (`GraphJob.hold_to_budget`).

        Inductor fuses kernels across the FX order (a recomputation with a later backward op that reads
        the same saved value) and a fused kernel makes all its outputs at once, so its schedule can hold
        more than the plan modelled. The graph's excess over the model is what the partitioned FX graph
        holds beyond the model in that phase, plus what Inductor's schedule holds beyond the partitioned
        graph (its peak above the graph's start, against the FX graph's, `PhaseLevels`), plus, for the
        backward, what the scheduled forward left alive beyond the partitioned one.
        """
        job = self.job
        excess, carried, counted = self._counted(kind, scheduled)
        if kind == "forward":
            job.carried_excess = carried
        setattr(job.record, f"{kind}_schedule_excess_bytes", excess)
        job.measured_excess[kind] = excess
        job.hold_to_budget(counted, f"Inductor's schedule of its {kind} graph", final=kind == "backward")

    def _counted(self, kind: str, scheduled: ScheduledPeak) -> tuple[int, int, dict[str, int]]:
        """(this graph's excess over the model, what a forward leaves beyond it, each phase's excess counted
        with this schedule): `check_schedule`'s figures, nothing changed."""
        job = self.job
        excess = job.partition_excess[kind] + scheduled.increase_bytes - job.levels.increase(kind)
        carried = job.carried_excess
        if kind == "forward":
            # What the forward leaves beyond the model (a value it keeps that the model frees) is alive
            # throughout the backward too.
            carried = scheduled.leaves_bytes - job.levels.forward_leaves
        elif job.backward_start_bytes is not None:
            # What the forward left below the model is credited to the backward only as far as its saved values
            # hold less: the schedule's start (their storages) against the model's. The rest is in user outputs,
            # freed at the step's turn where the user drops them. Carried whole, Gemma 3's backward was credited
            # 16,896 B its forward's schedule left below the model in two key/value outputs (copies, where the
            # model kept the views' bases), and its step measured 1.1% over the prediction and over its budget.
            # What it left above the model is carried whole, wherever it is (Swin's forward left 27,648 B no
            # saved value holds, and its backward measured them: credited the start's 0 instead, 8.2% under).
            excess += max(carried, scheduled.start_bytes - job.backward_start_bytes)
        else:
            excess += carried
        # A phase not compiled yet counts what the planner assumed for it: for torch's own partition, what its
        # partitioned graphs hold beyond the model of its decisions (its prediction, `memory_plan._torch_solution`).
        assumed = job.partition_excess if job.plan.torch_plan else job.schedule_excess
        counted = {k: job.measured_excess.get(k, assumed[k]) for k in ("forward", "backward")}
        counted[kind] = excess
        # Between the phases only what the forward leaves beyond the model is alive: the partitioned forward's
        # and its schedule's (`MemoryProblem.with_schedule_excess`), not a peak inside either phase.
        counted["boundary"] = job.partition_excess.get("boundary", 0) + carried
        return excess, carried, counted

    def scheduled_step_peak(self, kind: str, scheduled: ScheduledPeak) -> int:
        """The plan's peak in its step with `scheduled` as the schedule of its `kind` graph, as `check_schedule`
        would judge it (a forward with what it leaves alive counted in the backward not compiled yet)."""
        _, carried, counted = self._counted(kind, scheduled)
        if kind == "forward" and "backward" not in self.job.measured_excess:
            counted["backward"] += max(0, carried)
        return self.job.peak_with(counted)

    def schedule_fits(self, kind: str, scheduled: ScheduledPeak) -> bool:
        """Whether `scheduled` keeps the plan within its budget (`scheduled_step_peak`), with the measurement
        tolerance to spare (`cost.budget.measurement_tolerance`): a step that measures over its prediction by
        less is not planned again, and the guard's lower schedule is what absorbed such an error before (a
        quick GPT's step measured 7.9 KB over both schedules' predictions, the unguarded one then over its
        budget)."""
        return self.scheduled_step_peak(kind, scheduled) + measurement_tolerance(self.job.limit) <= self.job.limit

    def may_improve(self, kind: str, scheduled: ScheduledPeak) -> bool:
        """Whether some schedule of the `kind` graph could fit the budget where `scheduled` may not
        (`schedule_fits`), or keep the step peak lower than it does (`measurably_lower`). None holds less than
        one that holds nothing above the graph's start and leaves nothing beyond what the plan models: where
        even that one does neither, the graph's own peak is not the step's (Hugging Face GPT-2's forward, its
        backward holding more), and no schedule of it is worth another scheduling."""
        floor = dataclasses.replace(scheduled, peak_bytes=scheduled.start_bytes, end_bytes=min(
            scheduled.end_bytes, scheduled.start_bytes + max(0, self.job.levels.forward_leaves)))
        return self.schedule_fits(kind, floor) or self.measurably_lower(kind, floor, scheduled)

    def measurably_lower(self, kind: str, scheduled: ScheduledPeak, than: ScheduledPeak) -> bool:
        """Whether `scheduled` keeps the plan's step peak lower than `than` does: by any amount where the plan
        is meant to fit its budget (a few KB the model does not count can be what puts a step over it), and by
        more than the measurement tolerance (`cost.budget.measurement_tolerance`) where no plan fits
        (`on_infeasible="best"`, the budget out of reach whatever the schedule): a peak lower by less is not one
        a measured step can tell apart, and the fusion guard's schedule costs a kernel per fusion it refuses
        (and, on CPU, code to compile: Hugging Face GPT-2's 12-layer plan at 0.9 of Inductor's peak refused 76
        fusions to be 0.79 MB of 1.08 GB lower, and its C++ took 7 s longer to compile)."""
        tolerance = measurement_tolerance(self.job.limit) if self.job.plan.feasible is False else 0
        return self.scheduled_step_peak(kind, scheduled) + tolerance < self.scheduled_step_peak(kind, than)

    def eager(self, kind: str) -> Callable:
        from torch._dynamo.backends.debugging import boxed_nop

        def compile_part(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            return boxed_nop(self.prepare(kind, gm), example_inputs)

        return compile_part


@contextlib.contextmanager
def saved_views_not_donated() -> Iterator[bool]:
    """AOTAutograd gives the backward every saved tensor that aliases no forward input or output as a donated
    buffer (`collect_fw_donated_buffer_idxs`), which Inductor may write a backward buffer over in place once it
    is read for the last time. Two saved tensors that are views of one storage (a plan saving several slices
    of one buffer, as torch's `default_partition` does) are both donated: one is written over while the other
    is still to be read. On Hugging Face Mamba under Inductor, every plan's layer-1 `A_log` gradient came out
    43% of its largest element off (torch.compile with `default_partition` as Inductor's partitioner gives the
    same; `benchmarks/results/hf_architectures_epyc_inductor_565cec1/mamba_repro.py`). Here a saved tensor that
    shares its storage with another saved tensor is not donated: shared by their fake values, or by the
    forward graph (`_storage_roots`: a saved `view` of a saved softmax in DeBERTa-v2's forward had a fake value
    of its own storage, and the softmax was donated and written over in place). Yields whether torch's
    functions were found (a torch without them donates nothing of this kind to guard)."""
    import unittest.mock

    try:
        from torch._functorch._aot_autograd import graph_compile
    except ImportError:
        yield False
        return
    real = getattr(graph_compile, "collect_fw_donated_buffer_idxs", None)
    real_bw = getattr(graph_compile, "collect_bw_donated_buffer_idxs", None)
    if real is None or real_bw is None:
        yield False
        return

    def storage(t: Any) -> Any:
        from torch.multiprocessing.reductions import StorageWeakRef

        try:
            return StorageWeakRef(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
        except (RuntimeError, NotImplementedError):  # a tensor with no storage (sparse): never donated
            return None

    def collect(fw_ins: Any, user_fw_outs: Any, bw_outs: Any, saved_tensors: Any) -> list[int]:
        donated = real(fw_ins, user_fw_outs, bw_outs, saved_tensors)
        storages = [storage(t) for t in saved_tensors]
        shared = {s for s in storages if s is not None and storages.count(s) > 1}
        return [i for i in donated if storages[i] not in shared]

    def collect_bw(fw_module: fx.GraphModule, bw_module: fx.GraphModule, fw_metadata: Any) -> list[int]:
        donated = real_bw(fw_module, bw_module, fw_metadata)
        outputs = next(reversed(fw_module.graph.find_nodes(op="output"))).args[0]
        roots = _storage_roots(list(outputs[fw_metadata.tensors_saved_for_backwards_slice]))
        shared = {r for r in roots if r is not None and roots.count(r) > 1}
        first = fw_metadata.num_symints_saved_for_bw or 0
        return [i for i in donated if not 0 <= i - first < len(roots) or roots[i - first] not in shared]

    with unittest.mock.patch.object(graph_compile, "collect_fw_donated_buffer_idxs", collect), \
            unittest.mock.patch.object(graph_compile, "collect_bw_donated_buffer_idxs", collect_bw):
        yield True


def _storage_roots(saved: Sequence[Any]) -> list[fx.Node | None]:
    """For each saved value of a forward graph, the node whose storage it points into, followed through view
    ops (`aten.view`, `_unsafe_view`, `permute`, slices: every op whose schema says its output aliases its
    first input), or None (not a node)."""
    def root(node: Any) -> fx.Node | None:
        if not isinstance(node, fx.Node):
            return None
        while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
            base = node.args[0]
            if _is_view(node.target) or (node.target is operator.getitem and base.op == "call_function"
                                         and _is_view(base.target, listed=True)):
                node = base
            else:
                break
        return node

    return [root(n) for n in saved]


def _is_view(target: Any, listed: bool = False) -> bool:
    """Whether `target`'s output is a view of its first input (`listed`: a list of views, as `split` returns)."""
    if target is torch.ops.aten._unsafe_view.default and not listed:  # a view at run time, not in its schema
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or len(schema.returns) != 1 or not schema.arguments:
        return False
    returned, first = schema.returns[0], schema.arguments[0].alias_info
    if first is None or first.is_write:
        return False
    if listed:  # `Tensor(a)[]`: the alias set is its element type's
        return str(returned.type) == "List[Tensor]" and f"Tensor({next(iter(first.before_set), '?')})[]" in str(schema)
    out = returned.alias_info
    return out is not None and not out.is_write and out.before_set == first.before_set


def aot_compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    partitioner: JointPartitioner,
    part_compiler: PartCompiler,
    options: DpcsOptions,
) -> Callable:
    """AOTAutograd with dpcs's partitioner and part compiler, then the chosen final compiler.

    Under a memory budget Inductor's buffer pool is off for the training graphs (`PartCompiler`).
    """
    functorch_patches: dict[str, Any] = {"enable_autograd_cache": False, "enable_remote_autograd_cache": False}
    if options.compiler == "inductor" and options.memory_budget is not None and hasattr(
        torch._functorch.config, "force_non_lazy_backward_lowering"
    ):
        # The backward compiles now, not at its first call: its schedule is checked against the budget
        # and a re-plan (`ScheduleOverBudget`) must happen while compiling.
        functorch_patches["force_non_lazy_backward_lowering"] = True
    with torch._functorch.config.patch(**functorch_patches), saved_views_not_donated():
        if options.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            config_patches = {
                "custom_partitioner_fn": partitioner,
                "fx_graph_cache": False,
                "fx_graph_remote_cache": False,
            }
            return compile_fx(gm, example_inputs, inner_compile=part_compiler.inductor_inner, config_patches=config_patches)
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        backend = aot_autograd(
            fw_compiler=part_compiler.eager("forward"),
            bw_compiler=part_compiler.eager("backward"),
            inference_compiler=part_compiler.eager("inference"),
            partition_fn=partitioner,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )
        return backend(gm, example_inputs)
