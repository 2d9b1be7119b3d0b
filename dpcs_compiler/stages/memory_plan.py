"""Memory-plan stage: candidates, cost model and solver write the plan's SAVE / RECOMPUTE / OFFLOAD decisions
for the memory budget, costed with the graph's hardware profile."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.budget import (
    DeviceMemory,
    allocator_slack,
    cap_reserved,
    expandable_segments_on,
    predicted_reserved,
    resolve_budget,
    torch_plan_limit,
    use_expandable_segments,
)
from dpcs_compiler.cost.hardware import HardwareProfile
from dpcs_compiler.cost.memory_model import OFFLOAD, RECOMPUTE, SAVE, MemoryProblem, plan_memory
from dpcs_compiler.cost.calibration import recompute_terms
from dpcs_compiler.cost.op_time import combine_seconds, offload_ops_seconds, roofline_terms, transfer_seconds
from dpcs_compiler.cost.step_model import StepContext, TorchLevels, in_step, least_held_cap, solve_knowing
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.passes.analysis import op_cost
from dpcs_compiler.passes.analysis.inductor_schedule import probe_available
from dpcs_compiler.passes.analysis.tensor_bytes import size_hints
from dpcs_compiler.passes.analysis.planning import (
    PlanningGraph,
    planning_graph,
    planning_schedule,
    step_sharing,
)
from dpcs_compiler.passes.infra import copy_graph_module
from dpcs_compiler.plan import ValueDecision
from dpcs_compiler.solve import fits, solve_or_measure
from dpcs_compiler.solve.solution import Solution, measured_solution
from dpcs_compiler.stages.calibrate import graph_calibration
from dpcs_compiler.stages.job import (
    TORCH_SOLVER,
    BudgetInfeasibleError,
    GraphJob,
    StepView,
    at_sizes,
    describe_budget,
    graph_device,
    has_symbolic_shapes,
    planned_sizes,
    value_dtype,
)
from dpcs_compiler.types import NodeCost

log = logging.getLogger("dpcs.pipeline")


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
    if device.type == "cuda":  # the budget bounds reserved bytes: plans allocate less by the allocator's share
        job.reserved_budget_bytes = job.record.reserved_budget_bytes = job.budget_bytes
        job.reserved_cap_bytes = job.record.reserved_cap_bytes = cap_reserved(job.budget_bytes, device)
        job.budget_bytes -= allocator_slack(job.budget_bytes, use_expandable_segments())
    return job.budget_bytes


@dataclasses.dataclass(frozen=True, eq=False)
class TorchPartition:
    """Torch's own partition of a graph (min-cut), in the planner's terms (`stages/partition.py`).

    decisions: its saved set as one decision per candidate; excess: what its partitioned graphs hold beyond
    the memory model of those decisions, per phase; parts: its forward and backward graphs; analyses: their
    schedule, simulated memory and liveness (what the partition stage reads of the graphs it compiles)."""

    decisions: tuple[str, ...]
    excess: dict[str, int]
    parts: tuple[fx.GraphModule, fx.GraphModule]
    analyses: tuple[Any, Any, Any]


TorchPlan = Callable[[PlanningGraph], "TorchPartition | None"]  # None when it cannot be had
# Torch's partition of a joint graph as a compiler partitions it, for a step view: (joint, its planning graph,
# its memory problem, the compiler) -> its decisions and levels (`JointPartitioner.torch_levels`).
TorchLevelsOf = Callable[[fx.GraphModule, PlanningGraph, MemoryProblem, str], TorchLevels]
# A graph's lowest plan whose modelled peak is over its target by at most this fraction is compiled and judged
# by its compiled graphs (`GraphJob.hold_to_budget`), which can hold less than the model: a conv net's
# partitioned graphs held 2,304 B (0.02%) less, so a budget at the lowest peak `memory_budget=1` reported for
# it (the compiled plan's) was refused. Further over, the budget is refused before anything is compiled.
PROVISIONAL_FRACTION = 0.02


def within_reach(peak_bytes: int, target_bytes: int) -> bool:
    """Whether a plan modelled at `peak_bytes`, over `target_bytes`, is close enough to be compiled and judged
    by its compiled graphs (`PROVISIONAL_FRACTION`)."""
    return target_bytes > 0 and peak_bytes <= target_bytes * (1 + PROVISIONAL_FRACTION)


# Under Inductor, torch's partition is tried when its modelled peak (FX order) is within this fraction over
# the budget: Inductor's own order often holds less (measured: 1.8% less on the bench GPT). Its schedule,
# read before code is generated, decides (`GraphJob.hold_to_budget`); if it is over, dpcs plans instead.
TORCH_PLAN_TRY_FRACTION = 0.03


def torch_plan_refusal(job: GraphJob) -> str | None:
    """Why torch's own partition is not a plan for this graph (None: it is tried first, and kept if it fits).

    It is kept only where its prediction was checked against measured peaks: for a graph planned alone; in a
    step of several graphs, where the step planner offers it (`StepContext.torch_plan`: the step fits by the
    model with plans saving everything or with each graph's own partition, and the context counts what the
    others keep then; a step that measures over its prediction inside its graphs and over its budget with
    torch's partitions, or whose compiled variants predict it over the budget, is planned by dpcs from then
    on, `StepRecorder.torch_refused`); and in fp32 (torch's
    partition of a bf16 graph measured 6% over its prediction under Inductor; dpcs's own plans are what the
    peak model was checked on with low-precision casts)."""
    if not job.options.keep_torch_plan:
        return "keep_torch_plan=False"
    if job.torch_plan_refused:
        return "Inductor's schedule of torch's partition went over the budget"
    if job.options.step_context is not None and not job.options.step_context.torch_plan:
        return "the graph is planned in a step of several graphs that does not fit with torch's partitions"
    if job.plan.low_precision:
        return f"the graph runs in {job.plan.precision} or fp8"
    return None


def _torch_solution(
    job: GraphJob,
    problem: MemoryProblem,
    context: StepContext | None,
    kept: TorchPartition,
    budget: int,
) -> Solution | None:
    """Torch's partition as the plan, if it fits: held to the budget itself, its cap between phases included
    (or to the step plan's target when no plan of the step fits it); None if it does not fit."""
    decisions, excess = kept.decisions, kept.excess
    context = context.for_decisions(problem, decisions) if context is not None else None  # made without it
    limit = (context.target if context is not None and context.target is not None
             else torch_plan_limit(budget, context.other_calls if context is not None else 0))
    # Its prediction is its partitioned graphs' own (the model of its decisions and what the graphs hold
    # beyond or below it); what Inductor's schedule holds besides is read when it is compiled.
    own = problem.with_schedule_excess(excess["forward"], excess["backward"])  # as `TorchLevels.of`
    solution = measured_solution(in_step(own, context, limit), decisions, limit, TORCH_SOLVER, 0.0)
    # Its prediction: its peak in its step (the cap is a bound, not bytes alive).
    uncapped = context if context is None else dataclasses.replace(context, boundary_cap=None)
    solution = dataclasses.replace(solution, peak_bytes=plan_memory(in_step(own, uncapped, limit), decisions).peak_bytes)
    if solution.feasible:
        return solution
    scheduled = job.options.compiler == "inductor" and probe_available()
    if scheduled and not job.torch_plan_refused and solution.peak_bytes <= limit * (1 + TORCH_PLAN_TRY_FRACTION):
        log.info("%s: torch's partition peaks at %d B in FX order, over %d B: tried, Inductor's schedule decides",
                 job.record.graph, solution.peak_bytes, limit)
        return dataclasses.replace(solution, feasible=True)
    log.info("%s: torch's partition would peak at %d B, over %d B: dpcs plans", job.record.graph,
             solution.peak_bytes, limit)
    return None


def _as_compiler_traces(joint: fx.GraphModule, compiler: str, device: torch.device,
                        fake_mode: Any = None) -> fx.GraphModule:
    """The joint graph as `compiler` partitions it: under Inductor, the graph after Inductor's joint-graph
    passes (which its partitioner runs first: pattern rewrites, no-op removal; on HF GPT-2's layers 685 nodes
    where the eager joint has 724), run on `joint` itself (a copy: `_step_view`'s caller's)."""
    if compiler != "inductor":
        return joint
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.virtualized import V

    if fake_mode is None:
        fake_mode = detect_fake_mode([n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")])
    # As Inductor runs them: under the graph's fake mode (its random-op rewrite traces with it).
    with V.set_fake_mode(fake_mode):
        return _recursive_joint_graph_passes(joint, skip_invoke_subgraph=True, input_device=device)


def _step_view(job: GraphJob, joint: fx.GraphModule, num_fwd_outputs: int, device: torch.device,
               profile: HardwareProfile, calibration: Any, fake_mode: Any = None,
               torch_levels: TorchLevelsOf | None = None, hints: Any = ()) -> StepView | None:
    """A stand-in's graph as the compiler it stands in for will run it (`GraphJob.step_view`); None, with a
    warning, if that graph cannot be made: the step is then planned with the stand-in's own problem, whose
    plans the compiled variants' prediction and the measured step still hold to the budget (more recomputed
    than needed where the compiler's graph holds less). `joint`: a copy of the stand-in's joint graph, which
    the compiler's passes change; `fake_mode`: its compile's (None: the one its inputs' values belong to);
    `torch_levels`: how torch's partition of that graph is made, at the step planner's first call for it
    (under the size hints `hints`; `StepView.torch_partition`)."""
    compiler = job.options.stands_in_for
    try:
        compiled_joint = _as_compiler_traces(joint, compiler, device, fake_mode)
        costs_there = job.ctx.analyses.get(op_cost, compiled_joint).per_node
        view = _PlanningView.of(job, compiled_joint, num_fwd_outputs, compiler, profile, costs_there, calibration)
    except Exception as error:  # noqa: BLE001 - planning goes on with the stand-in's own graph, said so
        if job.options.strict:
            raise
        warnings.warn(f"dpcs could not build {job.record.graph} as {compiler} will run it ({type(error).__name__}: "
                      f"{error}): its step is planned with its {job.options.compiler} graph, which can hold more",
                      category=DpcsWarning, stacklevel=2)
        return None
    partition: Callable[[], TorchLevels | None] | None = None
    if torch_levels is not None:
        # The graph and its view until its partition is made (only then: a min-cut), then the partition.
        pending: list[Any] = [(compiled_joint, view)]

        def made_once() -> TorchLevels | None:
            if isinstance(pending[0], tuple):
                pending[0] = _view_torch_levels(job, *pending[0], compiler, torch_levels, hints)
            return pending[0]

        partition = made_once
    return StepView(view.problem, step_sharing(view.planning, num_fwd_outputs), tuple(n.name for n in view.schedule.nodes),
                    partition)


def _view_torch_levels(job: GraphJob, joint: fx.GraphModule, view: _PlanningView, compiler: str,
                       torch_levels: TorchLevelsOf, hints: Any) -> TorchLevels | None:
    """Torch's partition of a step view's graph (`_step_view`); None, with a warning, where min-cut fails on
    it: its step is then offered torch's partitions only where the plans saving everything fit."""
    try:
        with job.ctx.instrumented("plan", "step_view_torch_partition"), size_hints(hints):
            return torch_levels(joint, view.planning, view.problem, compiler)
    except Exception as error:  # noqa: BLE001 - the step planner goes on without it, said so
        if job.options.strict:
            raise
        warnings.warn(f"dpcs could not make torch's partition of {job.record.graph} as {compiler} will run it "
                      f"({type(error).__name__}: {error}): its step keeps torch's partitions only where plans "
                      "saving everything fit", category=DpcsWarning, stacklevel=2)
        return None


@dataclasses.dataclass(frozen=True)
class _PlanningView:
    """A joint graph as one compiler runs it: its planning schedule (Inductor fuses pointwise values away),
    candidates and base memory, the memory problem costed by the profile, and each node's roofline terms."""

    schedule: Any
    planning: PlanningGraph
    problem: MemoryProblem
    terms: Callable[[fx.Node], tuple[float, float]]

    @classmethod
    def of(cls, job: GraphJob, joint: fx.GraphModule, num_fwd_outputs: int, compiler: str, profile: HardwareProfile,
           costs: dict, calibration: Any) -> _PlanningView:
        schedule = planning_schedule(
            joint,
            num_fwd_outputs=num_fwd_outputs,
            parameter_indices=job.parameter_indices,
            compiler=compiler,
            analyses=job.ctx.analyses,
        )
        schedule = job.with_workspace(schedule, compiler)
        planning = job.ctx.analyses.get(planning_graph, schedule)
        no_cost = NodeCost(0, 0, 0)
        fused = schedule.fused

        def terms(node: fx.Node) -> tuple[float, float]:
            """The node's roofline terms (compute, memory) by the profile."""
            cost = costs.get(node, no_cost)
            if node in fused:  # computed inside its readers' kernel: its own bytes never go through memory
                cost = NodeCost(cost.flops, 0, 0)
            return roofline_terms(cost, value_dtype(node), profile)

        def seconds(node: fx.Node) -> float:
            return combine_seconds(*terms(node), profile, calibration)

        # Offload is a host link's: the profile's (a GPU profile plans offloads even for a graph traced on CPU).
        if profile.host_to_device is None:
            return cls(schedule, planning, planning.memory_problem(seconds), terms)
        problem = planning.memory_problem(
            seconds, lambda nbytes: transfer_seconds(nbytes, profile), offload_ops_seconds(profile)
        )
        return cls(schedule, planning, problem, terms)


def _solve_knowing(job: GraphJob, problem: MemoryProblem, context: StepContext | None,
                   target: int) -> tuple[StepContext | None, Solution, MemoryProblem]:
    """`_solve_in_step`, where the step planner passed what plans of this graph compiled before held beyond the
    plan model (`StepContext.known_excess`): a plan one of those puts over `target` is planned again with it
    counted (`solve_knowing`), as reading its compiled graphs would make this compile do (`hold_to_budget`),
    and as the step planner planned it (`GraphStep.solve`). Returns the context and plan, and the problem
    planned with (`job.schedule_excess` counts what was added)."""
    known = {code: dict(excess) for code, excess in context.known_excess} if context is not None else {}
    if not known:
        return (*_solve_in_step(problem, context, target, job.sharing), problem)
    first = dict(job.schedule_excess)
    found: list[tuple[StepContext | None, Solution, MemoryProblem]] = []

    def solve(excess: Mapping[str, int]) -> tuple[tuple[str, ...], bool]:
        planned = problem if excess == first else job.problem.with_excess(excess)
        found.append((*_solve_in_step(planned, context, target, job.sharing), planned))
        return found[-1][1].decisions, found[-1][1].feasible

    def over(decisions: Sequence[str], held: Mapping[str, int]) -> bool:
        held_problem = job.problem.with_excess(held, planning=True)
        return plan_memory(in_step(held_problem, found[-1][0], target), decisions).peak_bytes > target

    job.schedule_excess, _ = solve_knowing(known, first, solve, over)
    return found[-1]


def _solve_in_step(problem: MemoryProblem, context: StepContext | None, target: int,
                   sharing: Any) -> tuple[StepContext | None, Solution]:
    """The plan within `target` in `context`, and the context it was solved in. In the step's first run
    (`StepContext.first_step`), the plan keeps saved the candidates that would read a buffer the step may free,
    unless only a plan that recomputes one of them fits (no first step is put over a budget it would meet);
    without a context (the step's first graph, or a graph alone), those that would read one of its outputs
    (`GraphStep.observing`: a plan that reads a loss's logits keeps them alive through the backward, and the
    step recorder cannot see whether the loop dropped them; on GPT-J, Mixtral and OLMo the plans were
    predicted 5-10% over what they measured)."""

    def solve(trial: StepContext | None) -> tuple[StepContext | None, Solution]:
        if trial is not None and trial.hold_least:  # the first step, its order unknown: hold least
            cap = least_held_cap(problem, trial, target, fits)
            trial = dataclasses.replace(trial, boundary_cap=cap, hold_least=False)
        return trial, solve_or_measure(in_step(problem, trial, target), target)

    if context is None:  # the step's first graph, or one alone: its outputs only (its inputs are the loop's)
        readers = sharing.output_readers() if sharing is not None else frozenset()
        observed = StepContext(keep_saved=tuple(sorted(readers)))
    elif context.first_step:
        readers = {name for f in sharing.freeable for name in f.readers} - set(context.keep_saved)
        observed = dataclasses.replace(context, keep_saved=(*context.keep_saved, *sorted(readers)))
    else:
        return solve(context)
    if not readers:
        return solve(context)
    trial, observing = solve(observed)
    observing = (trial if context is not None else None, observing)  # without a context, the caller's stays None
    if observing[1].feasible:
        return observing
    free = solve(context)
    return free if free[1].feasible else observing


def plan_memory_budget(
    job: GraphJob, joint: fx.GraphModule, num_fwd_outputs: int, torch_plan: TorchPlan | None = None,
    torch_levels: TorchLevelsOf | None = None,
) -> tuple[PlanningGraph, TorchPartition | None]:
    """Candidates, cost model and solver: write the plan's decisions for the budget into `job.plan`.

    No cost at no pressure: if `torch_plan` is given, `torch_plan_refusal` allows it, and torch's own partition
    fits the budget, that partition is the plan (`Plan.torch_plan`), nothing is solved, and it is returned
    beside the planning graph for the partition stage to compile (else None). `torch_levels`: how a stand-in's
    step view makes torch's partition of its graph (`_step_view`)."""
    ctx, options = job.ctx, job.options
    calibration = options.calibration  # given (fitted to measured steps, `fit_step_calibration`), or:
    if calibration is not None:
        job.record.calibration = {**dataclasses.asdict(calibration), "source": "option"}
    if options.calibrate:
        with ctx.instrumented("plan", "calibrate"):
            resolved = job.hardware_profile(graph_device(joint))
            costs = ctx.analyses.get(op_cost, joint).per_node
            calibration = graph_calibration(job, joint, costs, resolved.profile, resolved.hash)
    with ctx.instrumented("plan", "candidates"):
        device = graph_device(joint)
        resolved = job.hardware_profile(device)
        profile = resolved.profile
        costs = ctx.analyses.get(op_cost, joint).per_node
        view = _PlanningView.of(job, joint, num_fwd_outputs, options.compiler, profile, costs, calibration)
        schedule, planning, terms = view.schedule, view.planning, view.terms
        job.problem = view.problem
        job.sharing = step_sharing(planning, num_fwd_outputs)
        job.schedule_node_names = tuple(n.name for n in schedule.nodes)
    if options.stands_in_for is not None and job.record.mode == "training" and not job.has_step_view:
        # A stand-in: the step is planned with the graph as the compiler it stands in for will run it (built
        # once, at its first use: a re-plan traces the same joint graph), from a copy of this joint graph
        # (the partition changes the graph it is given).
        # Built later under this compile's size hints and fake mode (the first read can come inside another
        # graph's compile). Where ranks agree on plans it is built now: its workspace table is agreed on by
        # every rank (a collective), which only compiles reach alike on every rank.
        source = copy_graph_module(joint)
        hints = options.size_hints
        fake_mode = detect_fake_mode([n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")])

        def build() -> StepView | None:
            with ctx.instrumented("plan", "step_view"), size_hints(hints):
                return _step_view(job, source, num_fwd_outputs, device, profile, calibration, fake_mode,
                                  torch_levels, hints)

        if job.agreeing_ranks:
            job.step_view = build()
        else:
            job.defer_step_view(build)
    with ctx.instrumented("plan", "candidates"):
        job.measured_excess, job.carried_excess = {}, 0
        job.record.fusions_refused = 0
        # Under Inductor, after a re-plan: the bytes its schedule held beyond the model (zero at first).
        problem = job.problem.with_excess(job.schedule_excess)
        budget = planning_budget(job, device, planning.resident_bytes, profile)
    # No cost at no pressure: torch's own partition, if it fits.
    context = options.step_context
    kept = partition = job.torch_levels = None
    refusal = torch_plan_refusal(job) if torch_plan is not None else "not offered"
    if refusal is None:
        with ctx.instrumented("plan", "torch_partition"):
            partition = torch_plan(planning)
            kept = _torch_solution(job, job.problem, context, partition, budget) if partition is not None else None
        if partition is not None:
            job.torch_levels = TorchLevels.of(job.problem, partition.decisions, partition.excess)
    else:
        log.debug("%s: torch's own partition is not tried: %s", job.record.graph, refusal)
    with ctx.instrumented("plan", "solve"):
        # A graph whose backward reads nothing of the forward has nothing to decide.
        # Plans are held to the budget less an allowance for memory kernels allocate inside themselves.
        target = job.target  # the budget less a workspace allowance (or the step plan's, `StepContext.target`)
        # In a step of several graphs: the others' bytes around this one, and the cap on what it holds
        # between its forward and backward (`cost/step_model.py`).
        if kept is not None:
            solution = kept
        else:
            context, solution, problem = _solve_knowing(job, problem, context, target)
            # The prediction: this graph's peak in its step (the cap is a bound, not bytes alive).
            solution = dataclasses.replace(
                solution, peak_bytes=plan_memory(job.in_step(problem, capped=False, decisions=solution.decisions),
                                                 solution.decisions).peak_bytes
            )
    if has_symbolic_shapes(joint):
        # Planned for the sizes the shape symbols are evaluated at: the traced ones, or the size bucket's a
        # runtime variant is compiled for (`runtime/variants.py`); larger calls get their own variant.
        job.sizes = planned_sizes(joint, options.size_hints)
        log.info("%s: dynamic shapes, planned for sizes %s", job.record.graph, job.sizes)
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
    peak_step = plan_memory(job.in_step(problem, capped=False, decisions=decisions), decisions).peak_step
    ctx.plan = dataclasses.replace(
        job.plan.with_values(values),
        budget_bytes=budget,
        hardware=f"{profile.device_key}#{resolved.hash}",
        predicted_peak_bytes=solution.peak_bytes,
        feasible=solution.feasible,
        peak_node=schedule.nodes[peak_step].name if peak_step >= 0 else None,
        torch_plan=solution.solver == TORCH_SOLVER,
    )
    record = job.record
    record.budget_bytes, record.plan_feasible, record.solver = budget, solution.feasible, solution.solver
    if device.type == "cuda":
        record.predicted_reserved_bytes = predicted_reserved(solution.peak_bytes, int(torch.cuda.memory_reserved(device)),
                                                             expandable_segments_on(), job.reserved_cap_bytes)
    record.step_context = dataclasses.replace(context, hold_least=options.step_context.hold_least).to_json() if context else None
    record.hardware_profile = f"{profile.device_key}: {resolved.describe()}"
    record.planned_for = profile.device_key if profile.device_type != device.type else None
    record.recomputed_values = decisions.count(RECOMPUTE)
    record.offloaded_values = decisions.count(OFFLOAD)
    record.plan_added_seconds = solution.added_seconds
    record.recompute_terms = recompute_terms(
        [terms(n) for c, d in zip(planning.candidates, decisions) if d == RECOMPUTE for n in c.recompute_nodes]
    )
    job.finish()
    # After a re-plan the excess counted is another plan's: a plan the solver finds over may still fit once
    # its own compiled graphs are read. It is compiled, and `hold_to_budget` decides. So is a lowest plan
    # the model finds barely over (`within_reach`): its compiled graphs can hold less than the model.
    job.provisional = not solution.feasible and (
        job.record.replans > 0 or (context is None and within_reach(solution.peak_bytes, job.target))
    )
    if not solution.feasible and not job.provisional:
        message = (
            f"{describe_budget(budget)} cannot be met for {record.graph}{at_sizes(job.sizes)}: the smallest peak "
            f"dpcs can reach is {format_bytes(solution.peak_bytes)} ({solution.peak_bytes} B), with "
            f"{decisions.count(SAVE)} values saved, {record.recomputed_values} recomputed and "
            f"{record.offloaded_values} offloaded (+{solution.added_seconds * 1e3:.2f} ms per step estimated)"
        )
        if any(v > 0 for v in job.schedule_excess.values()):
            message += (
                f", counting what the compiled graphs of an earlier plan held beyond the plan model (forward "
                f"{max(job.schedule_excess['forward'], 0)} B, backward {max(job.schedule_excess['backward'], 0)} B)"
            )
        if job.defers_infeasible(solution.peak_bytes, message):
            pass  # the step decides, once it is seen whether it drops the outputs
        elif options.on_infeasible == "error":
            raise BudgetInfeasibleError(
                f"{message}; raise the budget, or pass on_infeasible='best' to compile that plan"
                + (f" (plan: {record.dump_dir}/plan.json)" if record.dump_dir else "")
            )
        else:
            warnings.warn(f"{message}; compiling that plan (on_infeasible='best')", category=DpcsWarning, stacklevel=2)
    log.info(
        "%s: budget %d B, plan peak %d B (%s), %d recomputed, %d offloaded",
        record.graph, budget, solution.peak_bytes, "fits" if solution.feasible else "over",
        record.recomputed_values, record.offloaded_values,
    )
    return planning, (partition if kept is not None else None)

