"""The dpcs compile pipeline for one Dynamo graph, stage by stage.

    Dynamo graph
      -> precision plan -> pre-autograd rewrites  (fp8 regions, precision casts: AOTAutograd traces their backward)
      -> AOTAutograd joint graph
      -> joint analyses -> plan -> partition -> step analyses
         (no memory_budget: torch's min-cut partition; with one: candidates -> cost model -> solver ->
          partition by the plan's decisions -> offload/reload ops)
      -> forward / backward rewrites      (offload and prefetch; the backward's overflow check)
      -> final compiler                   (Inductor, or "eager": the same graphs run uncompiled)

With Inductor, dpcs runs inside Inductor's own `compile_fx`: the partition stage is Inductor's
`custom_partitioner_fn` (after Inductor's joint-graph passes) and the forward/backward stage wraps
`compile_fx_inner`. With "eager", AOTAutograd is called with the same decompositions and partitioner
and the graphs run as FX code. Every compile derives its plan anew: Inductor's FX-graph and AOTAutograd
caches are bypassed for dpcs graphs (the C++ code cache still applies), and the partitioner's uuid,
which carries the plan's compile key, keeps cache entries of different plans apart if they are enabled.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from dpcs_compiler.cost.budget import WORKSPACE_FRACTION, DeviceMemory, planning_target, resolve_budget
from dpcs_compiler.cost.hardware import HardwareProfile, ResolvedProfile
from dpcs_compiler.cost.profiles import resolve_profile
from dpcs_compiler.cost.memory_model import OFFLOAD, RECOMPUTE, SAVE, MemoryProblem, plan_memory
from dpcs_compiler.cost.op_time import node_seconds, transfer_seconds
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.options import DpcsOptions
from dpcs_compiler.passes.analysis import FORWARD, Schedule, liveness, memory_timeline, op_cost
from dpcs_compiler.passes.analysis.planning import (
    RUNTIME_ALLOWANCE_BYTES,
    PlanningGraph,
    planning_graph,
    planning_schedule,
)
from dpcs_compiler.passes.analysis.fusion import inductor_fusion
from dpcs_compiler.passes.analysis.inductor_schedule import ScheduledPeak, probe_available, probe_scheduled_peak
from dpcs_compiler.passes.analysis.memory_timeline import MemoryTimeline
from dpcs_compiler.passes.infra import AnalysisCache, PassContext, PassTimer, Rewrite, run_rewrites
from dpcs_compiler.passes.analysis.op_sites import example_value, op_sites
from dpcs_compiler.types import NodeCost, OpSite
from dpcs_compiler.passes.rewrite.fp8 import Fp8Regions
from dpcs_compiler.passes.rewrite.fusion_guard import planned_fusion_choices
from dpcs_compiler.passes.rewrite.precision import DTYPES, PrecisionCasts
from dpcs_compiler.passes.rewrite.offload import insert_offloads
from dpcs_compiler.passes.rewrite.overflow_check import OverflowCheck
from dpcs_compiler.passes.rewrite.partition import partition_by_plan, recast_parameters_in_backward, recompute_upcasts
from dpcs_compiler.plan import Plan, ValueDecision
from dpcs_compiler import rank_agreement
from dpcs_compiler.report import CompileRecord, add_record
from dpcs_compiler.ops.fp8 import scaled_mm_supported
from dpcs_compiler.solve import solve
from dpcs_compiler.solve.precision import matching_pattern, plan_precision
from dpcs_compiler.solve.solution import measured_solution

log = logging.getLogger("dpcs.pipeline")

# The rewrites of each stage, in order. Empty stages are the hooks later capabilities fill.
PRE_AUTOGRAD_REWRITES: tuple[Rewrite, ...] = (Fp8Regions(), PrecisionCasts())
FORWARD_REWRITES: tuple[Rewrite, ...] = ()
BACKWARD_REWRITES: tuple[Rewrite, ...] = (OverflowCheck(),)
INFERENCE_REWRITES: tuple[Rewrite, ...] = ()

_graph_ids = itertools.count()


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: DpcsOptions) -> Callable:
    """Run the whole dpcs pipeline on one Dynamo graph and return the compiled callable."""
    job = GraphJob.start(gm, example_inputs, options)
    job.dump_graph("dynamo", gm)
    plan_precision_stage(job, gm)  # per-op dtypes and fp8 linears -> the plan
    gm = job.rewrite("pre_autograd", gm, PRE_AUTOGRAD_REWRITES)
    job.dump_graph("pre_autograd.final", gm)
    partitioner = JointPartitioner(job)  # joint analyses -> plan -> partition -> step analyses
    part_compiler = PartCompiler(job)  # forward / backward rewrites -> final compiler
    while True:
        job.replanning = True  # a ScheduleOverBudget is caught here, not at a lazily compiled backward's call
        try:
            compiled = aot_compile(gm, example_inputs, partitioner, part_compiler, options)
            job.check_ranks_agree()
            return compiled
        except ScheduleOverBudget as over:
            # The compiled graphs of the plan hold more than the model counted: plan again with that much
            # less room in each phase (never less than measured before: no oscillation).
            job.record.replans += 1
            for kind, excess in over.excess.items():
                job.schedule_excess[kind] = max(job.schedule_excess[kind], excess)
            log.info("%s: re-planning, the compiled graphs hold more than planned: %s", job.record.graph, over.excess)
        finally:
            job.replanning = False


# Plans re-made per graph when the compiled graphs of a plan exceed the budget (`GraphJob.hold_to_budget`).
MAX_SCHEDULE_REPLANS = 3


class ScheduleOverBudget(Exception):
    """The compiled graphs of a plan hold more than the plan left room for: plan again with less room."""

    def __init__(self, excess: dict[str, int]) -> None:
        super().__init__(f"the compiled graphs hold more than the plan model: {excess} B per phase")
        self.excess = excess


@dataclasses.dataclass(frozen=True)
class PhaseLevels:
    """The partitioned step's simulated live bytes at its phase boundaries (FX order, fusion model)."""

    resident: int  # before the forward
    forward_peak: int
    after_forward: int  # when the backward starts (saved values, user outputs, resident)
    backward_peak: int

    @classmethod
    def of(cls, timeline: MemoryTimeline) -> PhaseLevels:
        forward = [s for s in timeline.steps if s.phase == FORWARD]
        backward = [s for s in timeline.steps if s.phase != FORWARD]
        after = forward[-1].after if forward else timeline.resident_bytes
        return cls(
            resident=timeline.resident_bytes,
            forward_peak=max((s.during for s in forward), default=timeline.resident_bytes),
            after_forward=after,
            backward_peak=max((s.during for s in backward), default=after),
        )

    def increase(self, kind: str) -> int:
        """The peak of the forward / backward graph above the level at its start."""
        return self.forward_peak - self.resident if kind == "forward" else self.backward_peak - self.after_forward

    @property
    def forward_leaves(self) -> int:
        """Bytes the forward graph leaves alive for the backward and the user (saved values, outputs)."""
        return self.after_forward - self.resident


