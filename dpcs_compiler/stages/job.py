"""What one graph's compilation shares, across the stages: `GraphJob` (options, plan, analyses, instruments,
record, dumps; the hardware profile and budget the graph is planned with; holding compiled graphs to the
budget) and the small facts about a graph that several stages read."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.budget import WORKSPACE_FRACTION, planning_target, torch_plan_limit
from dpcs_compiler.debug.progress import PassProgress
from dpcs_compiler.cost.hardware import ResolvedProfile
from dpcs_compiler.cost.memory_model import SAVE, MemoryProblem, plan_memory
from dpcs_compiler.cost.profiles import resolve_profile
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.ops import offload_ops  # noqa: F401  (times its ops in a CUDA profile measured here)
from dpcs_compiler.cost.step_model import GraphStep, TorchLevels, decisions_code, in_step, recomputed_names
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.options import DpcsOptions
from dpcs_compiler.passes.analysis import FORWARD, Schedule
from dpcs_compiler.passes.analysis.fusion import inductor_fusion
from dpcs_compiler.passes.analysis.memory_timeline import MemoryTimeline
from dpcs_compiler.passes.analysis.op_sites import example_value
from dpcs_compiler.passes.analysis.op_workspace import WorkspaceTable, layout_optimized
from dpcs_compiler.passes.analysis.tensor_bytes import hint_int, size_hints
from dpcs_compiler.passes.infra import (
    AnalysisCache,
    PassContext,
    PassTimer,
    Rewrite,
    copy_graph_module,
    run_rewrites,
)
from dpcs_compiler.plan import Plan
from dpcs_compiler.report import CompileRecord, add_record

# The record's solver where a graph keeps torch's own partition (it fits the budget).
TORCH_SOLVER = "torch min-cut"

log = logging.getLogger("dpcs.pipeline")

_graph_ids = itertools.count()
# Jobs by graph name while something holds them (a dispatcher keeps its variants' jobs: the step planner reads
# their memory problems).
_JOBS: weakref.WeakValueDictionary[str, GraphJob] = weakref.WeakValueDictionary()


def job_of(graph: str) -> GraphJob | None:
    """The job that compiled the graph named `graph`, if something still holds it."""
    return _JOBS.get(graph)


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


@dataclasses.dataclass(frozen=True)
class StepView:
    """A stand-in graph (`DpcsOptions.stands_in_for`) as the compiler it stands in for will run it: its memory
    problem, what its step's other graphs see of it, and its schedule's node names. The step planner plans
    the step with these, not with the stand-in's own (an eager stand-in of an Inductor graph held twice the
    bytes Inductor's fusions hold in the HF GPT-2 loss graph, and the step plan made room for them)."""

    problem: MemoryProblem
    sharing: Any  # `passes.analysis.planning.StepSharing`
    node_names: tuple[str, ...]
    # Torch's own partition of that graph, made at the first call (`GraphStep.torch_partition`); None: not had.
    torch_partition: Callable[[], TorchLevels | None] | None = None

    def decisions(self, problem: MemoryProblem, decisions: Sequence[str]) -> tuple[str, ...]:
        """`decisions` of `problem`'s candidates as this view's, by value name (a value this view has that
        `problem` has not, such as one the stand-in's compiler fuses away, is saved)."""
        by_name = {c.name: d for c, d in zip(problem.candidates, decisions)}
        return tuple(by_name.get(c.name, SAVE) for c in self.problem.candidates)


