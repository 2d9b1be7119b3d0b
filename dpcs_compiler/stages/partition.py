"""Partition stage: joint analyses, the plan (memory budget) or torch's min-cut, the partition into forward
and backward graphs, offload ops, and the simulated memory of the partitioned step."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from dpcs_compiler.cost.memory_model import OFFLOAD, RECOMPUTE, SAVE, MemoryProblem, plan_memory
from dpcs_compiler.cost.step_model import TorchLevels, boundary_level
from dpcs_compiler.passes.analysis import (
    FORWARD,
    Schedule,
    liveness,
    memory_timeline,
    op_cost,
)
from dpcs_compiler.passes.analysis.inductor_schedule import probe_available
from dpcs_compiler.passes.infra import lazy_copy
from dpcs_compiler.passes.analysis.planning import (
    RUNTIME_ALLOWANCE_BYTES,
    PlanningGraph,
)
from dpcs_compiler.passes.rewrite.backward_order import apply_order, sunk_order
from dpcs_compiler.passes.rewrite.offload import insert_offloads
from dpcs_compiler.passes.rewrite.partition import (
    partition_by_plan,
    recast_parameters_in_backward,
    recompute_upcasts,
    saved_names,
)
from dpcs_compiler.plan import ValueDecision
from dpcs_compiler.stages.job import GraphJob, PhaseLevels, has_symbolic_shapes
from dpcs_compiler.stages.memory_plan import TorchPartition, plan_memory_budget

log = logging.getLogger("dpcs.pipeline")


class JointPartitioner(CustomPartitionerFn):
    """Joint analyses, plan, partition and the simulated memory of the partitioned step."""

    def __init__(self, job: GraphJob) -> None:
        self.job = job

    def uuid(self) -> str:
        return self.job.plan.compile_key()

    def __deepcopy__(self, memo: dict) -> JointPartitioner:
        # Inductor deep-copies its config (repro strings, cache keys); this is a handle on one compile job.
        return self

    def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        job, ctx = self.job, self.job.ctx
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        job.record.joint_nodes = len(joint.graph.nodes)
        job.dump_graph("joint", joint)
        with ctx.instrumented("joint", "analyses"):
            joint_schedule = job.as_compiled(
                Schedule.of_joint(joint, num_fwd_outputs=num_fwd_outputs, parameter_indices=job.parameter_indices)
            )
            joint_timeline = ctx.analyses.get(memory_timeline, joint_schedule)
            job.record.total_flops = ctx.analyses.get(op_cost, joint).total_flops
            job.record.symbolic_shapes = has_symbolic_shapes(joint)
        if job.dumper is not None:
            job.dumper.write_timeline("joint_memory_timeline", joint_timeline, f"{job.record.graph} joint (no partition)")
        kept: TorchPartition | None = None
        if job.options.memory_budget is None:
            with ctx.instrumented("partition", "min_cut"):
                forward, backward = self.min_cut(joint, joint_schedule, joint_inputs, kwargs)
        else:
            planning, kept = plan_memory_budget(
                job, joint, num_fwd_outputs, lambda planning: self.torch_plan(joint, joint_inputs, kwargs, planning),
                lambda graph, planning, problem, compiler: self.torch_levels(graph, kwargs, planning, problem, compiler),
            )
            if kept is not None:
                forward, backward = kept.parts
            else:
                with ctx.instrumented("partition", "plan"):
                    forward, backward = partition_by_plan(joint, joint_inputs, planning, job.plan.decisions, **kwargs)
                    offloaded = job.plan.decided(OFFLOAD)
                    if offloaded:
                        insert_offloads(
                            forward,
                            backward,
                            {v.name: v.reload_before for v in offloaded},
                            release_after={v.name: v.release_after for v in offloaded},
                        )
        with ctx.instrumented("step", "analyses"):
            job.order_by_schedule = job.schedule_backward = False
            job.record.backward_fusion = "inductor"
            if kept is not None:
                step, timeline, live = kept.analyses
            else:
                step, timeline, live = self.step_analyses(forward, backward, num_fwd_outputs)
                job.record.backward_order = "autograd"
                job.record.backward_order_scheduled = None
                if job.options.memory_budget is not None and not job.plan.decided(OFFLOAD):
                    if job.options.sinks_backward:
                        (step, timeline, live), _ = self.lowest_backward_order(forward, backward, num_fwd_outputs,
                                                                               (step, timeline, live))
                    elif job.plan.feasible is False and job.options.compiler == "inductor" and probe_available():
                        # Under Inductor, over the budget: Inductor's schedule of the candidates decides: both
                        # fusion rules, and both orders if the sunk one simulates lower
                        # (`PartCompiler.lowest_scheduled_backward`).
                        job.schedule_backward = True
                        if job.options.backward_order == "auto":
                            _, job.order_by_schedule = self.lowest_backward_order(
                                forward, backward, num_fwd_outputs, (step, timeline, live), keep=False
                            )
            # Bytes a saved value keeps alive: the buffers it points into, less those of resident inputs
            # (a saved transpose of a weight costs nothing extra).
            kept = {n: [b for b in live.references.get(n, ()) if b.producer not in step.resident] for n in step.saved}
            saved = sorted((n for n in step.saved if kept[n]), key=lambda n: n.name)
            values = tuple(ValueDecision(n.name, sum(live.hint(b) for b in kept[n])) for n in saved)
            saved_buffers = {b for n in saved for b in kept[n]}
        if job.options.memory_budget is None:
            ctx.plan = job.plan.with_values(values)
        job.record.forward_nodes = len(forward.graph.nodes)
        job.record.backward_nodes = len(backward.graph.nodes)
        job.record.saved_values = len(values)
        job.record.saved_bytes = sum(live.hint(b) for b in saved_buffers)  # views of one buffer counted once
        job.record_timeline("step_memory_timeline", timeline)
        if job.options.memory_budget is not None:
            # The reported prediction is the plan's, from the model the solver used (one peak formula); the
            # partitioned graphs' own simulation is kept as a check, and is what Inductor's schedule of each
            # graph is compared with (`PartCompiler.check_schedule`).
            job.levels = PhaseLevels.of(timeline)
            resident = resident_backward_inputs(step, live)
            job.graph_inputs = {
                "forward": (frozenset(p.name for p in step.resident), frozenset()),
                "backward": (resident, frozenset(p.name for p in step.receives) - resident),
            }
            job.input_storages = {"backward": backward_input_storages(step, live, resident)}
            job.backward_start_bytes = job.record.saved_bytes
            job.record.partition_peak_bytes = timeline.peak_bytes
            job.record.predicted_peak_bytes = job.plan.predicted_peak_bytes
            job.record.peak_node = job.plan.peak_node
            # What the partitioned graphs hold beyond the plan model, per phase (a value re-made once for
            # several recomputations is counted once by the partition, per candidate by the model).
            job.partition_excess = partition_excess(job.problem, job.levels, job.plan.decisions)
            if job.options.compiler != "inductor" or not probe_available():
                # These graphs run as they are (or Inductor's schedule cannot be read): hold them to the budget.
                job.hold_to_budget(dict(job.partition_excess), "its partitioned graphs")
        job.finish()
        log.info(
            "%s: saved %d values (%d B), predicted peak %d B at %s",
            job.record.graph, len(values), job.record.saved_bytes, timeline.peak_bytes, job.record.peak_node,
        )
        return forward, backward

    def lowest_backward_order(self, forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int,
                              analyses: tuple, *, keep: bool = True) -> tuple[tuple, bool]:
        """The backward in its sunk order (`passes.rewrite.backward_order`) if its simulated backward peaks
        lower than autograd's order, else as it is; returns the step analyses of the order kept, and whether
        the sunk order simulated lower. Only a plan's own partition: torch's is compiled as torch orders it (no
        cost at no pressure), and a plan that offloads keeps its reloads' place among the ops that overlap
        them. With keep=False autograd's order stays either way (Inductor's schedule decides)."""
        job, ctx = self.job, self.job.ctx
        step, timeline, live = analyses
        original = list(backward.graph.nodes)
        if not apply_order(backward.graph, sunk_order(backward.graph, resident_backward_inputs(step, live))):
            return analyses, False
        ctx.analyses.invalidate(backward)
        candidate = self.step_analyses(forward, backward, num_fwd_outputs)
        before, after = PhaseLevels.of(timeline).backward_peak, PhaseLevels.of(candidate[1]).backward_peak
        log.info("%s: backward peak %d B in autograd's order, %d B sunk", job.record.graph, before, after)
        if after < before and keep:
            job.record.backward_order = "sunk"
            backward.recompile()
            return candidate, True
        apply_order(backward.graph, original)
        ctx.analyses.invalidate(backward)
        return analyses, after < before

    def min_cut(
        self, joint: fx.GraphModule, joint_schedule: Schedule | None, joint_inputs: Sequence[object], kwargs: dict
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Torch's own partition (min-cut), with dpcs's low-precision tags (joint_schedule: of `joint`, or None
        to make it when needed)."""
        job = self.job
        if job.plan.low_precision:
            if joint_schedule is None:
                joint_schedule = Schedule.of_joint(
                    joint, num_fwd_outputs=kwargs["num_fwd_outputs"], parameter_indices=job.parameter_indices
                )
            # Low-precision copies of weights are made again in backward, not saved; so are the wide copies
            # of narrow values.
            job.record.recast_parameter_nodes = recast_parameters_in_backward(joint, joint_schedule.parameters)
            forward_nodes = frozenset(n for n, phase in joint_schedule.phase.items() if phase == FORWARD)
            job.record.recomputed_upcasts = recompute_upcasts(joint, forward_nodes)
            # With these tags, min-cut told that parameters are static inputs (free to keep for backward) can
            # make a value again in backward from a parameter the step has written to since (a weight halved
            # in place: its cast made from the halved value twice, tests/e2e/test_precision.py). As before
            # dpcs kept Dynamo's metadata on its copies, no input is static here.
            kwargs = {**kwargs, "static_lifetime_input_indices": None}
        kwargs = {"compiler": "inductor", **kwargs}  # Inductor passes it; the eager path asks for the same
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def step_analyses(self, forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int):
        """The partitioned step as it runs: its schedule, simulated memory and liveness."""
        job, ctx = self.job, self.job.ctx
        step = job.as_compiled(
            Schedule.of_partition(forward, backward, num_user_outputs=num_fwd_outputs, parameter_indices=job.parameter_indices)
        )
        return step, ctx.analyses.get(memory_timeline, step), ctx.analyses.get(liveness, step)

    def torch_plan(
        self, joint: fx.GraphModule, joint_inputs: Sequence[object], kwargs: dict, planning: PlanningGraph
    ) -> TorchPartition:
        """Torch's partition of a copy of `joint` (min-cut rewrites the graph it is given), in the planner's
        terms (`stages/memory_plan.TorchPartition`): a candidate is saved if torch saves a value pointing into
        its buffer (or it cannot be made again), else recomputed; and what its partitioned graphs hold beyond
        the model of those decisions."""
        copied = lazy_copy(joint)
        forward, backward = self.min_cut(copied, None, joint_inputs, kwargs)
        decisions = torch_decisions(joint, forward, kwargs["num_fwd_outputs"], planning, self.job.problem)
        analyses = self.step_analyses(forward, backward, kwargs["num_fwd_outputs"])
        excess = partition_excess(self.job.problem, PhaseLevels.of(analyses[1]), decisions)
        return TorchPartition(decisions, excess, (forward, backward), analyses)

    def torch_levels(self, joint: fx.GraphModule, kwargs: dict, planning: PlanningGraph, problem: MemoryProblem,
                     compiler: str) -> TorchLevels:
        """Torch's partition of `joint` (a stand-in's graph as `compiler` runs it: its step view, whose planning
        graph and problem these are) in the step planner's terms: its decisions, and the levels of its
        partitioned graphs as `compiler` runs them (`GraphStep.torch_partition`)."""
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        forward, backward = self.min_cut(lazy_copy(joint), None, (), kwargs)
        decisions = torch_decisions(joint, forward, num_fwd_outputs, planning, problem)
        step = self.job.as_compiled(
            Schedule.of_partition(forward, backward, num_user_outputs=num_fwd_outputs,
                                  parameter_indices=self.job.parameter_indices), compiler)
        return TorchLevels.of(problem, decisions, partition_excess(
            problem, PhaseLevels.of(self.job.ctx.analyses.get(memory_timeline, step)), decisions))