@dataclasses.dataclass
class GraphJob:
    """Everything one graph's compilation shares: options, plan, analyses, instruments, record, dumps."""

    options: DpcsOptions
    record: CompileRecord
    ctx: PassContext
    parameter_indices: tuple[int, ...]
    dumper: Any | None = None
    # Holding the compiled graphs to the budget (`hold_to_budget`): bytes they held beyond the plan model
    # per phase, as the planner counts them after a re-plan; the planner's problem (before those bytes);
    # for the current plan, the partitioned step's levels, what its partitioned graphs and Inductor's
    # schedule hold beyond the model, and each graph's resident and present inputs (Inductor's names).
    schedule_excess: dict[str, int] = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0})
    problem: MemoryProblem | None = None
    levels: PhaseLevels | None = None
    graph_inputs: dict[str, tuple[frozenset[str], frozenset[str]]] = dataclasses.field(default_factory=dict)
    measured_excess: dict[str, int] = dataclasses.field(default_factory=dict)
    carried_excess: int = 0  # what the compiled forward leaves alive beyond the partitioned one
    partition_excess: dict[str, int] = dataclasses.field(default_factory=dict)
    replanning: bool = False
    provisional: bool = False  # a re-plan the solver found over, compiled to be read (`hold_to_budget`)
    graph_fingerprint: str = ""  # the Dynamo graph's identity across ranks (`rank_agreement`)
    resolved_profile: ResolvedProfile | None = None  # `hardware_profile`
    budget_bytes: int | None = None  # `planning_budget`

    @classmethod
    def start(cls, gm: fx.GraphModule, example_inputs: Sequence[Any], options: DpcsOptions) -> GraphJob:
        name = f"graph_{next(_graph_ids):03d}"
        record = CompileRecord(graph=name, compiler=options.compiler)
        context = torch._guards.CompileContext.try_get()
        if context is not None and context.compile_id is not None:
            record.compile_id = f"{context.compile_id.frame_id}/{context.compile_id.frame_compile_id}"
            record.attempt = context.attempt
        record.dynamo_nodes = len(gm.graph.nodes)
        instruments: list[Any] = [PassTimer(record.pass_seconds)]
        dumper = None
        if options.dump_dir is not None:
            from dpcs_compiler.debug.dump import GraphDumper, new_graph_folder

            dumper = GraphDumper(new_graph_folder(options.dump_dir, name))
            record.dump_dir = str(dumper.folder)
            instruments.append(dumper)
        partitioner = "min_cut" if options.memory_budget is None else "dpcs_plan"  # fixed for the compile key
        plan = Plan(graph=name, options_fingerprint=options.fingerprint(), partitioner=partitioner)
        ctx = PassContext(plan=plan, analyses=AnalysisCache(), instruments=instruments)
        add_record(record)
        parameters = tuple(i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter))
        log.info("compiling %s: %d Dynamo nodes", name, record.dynamo_nodes)
        job = cls(options, record, ctx, parameters, dumper)
        job.graph_fingerprint = rank_agreement.graph_fingerprint(gm.code, example_inputs)
        job.finish()  # a compile that stops early still leaves a summary behind
        return job

    @property
    def agreeing_ranks(self) -> bool:
        """Whether this graph's planning inputs come from rank 0 and its plan is compared across ranks."""
        return self.options.rank_agreement and rank_agreement.world() is not None

    def hardware_profile(self, device: torch.device) -> ResolvedProfile:
        """The profile this graph is planned with: the option's (or DPCS_HARDWARE_PROFILE's), resolved by rank 0
        of a distributed job and used by every rank. Resolved once per graph: a re-plan takes no collective."""
        if self.resolved_profile is None:
            spec = self.options.hardware_profile
            if not self.agreeing_ranks:
                self.resolved_profile = resolve_profile(spec, device)
            else:
                resolved = rank_agreement.from_rank_zero(lambda: resolve_profile(spec, device), "hardware profile")
                rank, _ = rank_agreement.world()
                self.resolved_profile = (
                    resolved if rank == 0 else ResolvedProfile(resolved.profile, f"rank 0's, {resolved.source}")
                )
        return self.resolved_profile

    def check_ranks_agree(self) -> None:
        """In a distributed job, compare this training graph's plan across the ranks (one small collective)."""
        if not self.agreeing_ranks or self.record.mode != "training":
            return
        fields = {k: v for k, v in self.plan.to_json().items() if k not in ("graph", "hash", "plan_hash")}
        label = self.record.graph + (f" (Dynamo id {self.record.compile_id})" if self.record.compile_id else "")
        rank_agreement.check_plans_agree(label, self.graph_fingerprint, fields)

    @property
    def plan(self) -> Plan:
        return self.ctx.plan

    def dump_graph(self, name: str, gm: fx.GraphModule) -> None:
        if self.dumper is not None:
            self.dumper.write_graph(name, gm)

    def as_compiled(self, schedule: Schedule) -> Schedule:
        """The schedule as the final compiler runs it (Inductor fuses pointwise values away)."""
        if self.options.compiler != "inductor":
            return schedule
        return schedule.as_inductor(frozenset().union(*(self.ctx.analyses.get(inductor_fusion, g) for g in schedule.graphs)))

    def rewrite(self, stage: str, gm: fx.GraphModule, rewrites: Sequence[Rewrite]) -> fx.GraphModule:
        """Apply a stage's rewrites to a copy of `gm`: the original stays intact for the fallbacks."""
        if not rewrites:
            return gm
        return run_rewrites(stage, fx.GraphModule(gm, copy.deepcopy(gm.graph)), rewrites, self.ctx)

    def record_timeline(self, name: str, timeline: MemoryTimeline) -> None:
        self.record.predicted_peak_bytes = timeline.peak_bytes
        self.record.resident_bytes = timeline.resident_bytes
        self.record.peak_node = timeline.peak_step.node if timeline.peak_step else None
        if self.dumper is not None:
            self.dumper.write_timeline(name, timeline, title=f"{self.record.graph} {name} (simulated)")

    def hold_to_budget(self, excess: dict[str, int], source: str, *, final: bool = True) -> None:
        """Count what the compiled graphs hold beyond the plan model, and re-plan if that breaks the budget.

        `excess` holds bytes per phase ("forward", "backward") that `source` (the partitioned graphs, or
        Inductor's schedule of one of them) holds beyond the model. The prediction becomes the model with
        those bytes added to that phase's steps (`MemoryProblem.with_schedule_excess`); the solver is held
        to the same formula when it plans again. If a plan the solver found feasible is over the budget,
        `ScheduleOverBudget` makes `compile_graph` plan again, at most MAX_SCHEDULE_REPLANS times; after
        that, on_infeasible decides between an error and a warning. `final` is False while a phase's
        excess is still the planner's assumption (the forward checked, the backward not yet compiled): a
        plan compiled to be read (`provisional`) is then not judged yet.
        """
        memory = plan_memory(self.problem.with_schedule_excess(excess["forward"], excess["backward"]), self.plan.decisions)
        self.ctx.plan = dataclasses.replace(self.plan, predicted_peak_bytes=memory.peak_bytes)
        self.record.predicted_peak_bytes = memory.peak_bytes
        self.finish()
        budget = self.plan.budget_bytes
        if self.provisional and not final:
            return
        if self.provisional and memory.peak_bytes <= planning_target(budget):
            # The lowest plan, over by another plan's excess, fits by its own compiled graphs.
            self.ctx.plan = dataclasses.replace(self.plan, feasible=True)
            self.record.plan_feasible = True
            self.provisional = False
            self.finish()
            return
        if memory.peak_bytes <= planning_target(budget) or not (self.plan.feasible or self.provisional):
            return
        if self.replanning and self.record.replans < MAX_SCHEDULE_REPLANS and not self.provisional:
            raise ScheduleOverBudget(excess)
        over = ", ".join(f"{k} {v} B" for k, v in excess.items() if v > 0)
        held = describe_budget(budget)
        if self.provisional:
            message = (
                f"no dpcs plan for {self.record.graph} fits {held}: after {self.record.replans} re-plans the lowest "
                f"plan, compiled, peaks at {format_bytes(memory.peak_bytes)} ({memory.peak_bytes} B; {source} "
                f"holds {over or 'nothing'} beyond the plan model)"
            )
        else:
            message = (
                f"dpcs plan for {self.record.graph} fits {held} by the plan model, but {source} holds more ({over}), "
                f"for a peak of {format_bytes(memory.peak_bytes)} ({memory.peak_bytes} B) after {self.record.replans} "
                "re-plans" + ("" if self.replanning else " (compiled lazily, at the first backward: no re-plan possible)")
            )
        if self.options.on_infeasible == "error":
            raise BudgetInfeasibleError(f"{message}; raise the budget, or pass on_infeasible='best' to compile it")
        warnings.warn(f"{message}; compiling it (on_infeasible='best')", stacklevel=2)

    def finish(self) -> None:
        """Write the plan and the summary (again after each stage, so a lazy backward updates them)."""
        self.record.plan_hash = self.plan.plan_hash()
        if self.dumper is not None:
            from dpcs_compiler.debug.dump import write_summary

            self.dumper.write_json("plan.json", self.plan.to_json())
            write_summary(self.record)


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    """True if any tensor in the graph has a symbolic (dynamic) size."""
    return any(
        isinstance(d, torch.SymInt)
        for n in gm.graph.nodes
        if isinstance(v := n.meta.get("val"), torch.Tensor)
        for d in v.shape
    )


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
        if job.options.memory_budget is None:
            with ctx.instrumented("partition", "min_cut"):
                if job.plan.precision != "fp32" or any(d.fp8 for d in job.plan.fp8_linears):
                    # Low-precision copies of weights are made again in backward, not saved; so are the
                    # wide copies of narrow values.
                    job.record.recast_parameter_nodes = recast_parameters_in_backward(joint, joint_schedule.parameters)
                    forward_nodes = frozenset(n for n, phase in joint_schedule.phase.items() if phase == FORWARD)
                    job.record.recomputed_upcasts = recompute_upcasts(joint, forward_nodes)
                kwargs.setdefault("compiler", "inductor")  # Inductor passes it; the eager path asks for the same
                forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        else:
            planning = plan_memory_budget(job, joint, num_fwd_outputs)
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
            step = job.as_compiled(
                Schedule.of_partition(
                    forward, backward, num_user_outputs=num_fwd_outputs, parameter_indices=job.parameter_indices
                )
            )
            timeline = ctx.analyses.get(memory_timeline, step)
            live = ctx.analyses.get(liveness, step)
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
            # A backward input is resident when it only points into resident buffers (a parameter, or a
            # transposed view of one): freeing it frees nothing.
            received = {p.name: not kept.get(src, ()) for p, src in step.receives.items()}
            job.graph_inputs = {
                "forward": (frozenset(p.name for p in step.resident), frozenset()),
                "backward": (
                    frozenset(p for p, resident in received.items() if resident),
                    frozenset(p for p, resident in received.items() if not resident),
                ),
            }
            job.record.partition_peak_bytes = timeline.peak_bytes
            job.record.predicted_peak_bytes = job.plan.predicted_peak_bytes
            job.record.peak_node = job.plan.peak_node
            # What the partitioned graphs hold beyond the plan model, per phase (a value re-made once for
            # several recomputations is counted once by the partition, per candidate by the model).
            model = plan_memory(job.problem, job.plan.decisions).bytes_during
            start = job.problem.backward_start
            job.partition_excess = {
                "forward": job.levels.forward_peak + RUNTIME_ALLOWANCE_BYTES - int(model[:start].max(initial=0)),
                "backward": job.levels.backward_peak + RUNTIME_ALLOWANCE_BYTES - int(model[start:].max(initial=0)),
            }
            if job.options.compiler != "inductor" or not probe_available():
                # These graphs run as they are (or Inductor's schedule cannot be read): hold them to the budget.
                job.hold_to_budget(dict(job.partition_excess), "its partitioned graphs")
        job.finish()
        log.info(
            "%s: saved %d values (%d B), predicted peak %d B at %s",
            job.record.graph, len(values), job.record.saved_bytes, timeline.peak_bytes, job.record.peak_node,
        )
        return forward, backward