# Profiles rank 0 resolved for every rank, by (profile option, device, world): resolved once per process.
_RANK_ZERO_PROFILES: dict[tuple[str, str, tuple[int, int] | None], ResolvedProfile] = {}


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
    # Per graph kind: the storage each input points into, name -> (storage key, bytes) (`backward_input_storages`).
    input_storages: dict[str, dict[str, tuple[str, int]]] = dataclasses.field(default_factory=dict)
    measured_excess: dict[str, int] = dataclasses.field(default_factory=dict)
    carried_excess: int = 0  # what the compiled forward leaves alive beyond the partitioned one
    # The model's bytes of the backward's saved inputs (their storages, resident ones left out): what its
    # schedule's start is read against (`PartCompiler._counted`); None where the partition did not say.
    backward_start_bytes: int | None = None
    partition_excess: dict[str, int] = dataclasses.field(default_factory=dict)
    # Inductor's schedule of both orders picks the planned backward's (`PartCompiler.lowest_scheduled_backward`),
    # as each partition decides (`JointPartitioner`): option backward_order "auto", a plan of dpcs's own that
    # offloads nothing and is over its budget (the lowest plan dpcs can reach, compiled with
    # on_infeasible="best"), whose sunk order simulates a lower peak, and a readable schedule.
    order_by_schedule: bool = False
    # A plan over its budget under Inductor: its backward compiles as Inductor schedules it lowest, of the
    # candidate orders and fusion rules (`PartCompiler.lowest_scheduled_backward`).
    schedule_backward: bool = False
    replanning: bool = False
    provisional: bool = False  # a re-plan the solver found over, compiled to be read (`hold_to_budget`)
    graph_fingerprint: str = ""  # the Dynamo graph's identity across ranks (`rank_agreement`)
    resolved_profile: ResolvedProfile | None = None  # `hardware_profile`
    budget_bytes: int | None = None  # `planning_budget` (on CUDA: in allocated bytes, the allocator's share left out)
    reserved_budget_bytes: int | None = None  # on CUDA: the budget as given, on what the caching allocator reserves
    reserved_cap_bytes: int | None = None  # on CUDA: the process's cap on reserved bytes (`cost.budget.cap_reserved`)
    sharing: Any | None = None  # `passes.analysis.planning.StepSharing`: what the step's other graphs see
    schedule_node_names: tuple[str, ...] = ()  # the planning schedule's nodes (a problem step's name)
    held_excess: dict[str, int] | None = None  # the excess the plan was last held to the budget with
    # Plans compiled, read over their budget and planned again (by `decisions_code`): what their compiled graphs
    # held beyond the model (`_count_replan`); the step planner knows them (`StepContext.known_excess`).
    read_excess: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # dynamic shapes: what the plan is for (`planned_sizes`)
    # Kernels' own workspace under a budget, by the compiler measured for (`with_workspace`): the job's, and a
    # stand-in's step view's.
    workspaces: dict[str, WorkspaceTable] = dataclasses.field(default_factory=dict)
    # A stand-in (`DpcsOptions.stands_in_for`): the graph as the compiler it stands in for will run it, which
    # the step planner plans with (`step_graph`); None otherwise. Built once, at its first use (`step_view`):
    # it depends on the joint graph only, which a re-plan traces again unchanged.
    _step_view: StepView | None = None
    _step_view_pending: Callable[[], StepView | None] | None = None
    # Torch's own partition of this graph's problem, where its plan tried it (`GraphStep.torch_partition`).
    torch_levels: TorchLevels | None = None
    torch_plan_refused: bool = False  # torch's partition was compiled and its schedule went over: dpcs plans

    @classmethod
    def start(cls, gm: fx.GraphModule, example_inputs: Sequence[Any], options: DpcsOptions) -> GraphJob:
        name = f"graph_{next(_graph_ids):03d}"
        record = CompileRecord(graph=name, compiler=options.compiler, option_sources=dict(options.option_sources))
        context = torch._guards.CompileContext.try_get()
        if context is not None and context.compile_id is not None:
            record.compile_id = f"{context.compile_id.frame_id}/{context.compile_id.frame_compile_id}"
            record.attempt = context.attempt
        record.dynamo_nodes = len(gm.graph.nodes)
        instruments: list[Any] = [PassTimer(record.pass_seconds), PassProgress(name)]
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
        _JOBS[name] = job
        job.graph_fingerprint = rank_agreement.graph_fingerprint(gm.code, example_inputs)
        job.finish()  # a compile that stops early still leaves a summary behind
        return job

    @property
    def agreeing_ranks(self) -> bool:
        """Whether this graph's planning inputs come from rank 0 and its plan is compared across ranks."""
        return self.options.rank_agreement and rank_agreement.world() is not None

    def hardware_profile(self, device: torch.device) -> ResolvedProfile:
        """The profile this graph is planned with: the option's (or DPCS_HARDWARE_PROFILE's), resolved by rank 0
        of a distributed job and used by every rank (once per process). A re-plan takes no collective."""
        if self.resolved_profile is None:
            spec = self.options.hardware_profile
            if not self.agreeing_ranks:
                self.resolved_profile = resolve_profile(spec, device)
            else:
                # Once per process and profile: every compile (runtime and step variants too) would otherwise
                # take a collective, and each collective is one more chance for a gloo stall (rank_agreement).
                key = (repr(spec), str(device), rank_agreement.world())
                if key not in _RANK_ZERO_PROFILES:
                    resolved = rank_agreement.from_rank_zero(lambda: resolve_profile(spec, device), "hardware profile")
                    rank, _ = rank_agreement.world()
                    _RANK_ZERO_PROFILES[key] = (
                        resolved if rank == 0 else ResolvedProfile(resolved.profile, f"rank 0's, {resolved.source}")
                    )
                self.resolved_profile = _RANK_ZERO_PROFILES[key]
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

    def as_compiled(self, schedule: Schedule, compiler: str | None = None) -> Schedule:
        """The schedule as the final compiler (or `compiler`) runs it (Inductor fuses pointwise values away)."""
        compiler = compiler or self.options.compiler
        if compiler == "inductor":
            schedule = schedule.as_inductor(
                frozenset().union(*(self.ctx.analyses.get(inductor_fusion, g) for g in schedule.graphs))
            )
        return self.with_workspace(schedule, compiler)

    def with_workspace(self, schedule: Schedule, compiler: str | None = None) -> Schedule:
        """Under a memory budget, `schedule` with the workspace its kernels allocate inside themselves, measured
        as the final compiler (or `compiler`: the one a stand-in plans for, `DpcsOptions.stands_in_for`) will
        run them (`passes.analysis.op_workspace`); the first schedule (the joint graph's) decides whether
        Inductor gives the convolutions channels-last tensors."""
        if self.options.memory_budget is None:
            return schedule
        compiler = compiler or self.options.compiler
        table = self.workspaces.get(compiler)
        if table is None:
            inductor = compiler == "inductor"
            table = self.workspaces[compiler] = WorkspaceTable(
                inductor=inductor, channels_last=inductor and layout_optimized(schedule.graphs[0])
            )
            if self.record.mode == "training" and rank_agreement.world() is not None and self.options.rank_agreement:
                table.agree_on(schedule.nodes)  # the joint graph's: every rank compiles it
        return schedule.with_workspace(table.bytes_of(schedule.nodes))

    def kernel_workspace(self, origins: Sequence[fx.Node]) -> int:
        """The workspace of one kernel Inductor schedules, from the FX nodes it comes from (0 without a budget)."""
        table = self.workspaces.get(self.options.compiler)
        if table is None:
            return 0
        return max(table.bytes_of(origins).values(), default=0)

    def rewrite(self, stage: str, gm: fx.GraphModule, rewrites: Sequence[Rewrite]) -> fx.GraphModule:
        """Apply a stage's rewrites to a copy of `gm`: the original stays intact for the fallbacks."""
        if not rewrites:
            return gm
        return run_rewrites(stage, copy_graph_module(gm), rewrites, self.ctx)

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
        self.held_excess = dict(excess)
        problem = self.problem.with_excess(excess)
        memory = plan_memory(self.in_step(problem, capped=False), self.plan.decisions)
        self.ctx.plan = dataclasses.replace(self.plan, predicted_peak_bytes=memory.peak_bytes)
        self.record.predicted_peak_bytes = memory.peak_bytes
        self.finish()
        budget = self.plan.budget_bytes
        # Held to the budget with its step's cap too (what it keeps between forward and backward).
        memory = plan_memory(self.in_step(problem, capped=True), self.plan.decisions)
        if self.provisional and not final:
            return
        if self.provisional and memory.peak_bytes <= self.limit:
            # The lowest plan, over by another plan's excess, fits by its own compiled graphs.
            self.ctx.plan = dataclasses.replace(self.plan, feasible=True)
            self.record.plan_feasible = True
            self.provisional = False
            self.finish()
            return
        if memory.peak_bytes <= self.limit or not (self.plan.feasible or self.provisional):
            return
        if self.replanning and self.record.replans < MAX_SCHEDULE_REPLANS and not self.provisional:
            raise ScheduleOverBudget(excess)
        over = ", ".join(f"{k} {v} B" for k, v in excess.items() if v > 0)
        held = describe_budget(budget)
        if self.provisional:
            message = (
                f"{held} cannot be met for {self.record.graph}{at_sizes(self.sizes)}: the smallest peak dpcs can reach is "
                f"{format_bytes(memory.peak_bytes)} ({memory.peak_bytes} B), its lowest plan compiled after "
                f"{self.record.replans} re-plans ({source} holds {over or 'nothing'} beyond the plan model)"
            )
        else:
            message = (
                f"dpcs plan for {self.record.graph} fits {held} by the plan model, but {source} holds more ({over}), "
                f"for a peak of {format_bytes(memory.peak_bytes)} ({memory.peak_bytes} B) after {self.record.replans} "
                "re-plans" + ("" if self.replanning else " (compiled lazily, at the first backward: no re-plan possible)")
            )
        if self.defers_infeasible(memory.peak_bytes, message) or self.step_judges(message):
            return
        if self.options.on_infeasible == "error":
            raise BudgetInfeasibleError(f"{message}; raise the budget, or pass on_infeasible='best' to compile it")
        warnings.warn(f"{message}; compiling it (on_infeasible='best')", category=DpcsWarning, stacklevel=2)

    def peak_with(self, excess: dict[str, int]) -> int:
        """The plan's peak in its step with `excess` (bytes per phase beyond the plan model, as `hold_to_budget`
        takes it) held in its graphs, as `hold_to_budget` judges it. Nothing is changed."""
        problem = self.problem.with_excess(excess)
        return plan_memory(self.in_step(problem, capped=True), self.plan.decisions).peak_bytes

    def fits_with(self, excess: dict[str, int], spare: int = 0) -> bool:
        """Whether the plan, with `excess` held in its graphs (`peak_with`), stays `spare` bytes within the
        limit `hold_to_budget` holds it to. Nothing is changed."""
        return self.peak_with(excess) + spare <= self.limit

    def in_step(self, problem: MemoryProblem, *, capped: bool, decisions: Sequence[str] | None = None) -> MemoryProblem:
        """`problem` inside its training step (`options.step_context`): the other graphs' bytes added, and with
        `capped`, the step's cap on what this graph holds between its forward and backward; as it holds for
        `decisions` (default: the plan's; `StepContext.for_decisions`)."""
        context = self.options.step_context
        if context is not None:
            context = context.for_decisions(problem, self.plan.decisions if decisions is None else decisions)
        if context is not None and not capped:
            context = dataclasses.replace(context, boundary_cap=None)
        return in_step(problem, context, self.target)

    @property
    def target(self) -> int:
        """The peak this graph's plans are held to: the budget less the workspace allowance, or, when no plan
        of its step fits the budget, the lowest step plan's (`StepContext.target`)."""
        context = self.options.step_context
        if context is not None and context.target is not None:
            return context.target
        budget = self.budget_bytes if self.budget_bytes is not None else self.plan.budget_bytes
        return planning_target(budget) if budget is not None else 0

    @property
    def limit(self) -> int:
        """The peak this graph's current plan is held to: `target`, or, for torch's own plan (kept because it
        fits), the budget itself. The workspace allowance is for plans dpcs makes; torch's plan measured at
        its own peak already includes its kernels' workspace, and a user whose budget is that peak must get
        that plan (`stages/partition.py`)."""
        context = self.options.step_context
        if self.plan.torch_plan and (context is None or context.target is None):
            return torch_plan_limit(self.budget_bytes if self.budget_bytes is not None else self.plan.budget_bytes or 0,
                                    context.other_calls if context is not None else 0)
        return self.target

    @property
    def step_view(self) -> StepView | None:
        """A stand-in's step view (`_step_view`), built now if it was deferred (`defer_step_view`)."""
        if self._step_view_pending is not None:
            build, self._step_view_pending = self._step_view_pending, None
            self._step_view = build()
        return self._step_view

    @step_view.setter
    def step_view(self, view: StepView | None) -> None:
        self._step_view, self._step_view_pending = view, None

    def defer_step_view(self, build: Callable[[], StepView | None]) -> None:
        """Build the step view at its first use, not now: the step watch reads it at the graph's first call,
        after Dynamo's compile of the graph returns. Inside that compile the same Inductor joint-graph passes
        took 2.9 s on HF GPT-2's 12 layers where they take 0.9 s at that first call (2 cores, CPython 3.11;
        the cause inside Dynamo's compile is not known: not the garbage collector, a profiler or tracer, the
        frame hook or another process)."""
        self._step_view, self._step_view_pending = None, build

    @property
    def has_step_view(self) -> bool:
        """Whether a step view was built or is deferred (built once per job)."""
        return self._step_view is not None or self._step_view_pending is not None

    @property
    def step_sharing(self) -> Any | None:
        """What the step's other graphs see of this one, as the step planner plans it (`step_view`)."""
        return self.step_view.sharing if self.step_view is not None else self.sharing

    @property
    def step_node_names(self) -> tuple[str, ...]:
        """The node names of the schedule whose steps the step planner's problem counts (`step_view`)."""
        return self.step_view.node_names if self.step_view is not None else self.schedule_node_names

    def step_graph(self, *, held_excess: bool = True, credit: bool = False, as_compiled: bool = False,
                   known: Mapping[str, Mapping[str, int]] | None = None) -> tuple[GraphStep, tuple[str, ...]] | None:
        """This training graph as the step planner sees it, with its plan's decisions; None without a plan.
        `held_excess`: with what its compiled graphs held beyond the model (False: what the planner assumed
        before compiling; what a plan unlike the next one held, such as a first plan that held least, would
        mislead the step planner). `known`: what other plans of this graph, compiled and read, held beyond the
        model (`read_excess` of its variants' compiles; `GraphStep.known_excess`), this plan's own left out.
        `as_compiled`: for predicting the compiled step, not for planning it (see `credit` below)."""
        if self.problem is None or self.sharing is None or self.budget_bytes is None or self.record.mode != "training":
            return None
        problem, sharing, decisions = self.problem, self.sharing, self.plan.decisions
        torch_partition = (lambda levels=self.torch_levels: levels) if self.torch_levels is not None else None
        unplanned, planned, known_excess = None, (), ()
        if self.step_view is not None:  # a stand-in: what its compiled graphs hold is not what will run
            view = self.step_view
            problem, sharing, decisions = view.problem, view.sharing, view.decisions(problem, decisions)
            torch_partition = view.torch_partition
        else:
            excess = (self.held_excess if held_excess else None) or self.schedule_excess
            unplanned, planned = problem, tuple(sorted(excess.items()))
            own = decisions_code(decisions)
            known_excess = tuple(sorted((code, tuple(sorted(e.items()))) for code, e in (known or {}).items()
                                        if code != own and any(v > 0 for v in e.values())))
            problem = problem.with_excess(excess, planning=True)
            # What Inductor's schedule holds below the FX model is not planned with (on GPT-2 a plan made with
            # it measured 2.1 MB over its prediction). `credit`: a compiled step offered torch's partitions
            # (`StepContext.torch_plan`) is predicted with it inside each phase, as each graph's compile judged
            # its plan (`hold_to_budget`); the step measured with them is checked against that prediction.
            # A graph compiled with compiler="eager" runs its partitioned graphs in the order its compile read
            # them: what they hold below the model's order (the joint graph's) is what runs, and the compiled
            # step is predicted with it (FSDP2's blocks: 2.1 MB a call, the prediction 4% over the measured step
            # without it). So does a graph whose Inductor schedules were both read: they are the code that runs
            # (HF GPT-J's lowest plan: its backward's schedule 97.5 KB under the model, the step predicted 5.7%
            # over its measurement without it). Never planned with: it is that plan's order's, not another plan's.
            offered = self.options.step_context is not None and self.options.step_context.torch_plan
            read = self.options.compiler == "eager" or {"forward", "backward"} <= self.measured_excess.keys()
            runs_as_read = as_compiled and read and self.options.stands_in_for is None
            if held_excess and (credit and offered or runs_as_read):
                problem = problem.with_schedule_credit(min(0, excess["forward"]), min(0, excess["backward"]))
        graph = GraphStep(
            name=self.record.graph,
            problem=problem,
            target=planning_target(self.budget_bytes),  # the budget's (a step plan's target is its own)
            parameter_bytes=sharing.parameter_bytes,
            shared_bytes=sharing.shared_bytes,
            gradient_bytes=sharing.gradient_bytes,
            gradient_steps=sharing.gradient_steps,
            torch_partition=torch_partition,
            freeable=tuple((f.nbytes, f.readers) for f in sharing.freeable if f.readers),
            torch_kept=self.record.solver == TORCH_SOLVER,
            observing=self.observing,
            unplanned=unplanned,
            planned_excess=planned,
            known_excess=known_excess,
        )
        return graph, decisions

    def defers_infeasible(self, peak_bytes: int, message: str) -> bool:
        """Whether the verdict on a plan `peak_bytes` high, over its limit, waits for the step: the graph is
        planned alone (no step context yet) and its outputs the step may free (`StepSharing.freeable`, outputs
        only: its inputs are the loop's) are enough to bring that peak within the limit if the step's code
        drops them before the backward (a model called with labels returns its logits; a loop that keeps
        `.loss` drops them). The step recorder sees whether it does, and the step planner then fits the budget
        or gives on_infeasible's error or warning (`step/`; a step of this graph alone that drops
        nothing gives this `message`). Not refused before the step is seen, not warned twice."""
        if self.options.step_context is not None or self.sharing is None or self.record.mode != "training":
            return False
        droppable = sum(f.nbytes for f in self.sharing.freeable if f.outputs and not f.inputs)
        if droppable <= 0 or peak_bytes - droppable > self.limit:
            return False
        self.record.infeasible_deferred = message
        log.info("%s: %s; left to the step, which may drop %d B of its outputs", self.record.graph, message, droppable)
        return True

    def step_judges(self, message: str) -> bool:
        """Whether the verdict on a plan over its context's target is the step's: a variant compiled for a step
        plan that fits the budget (its context has no target of its own) whose compiled graphs hold more than
        the model counted, so that its re-plans, each counting that excess for every plan, found none within its
        context. The step predicts its compiled variants before it is measured and plans again if they are over
        the budget, then measures it (`step/recorder.py::_predict_as_compiled`): that verdict is the one given.
        (The graph-break net under Inductor at 0.68x its peak: the last graph's variant was said over its
        context, by the cap on what it holds between its phases, and the step measured 0.92 of its budget.)"""
        context = self.options.step_context
        if (context is None or context.target is not None or context.hold_least or context.first_step
                or self.record.mode != "training"):
            return False
        log.info("%s: %s; left to the step, which predicts and measures its compiled variants", self.record.graph, message)
        return True

    @property
    def observing(self) -> bool:
        """Whether its plan, made alone, keeps saved every candidate whose recomputation would read one of its
        outputs the step may free (`GraphStep.observing`)."""
        if self.options.step_context is not None or self.sharing is None or self.problem is None:
            return False
        readers = self.sharing.output_readers()
        return bool(readers) and readers.isdisjoint(recomputed_names(self.problem, self.plan.decisions))

    def finish(self) -> None:
        """Write the plan and the summary (again after each stage, so a lazy backward updates them), and
        emit both through torch's structured trace (TORCH_TRACE: `tlparse` shows them beside Dynamo's and
        Inductor's artifacts of the same compile; nothing is built without a trace)."""
        self.record.plan_hash = self.plan.plan_hash()
        if self.dumper is not None:
            from dpcs_compiler.debug.dump import write_summary

            self.dumper.write_json("plan.json", self.plan.to_json())
            write_summary(self.record)
        for name, payload in (("dpcs_plan", self.plan.to_json), ("dpcs_compile_record", self.record.to_json)):
            torch._logging.trace_structured(
                "artifact", metadata_fn=lambda name=name: {"name": name, "encoding": "json"},
                payload_fn=lambda payload=payload: json.dumps(payload(), default=str), expect_trace_id=False,
            )


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    """True if any tensor in the graph has a symbolic (dynamic) size."""
    return any(
        isinstance(d, torch.SymInt)
        for n in gm.graph.nodes
        if isinstance(v := n.meta.get("val"), torch.Tensor)
        for d in v.shape
    )