def resident_backward_inputs(step: Schedule, live: Any) -> frozenset[str]:
    """Names of the backward's inputs that are resident: they only point into resident buffers (a parameter,
    or a transposed view of one), so freeing them frees nothing."""
    resident = set(step.resident)
    return frozenset(p.name for p, src in step.receives.items()
                     if all(b.producer in resident for b in live.references.get(src, ())))


def backward_input_storages(step: Schedule, live: Any, resident: frozenset[str]) -> dict[str, tuple[str, int]]:
    """The storage each backward input points into: input name -> (the storage's key, its bytes), for Inductor's
    schedule to count a storage several inputs point into once (a saved `view` and its `permute`), and an input
    that is a view into a larger storage at the storage's bytes (`inductor_schedule._input_buffers`). Resident
    inputs are left out (never freed)."""
    by_storage: dict[tuple[str, ...], list[str]] = {}
    nbytes: dict[tuple[str, ...], int] = {}
    for p, src in step.receives.items():
        # A buffer is its producer's output `index`: the outputs of one multi-output op are storages apart (keyed
        # by the producer alone, Gemma 3's saved attention output and its log-sum-exp were one storage of the
        # log-sum-exp's 2 KiB, and its backward started 34,816 B above the schedule's start, 1.1% of the step).
        buffers = sorted(live.references.get(src, ()), key=lambda b: (b.producer.name, b.index if b.index is not None else -1))
        if p.name in resident or not buffers:
            continue
        key = tuple(b.producer.name if b.index is None else f"{b.producer.name}[{b.index}]" for b in buffers)
        by_storage.setdefault(key, []).append(p.name)
        nbytes[key] = sum(live.hint(b) for b in buffers)
    return {name: ("+".join(key), nbytes[key]) for key, names in by_storage.items() for name in names}