def describe_budget(budget: int) -> str:
    """The budget as the errors and warnings name it, with the peak plans are held to."""
    return (
        f"memory_budget {format_bytes(budget)} ({budget} B; plans are held to {planning_target(budget)} B, "
        f"{WORKSPACE_FRACTION:.2%} less, for kernels' own workspace)"
    )


class BudgetInfeasibleError(ValueError):
    """No plan brings the step's peak within the memory budget (and on_infeasible is "error")."""


def planning_budget(job: GraphJob, device: torch.device, resident_bytes: int, profile: HardwareProfile) -> int:
    """The memory_budget in bytes for this graph.

    A fraction or "auto" is of the memory of the device the graph runs on, except when the profile describes
    another kind of device (a GPU profile planning a graph traced on the CPU): then of the profile's memory,
    that device assumed to hold nothing but this step. In a distributed job such a budget is the smallest over
    the ranks, so the plan fits on every one.
    """
    if job.budget_bytes is not None:  # resolved once per graph: a re-plan reads free memory or ranks no more
        return job.budget_bytes
    spec = job.options.memory_budget
    memory = None
    if profile.device_type != device.type and profile.memory_bytes is not None:
        memory = DeviceMemory(total_bytes=profile.memory_bytes, free_bytes=max(0, profile.memory_bytes - resident_bytes))
    job.budget_bytes = resolve_budget(spec, device, resident_bytes, memory=memory)
    if not isinstance(spec, int) and job.agreeing_ranks:
        job.budget_bytes = rank_agreement.smallest(job.budget_bytes)
    return job.budget_bytes