def planned_sizes(gm: fx.GraphModule, hints: Sequence[tuple[str, int]] = ()) -> dict[str, int]:
    """The sizes a graph with dynamic shapes is planned for: each shape symbol of its tensors, at `hints` (a
    runtime variant's size bucket, `DpcsOptions.size_hints`) or as traced; {} for a graph of static shapes."""
    symbols: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if isinstance(v := n.meta.get("val"), torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt):
                    symbols.update({str(s): (s, d.node.shape_env) for s in d.node.expr.free_symbols})
    with size_hints(hints):
        return {name: hint_int(symbol, env) for name, (symbol, env) in sorted(symbols.items())}


def at_sizes(sizes: dict[str, int]) -> str:
    """" at sizes s0=64, s1=8" for a message about a plan made for these sizes; "" for static shapes."""
    return f" at sizes {', '.join(f'{k}={v}' for k, v in sizes.items())}" if sizes else ""


def describe_budget(budget: int) -> str:
    """The budget as the errors and warnings name it, with the peak plans are held to."""
    return (
        f"memory_budget {format_bytes(budget)} ({budget} B; plans are held to {planning_target(budget)} B, "
        f"{WORKSPACE_FRACTION:.2%} less, for kernels' own workspace)"
    )


class BudgetInfeasibleError(ValueError):
    """No plan brings the step's peak within the memory budget (and on_infeasible is "error")."""


class PlanningError(RuntimeError):
    """dpcs could not compile a graph (a stage raised), and the options do not let it fall back to plain
    Inductor (`DpcsOptions.falls_back`): under a memory budget a fallback would drop the budget. Names the
    graph; the stage's error is the cause (`__cause__`)."""


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