def torch_decisions(joint: fx.GraphModule, forward: fx.GraphModule, num_fwd_outputs: int, planning: PlanningGraph,
                    problem: MemoryProblem) -> tuple[str, ...]:
    """Torch's partition (`forward`, min-cut's of a copy of `joint`) as one decision per candidate of `joint`'s
    planning graph and `problem`: saved if torch saves a value pointing into its buffer (or it cannot be made
    again), else recomputed."""
    originals = {n.name: n for n in joint.graph.nodes}
    held = set()
    for name in saved_names(forward, num_fwd_outputs):
        node = originals.get(name)
        if node is not None:  # else a value min-cut made itself (CSE), counted by the partition excess
            held.update(planning.live.references.get(node, ()))
    return tuple(SAVE if c.buffer in held or not m.can_recompute else RECOMPUTE
                 for c, m in zip(planning.candidates, problem.candidates))


def partition_excess(problem: MemoryProblem, levels: PhaseLevels, decisions: Sequence[str]) -> dict[str, int]:
    """What partitioned graphs hold beyond the plan model of `decisions` in `problem`, per phase (a value re-made
    once for several recomputations is counted once by the partition, per candidate by the model), and between
    the phases ("boundary": what their forward leaves for the backward beyond the model's boundary level)."""
    model = plan_memory(problem, decisions).bytes_during
    start = problem.backward_start
    return {
        "forward": levels.forward_peak + RUNTIME_ALLOWANCE_BYTES - int(model[:start].max(initial=0)),
        "backward": levels.backward_peak + RUNTIME_ALLOWANCE_BYTES - int(model[start:].max(initial=0)),
        "boundary": levels.after_forward - boundary_level(problem, decisions),
    }