def plan_memory_budget(job: GraphJob, joint: fx.GraphModule, num_fwd_outputs: int) -> PlanningGraph:
    """Candidates, cost model and solver: write the plan's decisions for the budget into `job.plan`."""
    ctx, options = job.ctx, job.options
    with ctx.instrumented("plan", "candidates"):
        schedule = planning_schedule(
            joint,
            num_fwd_outputs=num_fwd_outputs,
            parameter_indices=job.parameter_indices,
            compiler=options.compiler,
            analyses=ctx.analyses,
        )
        planning = ctx.analyses.get(planning_graph, schedule)
        device = graph_device(joint)
        resolved = job.hardware_profile(device)
        profile = resolved.profile
        costs = ctx.analyses.get(op_cost, joint).per_node
        no_cost = NodeCost(0, 0, 0)

        fused = schedule.fused

        def seconds(node: fx.Node) -> float:
            cost = costs.get(node, no_cost)
            if node in fused:  # computed inside its readers' kernel: its own bytes never go through memory
                cost = NodeCost(cost.flops, 0, 0)
            return node_seconds(cost, value_dtype(node), profile)

        # Offload is a host link's: the profile's (a GPU profile plans offloads even for a graph traced on CPU).
        transfer = (lambda nbytes: transfer_seconds(nbytes, profile)) if profile.host_to_device is not None else None
        job.problem = planning.memory_problem(seconds, transfer)
        job.measured_excess, job.carried_excess = {}, 0
        job.record.fusions_refused = 0
        # Under Inductor, after a re-plan: the bytes its schedule held beyond the model (zero at first).
        problem = job.problem.with_schedule_excess(job.schedule_excess["forward"], job.schedule_excess["backward"])
        budget = planning_budget(job, device, planning.resident_bytes, profile)
    with ctx.instrumented("plan", "solve"):
        # A graph whose backward reads nothing of the forward has nothing to decide.
        # Plans are held to the budget less an allowance for memory kernels allocate inside themselves.
        target = planning_target(budget)
        solution = solve(problem, target) if problem.candidates else measured_solution(problem, (), target, "none", 0.0)
    if has_symbolic_shapes(joint):
        warnings.warn(
            f"dpcs planned {job.record.graph} for its traced sizes, but its shapes are dynamic: the plan is not "
            "re-made for other sizes, so larger inputs can exceed memory_budget (compile with dynamic=False)",
            stacklevel=2,
        )
    decisions = solution.decisions
    values = tuple(
        ValueDecision(
            c.holder.name,
            c.nbytes,
            d,
            reload_before=schedule.nodes[problem.reload_step(i)].name if d == OFFLOAD else None,
            release_after=schedule.nodes[problem.offload_free_step(i)].name if d == OFFLOAD else None,
        )
        for i, (c, d) in enumerate(zip(planning.candidates, decisions))
    )
    peak_step = plan_memory(problem, decisions).peak_step
    ctx.plan = dataclasses.replace(
        job.plan.with_values(values),
        budget_bytes=budget,
        hardware=f"{profile.device_key}#{resolved.hash}",
        predicted_peak_bytes=solution.peak_bytes,
        feasible=solution.feasible,
        peak_node=schedule.nodes[peak_step].name if peak_step >= 0 else None,
    )
    record = job.record
    record.budget_bytes, record.plan_feasible, record.solver = budget, solution.feasible, solution.solver
    record.hardware_profile = f"{profile.device_key}: {resolved.describe()}"
    record.planned_for = profile.device_key if profile.device_type != device.type else None
    record.recomputed_values = decisions.count(RECOMPUTE)
    record.offloaded_values = decisions.count(OFFLOAD)
    record.plan_added_seconds = solution.added_seconds
    job.finish()
    # After a re-plan the excess counted is another plan's: a plan the solver finds over may still fit once
    # its own compiled graphs are read. It is compiled, and `hold_to_budget` decides.
    job.provisional = not solution.feasible and job.record.replans > 0
    if not solution.feasible and not job.provisional:
        message = (
            f"{describe_budget(budget)} cannot be met for {record.graph}: the smallest peak "
            f"dpcs can reach is {format_bytes(solution.peak_bytes)} ({solution.peak_bytes} B), with "
            f"{decisions.count(SAVE)} values saved, {record.recomputed_values} recomputed and "
            f"{record.offloaded_values} offloaded (+{solution.added_seconds * 1e3:.2f} ms per step estimated)"
        )
        if any(v > 0 for v in job.schedule_excess.values()):
            message += (
                f", counting what the compiled graphs of an earlier plan held beyond the plan model (forward "
                f"{max(job.schedule_excess['forward'], 0)} B, backward {max(job.schedule_excess['backward'], 0)} B)"
            )
        if options.on_infeasible == "error":
            raise BudgetInfeasibleError(
                f"{message}; raise the budget, or pass on_infeasible='best' to compile that plan"
                + (f" (plan: {record.dump_dir}/plan.json)" if record.dump_dir else "")
            )
        warnings.warn(f"{message}; compiling that plan (on_infeasible='best')", stacklevel=2)
    log.info(
        "%s: budget %d B, plan peak %d B (%s), %d recomputed, %d offloaded",
        record.graph, budget, solution.peak_bytes, "fits" if solution.feasible else "over",
        record.recomputed_values, record.offloaded_values,
    )
    return planning


def plan_precision_stage(job: GraphJob, gm: fx.GraphModule) -> None:
    """Decide each op's dtype and the fp8 linears of the Dynamo graph (`solve/precision.py`) into the plan."""
    options = job.options
    job.record.precision = options.precision
    job.ctx.plan = dataclasses.replace(job.plan, precision=options.precision, detect_overflow=options.overflow_detected)
    if options.precision == "fp32" and options.fp8 is None:
        return  # keep_fp32 changes nothing when everything is fp32
    with job.ctx.instrumented("pre_autograd", "plan_precision"):
        sites = job.ctx.analyses.get(op_sites, gm)
        matmul = options.fp8.matmul if options.fp8 is not None else "scaled_mm"
        weight_grad_dtype = None
        if options.fp8 is not None and matmul == "auto":
            device = graph_device(gm)
            # Outputs in the region's dtype (forward, input gradient) and, for the weight gradient, the fp32
            # weight's, or else the region's and then cast.
            region = DTYPES[options.precision]
            matmul = "scaled_mm" if scaled_mm_supported(device, options.fp8.recipe, region) else "emulated"
            if matmul == "scaled_mm" and not scaled_mm_supported(device, options.fp8.recipe, torch.float32):
                weight_grad_dtype = options.precision
            if matmul == "emulated":
                warnings.warn(
                    f"torch._scaled_mm does not run the {options.fp8.recipe} fp8 recipe on {device}: dpcs emulates the "
                    "fp8 matmuls exactly in fp32 (same numerics, no speedup; fp8 matmuls need CUDA sm89 or newer)",
                    stacklevel=2,
                )
        ops, linears = plan_precision(
            sites, precision=options.precision, keep_fp32=options.keep_fp32, fp8=options.fp8, fp8_matmul=matmul,
            fp8_weight_grad_dtype=weight_grad_dtype,
        )
        warn_unmatched_patterns(sites, options)
        job.ctx.plan = dataclasses.replace(job.plan, precision_ops=ops, fp8_linears=linears)
    job.record.cast_ops = sum(d.dtype != "fp8" for d in ops)
    job.record.fp8_linears = sum(d.fp8 for d in linears)
    job.record.fp8_matmul = matmul if options.fp8 is not None else None
    log.info(
        "%s: precision %s, %d ops with a dtype decision, %d of %d linears in fp8",
        job.record.graph, options.precision, job.record.cast_ops, job.record.fp8_linears, len(linears),
    )


def warn_unmatched_patterns(sites: Sequence[OpSite], options: DpcsOptions) -> None:
    """A keep_fp32 or fp8 filter pattern that names no module of the graph is most likely a typo."""
    patterns = [("keep_fp32", p) for p in options.keep_fp32]
    if options.fp8 is not None:
        patterns += [("fp8.filter", p) for p in options.fp8.filter]
    modules = {m for site in sites for m in site.modules}
    for option, pattern in patterns:
        if matching_pattern(sorted(modules), [pattern]) is None:
            warnings.warn(
                f"dpcs option {option!r} pattern {pattern!r} matches no module of this graph; its modules are "
                f"named as model.named_modules() names them, e.g. {sorted(modules - {''})[:5]}",
                stacklevel=3,
            )


def graph_device(gm: fx.GraphModule) -> torch.device:
    """The device of the graph's tensor inputs (one per graph; 0-dim CPU tensors, such as a step count,
    may come along)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    values = [v for n in placeholders if isinstance(v := n.meta.get("val", example_value(n)), torch.Tensor)]
    devices = {v.device for v in values if v.dim() > 0 or v.device.type != "cpu"}  # CPU scalars ride along
    devices = devices or {v.device for v in values}
    if len(devices) != 1:
        raise ValueError(f"memory planning needs one device per graph, found {sorted(map(str, devices))}")
    return devices.pop()


def value_dtype(node: fx.Node) -> torch.dtype:
    """The dtype a node computes in (its first tensor output's; float32 for non-tensors)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return next((v.dtype for v in values if isinstance(v, torch.Tensor)), torch.float32)


class PartCompiler:
    """The forward / backward / inference stage: rewrites, then the final compiler."""

    def __init__(self, job: GraphJob) -> None:
        self.job = job

    def prepare(self, kind: str, gm: fx.GraphModule) -> fx.GraphModule:
        """dpcs's work on one part, guarded: if any of it fails (and not strict), the part compiles as given.

        The backward can compile lazily, at the first backward call, outside the backend's own fail-safe;
        rewrites work on a copy, so the graph given here is intact for that fallback.
        """
        job = self.job
        try:
            return self._prepare(kind, gm)
        except Exception as error:
            if job.options.strict:
                raise
            job.record.fallback = f"{kind} stage skipped: {type(error).__name__}: {error}"
            warnings.warn(
                f"dpcs {kind} stage failed for {job.record.graph}; compiling its {kind} graph without it: "
                f"{type(error).__name__}: {error} (dump folder: {job.record.dump_dir or 'none (set dump_dir)'})",
                stacklevel=2,
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
        # Inductor's buffer pool keeps a dead buffer allocated until a later one of the same size takes it
        # over, which can hold memory across the peak the plan was made for (measured: +8% on a 2-layer GPT
        # with two recomputed MLP inputs). In-place reuse of dying inputs stays on; on CUDA the caching
        # allocator reuses freed memory anyway.
        with torch._inductor.config.patch(allow_buffer_reuse=False), contextlib.ExitStack() as stack:
            probe = None
            guard = stack.enter_context(planned_fusion_choices())
            if kind in self.job.graph_inputs and probe_available():
                resident, present = self.job.graph_inputs[kind]
                probe = stack.enter_context(probe_scheduled_peak(resident=resident, present=present))
            compiled = compile_fx_inner(gm, example_inputs, *args, **kwargs)
        self.job.record.fusions_refused += guard.refused
        if probe is None:
            # The partitioned graphs were held to the budget instead (`JointPartitioner`).
            warnings.warn(
                "this torch's Inductor has no post-fusion scheduler hook (config._post_fusion_custom_pass): dpcs "
                "holds the partitioned FX graphs to memory_budget, not the schedule Inductor generates",
                stacklevel=2,
            )
        elif probe.errors:
            message = f"dpcs could not read Inductor's schedule of the {kind} graph of {self.job.record.graph}"
            if self.job.options.strict:
                raise RuntimeError(f"{message}: {probe.errors[0]}")
            warnings.warn(f"{message} ({probe.errors[0]}): holding the partitioned graphs to the budget", stacklevel=2)
            self.job.hold_to_budget(dict(self.job.partition_excess), "its partitioned graphs")
        elif probe.peaks:
            self.check_schedule(kind, max(probe.peaks, key=lambda p: p.kernels))  # the graph itself, not a subgraph
        else:  # Inductor scheduled nothing (no kernels): the partitioned graph is what runs
            self.job.hold_to_budget(dict(self.job.partition_excess), "its partitioned graphs")
        return compiled

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
        excess = job.partition_excess[kind] + scheduled.increase_bytes - job.levels.increase(kind)
        if kind == "forward":
            # What the forward leaves beyond the model (a value it keeps that the model frees) is alive
            # throughout the backward too.
            job.carried_excess = scheduled.leaves_bytes - job.levels.forward_leaves
        else:
            excess += job.carried_excess
        setattr(job.record, f"{kind}_schedule_excess_bytes", excess)
        job.measured_excess[kind] = excess
        counted = {k: job.measured_excess.get(k, job.schedule_excess[k]) for k in ("forward", "backward")}
        job.hold_to_budget(counted, f"Inductor's schedule of its {kind} graph", final=kind == "backward")

    def eager(self, kind: str) -> Callable:
        from torch._dynamo.backends.debugging import boxed_nop

        def compile_part(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            return boxed_nop(self.prepare(kind, gm), example_inputs)

        return compile_part


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
    with torch._functorch.config.patch(**functorch_patches):
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
