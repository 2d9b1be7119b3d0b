"""What dpcs did for each graph it compiled in this process: the numbers behind summaries and dumps."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class CompileRecord:
    graph: str  # "graph_000", unique in the process
    compile_id: str | None = None  # Dynamo's "frame/compile" id of the graph, when compiled under Dynamo
    attempt: int = 0  # Dynamo's attempt at that compile (a restarted analysis compiles again)
    mode: str = "training"  # or "inference"
    compiler: str = "inductor"
    dynamo_nodes: int = 0
    joint_nodes: int = 0
    forward_nodes: int = 0
    backward_nodes: int = 0
    backward_order: str = "autograd"  # the backward's node order compiled: autograd's, or a sunk one (`backward_order`)
    # Under Inductor, the lowest plan: each candidate's scheduled backward peak above its start ({"autograd": B,
    # "sunk": B, "autograd, producers apart": B, ...}), the lowest compiled (the guard's rule only where
    # it is lower than Inductor's fusions by more than the measurement tolerance) (`PartCompiler.lowest_scheduled_backward`); None: not scheduled as candidates.
    backward_order_scheduled: dict[str, int | None] | None = None
    # The producer/consumer fusions of the backward compiled: Inductor's, or "producers apart" (the fusion
    # guard's rule, when Inductor's schedule of it is measurably lower: `PartCompiler.lowest_scheduled_backward`).
    backward_fusion: str = "inductor"
    saved_values: int = 0
    saved_bytes: int = 0
    resident_bytes: int = 0
    predicted_peak_bytes: int | None = None
    peak_node: str | None = None
    total_flops: int = 0
    symbolic_shapes: bool = False
    pass_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    option_sources: dict[str, str] = dataclasses.field(default_factory=dict)  # option -> "code", "DPCS_OPTIONS ..."
    dump_dir: str | None = None
    fallback: str | None = None  # the error that made this graph fall back to plain Inductor
    # The memory plan (set only when a memory_budget is given):
    budget_bytes: int | None = None  # on CUDA the allocated bytes plans are held to: the budget less the allocator's
    # share (`cost.budget.allocator_slack`); `reserved_budget_bytes` is the budget itself, on what it reserves
    reserved_budget_bytes: int | None = None
    reserved_cap_bytes: int | None = None  # CUDA: the process's cap on reserved bytes after dpcs set it to the budget
    predicted_reserved_bytes: int | None = None  # CUDA: the caching allocator's reserved peak expected with the plan
    plan_feasible: bool | None = None  # the plan's predicted peak is within the budget
    # A graph planned alone whose budget no plan meets while its outputs count alive through its backward, but
    # might if the step's code drops them (a loss's logits): the verdict (on_infeasible's error or warning), left
    # to the step, which sees whether they are dropped (`step/`); None once given or never deferred.
    infeasible_deferred: str | None = None
    solver: str | None = None
    recomputed_values: int = 0
    offloaded_values: int = 0
    plan_added_seconds: float | None = None  # estimated recompute, exposed copy and offload-op host time per step
    # What the plan recomputes by the profile's uncalibrated roofline ({"compute_s", "memory_s", "ops"}): with a
    # measured step time, one sample of `cost.calibration.fit_step_calibration` (`StepSample.of`).
    recompute_terms: dict[str, float] | None = None
    # The hardware profile the plan was costed with: "<device key>: <where it came from> #<short hash>", and
    # the device it describes when that is another kind than the graph's (a GPU planned for from a CPU: the
    # predicted peak is that device's, not measurable here).
    hardware_profile: str | None = None
    planned_for: str | None = None
    plan_hash: str | None = None  # the plan's hash (`Plan.plan_hash`): equal hashes, equal compiled graphs
    partition_peak_bytes: int | None = None  # the same plan simulated on the partitioned graphs (a check)
    # Inductor only: bytes its fused schedule of each graph holds beyond the modelled FX order (measured on
    # the scheduler, >= 0 counts against the budget), and how often the plan was re-made for them.
    forward_schedule_excess_bytes: int | None = None
    backward_schedule_excess_bytes: int | None = None
    replans: int = 0
    # In a training step of several graphs (`cost/step_model.py`): what the others hold around this one, as
    # planned with (forward_bytes, backward_bytes, boundary_cap); None: planned alone.
    step_context: dict[str, Any] | None = None
    variant_of: str | None = None  # a runtime / step variant: the graph first compiled from the same Dynamo graph
    fusions_refused: int = 0  # Inductor horizontal fusions refused across allocations (passes/rewrite/fusion_guard)
    # Option `calibrate`: the roofline fit to this graph's own ops the plan was costed with (compute_scale,
    # memory_scale, overhead_s, samples, seconds); option `calibration`: the one given; None: the hardware
    # profile's roofline (`stages/calibrate.py`).
    calibration: dict[str, Any] | None = None
    # Precision (solve/precision.py): the graph's low dtype, ops given a dtype, linears run in fp8.
    precision: str = "fp32"
    cast_ops: int = 0
    fp8_linears: int = 0
    fp8_matmul: str | None = None  # how its fp8 linears run: "scaled_mm", "emulated" ("auto" resolved)
    fp8_select: str | None = None  # "faster" or "all" ("auto" resolved)
    fp8_slower: int = 0  # eligible linears left in the region's dtype: fp8 would be slower at their shape
    recast_parameter_nodes: int = 0  # without a budget: parameter casts made again in backward, not saved
    recomputed_upcasts: int = 0  # without a budget: widening casts made again in backward, not saved

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_RECORDS: list[CompileRecord] = []
_ADDED = [0]  # records ever added (`compile_count`)


def compile_count() -> int:
    """How many compiles have been recorded in this process (counting up, never reset): a change tells
    that something compiled since it was read."""
    return _ADDED[0]


_RAISED = [0]  # compiles that raised inside dpcs, a re-plan's included (`compiles_raised`)


def compiles_raised() -> int:
    """How many dpcs compiles raised an exception it caught, or that it let through (a re-plan, a variant that
    failed), in this process (counting up, never reset): an exception caught in a frame that keeps it (or
    whose traceback holds that frame) makes a reference cycle, which holds the frames that called the compile
    and their locals (a graph's inputs, a model's activations) until a garbage collection
    (`step/calls.py::_compile_marks`)."""
    return _RAISED[0]


def note_compile_raised() -> None:
    _RAISED[0] += 1


def add_record(record: CompileRecord) -> None:
    """Add a record; one for a later attempt at the same Dynamo compile replaces the discarded attempt's."""
    _ADDED[0] += 1
    if record.compile_id is not None:
        _RECORDS[:] = [
            r for r in _RECORDS if not (r.compile_id == record.compile_id and r.attempt < record.attempt)
        ]
    _RECORDS.append(record)


def compile_records() -> list[CompileRecord]:
    """The records of every graph compiled so far in this process, oldest first."""
    return list(_RECORDS)


def records_since(snapshot: list[CompileRecord]) -> list[CompileRecord]:
    """Records added after `snapshot = compile_records()` was taken (by identity: a restarted Dynamo
    attempt replaces its predecessor's record, so counting would miss records)."""
    known = {id(r) for r in snapshot}
    return [r for r in _RECORDS if id(r) not in known]


_ON_CLEAR: list = []  # callables run by clear_compile_records (the step recorder forgets its graphs)


def clear_compile_records() -> None:
    """Forget every record, and the steps learned from the graphs compiled so far (as after
    `torch._dynamo.reset()`, whose graphs are gone)."""
    _RECORDS.clear()
    _STEPS.clear()
    for forget in _ON_CLEAR:
        forget()


@dataclasses.dataclass
class StepRecord:
    """One training step of several graph calls as dpcs planned it (`step/`): its predicted peak,
    one number for the whole step, and where it happens.

    calls: the graph of each forward call of the step where the peak is, in call order (a graph called per
        layer appears per call);
    peak_graph / peak_node / peak_phase: the graph, schedule node and phase at the predicted peak (phase
        "turn": after the step's last forward, where eager code such as a loss runs, before its backward;
        "optimizer": the optimizer step after the step's last backward);
    replanned: the graphs were re-planned for the step (False: their own plans already fit it);
    holds_most: the graph that keeps the most for its backward while the others run.
    """

    step: str  # "step_000", unique in the process
    calls: list[str]
    budget_bytes: int | None
    predicted_peak_bytes: int
    peak_graph: str
    peak_node: str | None
    peak_phase: str
    feasible: bool
    replanned: bool
    holds_most: str | None = None
    outside_bytes: int = 0  # alive throughout the step outside its graphs (earlier micro-batches' gradients)
    turn_bytes: int = 0  # measured at the step's turn (last forward to first backward) in eager code (a loss)
    # The prediction a measured step is checked against: the highest inside the graphs, and at the turn.
    graphs_peak_bytes: int | None = None
    turn_peak_bytes: int | None = None
    end_bytes: int | None = None  # and what the step holds once its backwards ended (an optimizer step starts)
    # Measured in the optimizer step after the step, beyond what it holds at its end (its temporaries, and what
    # the training loop holds then); None: no optimizer step follows the step seen.
    optimizer_bytes: int | None = None
    # Of the predicted peak: the parameter gradients the step made that are alive there (earlier micro-batches'
    # are in `outside_bytes`).
    gradient_bytes: int = 0
    # Of the predicted peak: FSDP2's parameters gathered there (the running block's, and its neighbours' in flight).
    gathered_bytes: int = 0
    shapes: int = 1  # step orders planned for together (a data-dependent branch makes several)
    contexts: dict[str, dict[str, Any] | None] = dataclasses.field(default_factory=dict)
    parameter_bytes: int = 0  # the step's parameters (counted once)
    bucket_bytes: int = 0  # of `outside_bytes`: DistributedDataParallel's gradient buckets
    # The optimizers' state counted through the step (in `outside_bytes`): {"bytes", "chosen"}, and when dpcs
    # chose how the "auto" CompressedOptimizers keep it: "format", "on_host", the seconds it adds, the activation
    # plan's added seconds, and every option weighed ([lever, bytes, seconds]).
    optimizer_state: dict[str, Any] | None = None
    # The step planner's time for this plan (its level search and solves; each graph's compile after it is in
    # its `CompileRecord.pass_seconds`), and how many graph plans it solved.
    planning_seconds: float = 0.0
    solves: int = 0
    # The step's peak inside its graphs and at its turn, predicted again from the variants as they compiled, before
    # the step is measured (None until then): a compile may decide otherwise than the plan it was given, where the
    # plan was made on a first variant's problem that ran uncompiled (`StepRecorder._predict_as_compiled`).
    compiled_peak_bytes: int | None = None
    # No pressure: the graphs were offered torch's own partitions (`StepContext.torch_plan`; each graph's
    # `CompileRecord.solver` says whether it kept its own). The predicted peak is then the model's of the plans
    # the offer was made with (saving everything, or each graph's own partition: `cost.step_search._torch_offer`),
    # within the budget plus each call's runtime allowance (`cost.budget.torch_plan_limit`);
    # `compiled_peak_bytes` is what the compiled graphs predict.
    torch_plans: bool = False

    def split(self) -> dict[str, int]:
        """The predicted peak in parts: parameters (FSDP2: this rank's shards), optimizer state,
        DistributedDataParallel's gradient buckets, other memory alive through the step (gradients of earlier
        micro-batches, memory measured outside the graphs), FSDP2's gathered parameters there, the parameter
        gradients the step made that are alive there, activations (everything else the graphs hold there: saved
        values, their inputs and outputs, gradients of activations), and, when the peak is in the optimizer
        step, what that step allocates on top (its temporaries)."""
        state = (self.optimizer_state or {}).get("bytes", 0)
        buckets = min(self.bucket_bytes, max(0, self.outside_bytes - state))
        other = max(0, self.outside_bytes - state - buckets)
        step = (self.optimizer_bytes or 0) if self.peak_phase == "optimizer" else 0
        rest = self.predicted_peak_bytes - self.parameter_bytes - state - buckets - other - step
        gathered = min(self.gathered_bytes, max(0, rest))
        gradients = min(self.gradient_bytes, max(0, rest - gathered))
        return {"parameters": self.parameter_bytes, "optimizer_state": state, "buckets": buckets, "outside_graphs": other,
                "gathered": gathered, "gradients": gradients, "activations": rest - gathered - gradients,
                "optimizer_step": step}

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "split": self.split()}


_STEPS: list[StepRecord] = []


def add_step_record(record: StepRecord) -> None:
    _STEPS.append(record)


def step_records() -> list[StepRecord]:
    """The training steps of several graphs dpcs planned in this process, oldest first."""
    return list(_STEPS)


STEPS_FILE = "steps.jsonl"  # in a dump folder: one StepRecord per line, as the step planner made them


def predicted_step_peak() -> StepRecord | None:
    """The training step's predicted peak: the latest step plan's record, or, for a step of one training graph
    with a memory plan, a record of that graph's own prediction (None if neither)."""
    if _STEPS:
        return _STEPS[-1]
    training = [r for r in _RECORDS if r.mode == "training" and r.predicted_peak_bytes is not None]
    if not training:
        return None
    r = training[-1]
    return StepRecord(
        step="single graph", calls=[r.graph], budget_bytes=r.budget_bytes, predicted_peak_bytes=r.predicted_peak_bytes,
        peak_graph=r.graph, peak_node=r.peak_node, peak_phase="", feasible=r.plan_feasible is not False, replanned=False,
    )


def describe_step(record: StepRecord | dict[str, Any]) -> str:
    """One line for a step plan: its calls, predicted peak and where, and the budget."""
    from dpcs_compiler.debug.render import format_bytes

    r = record if isinstance(record, dict) else record.to_json()
    calls: dict[str, int] = {}
    for c in r["calls"]:
        calls[c] = calls.get(c, 0) + 1
    if r["peak_phase"] == "turn":
        where = f"at the step's turn, after the forward of {r['peak_graph']} (eager code there included)"
    elif r["peak_phase"] == "optimizer":
        where = f"in the optimizer step after the backward of {r['peak_graph']}"
    else:
        where = f"in {r['peak_graph']}" + (f" {r['peak_phase']}" if r["peak_phase"] else "") + f" at {r['peak_node'] or '?'}"
    budget = "no budget" if r["budget_bytes"] is None else f"budget {format_bytes(r['budget_bytes'])}"
    verdict = "fits" if r["feasible"] else "over budget"
    compiled = r.get("compiled_peak_bytes")
    return (
        f"step ({len(r['calls'])} graph call{'s' if len(r['calls']) != 1 else ''}: "
        f"{', '.join(f'{g} x{n}' if n > 1 else g for g, n in calls.items())}): predicted peak "
        f"{format_bytes(r['predicted_peak_bytes'])} {where}"
        + (f" ({format_bytes(compiled)} as its graphs compiled)"
           if compiled is not None and compiled != r["predicted_peak_bytes"] else "")
        + f"; {budget}, {verdict}"
        + ("; graphs re-planned for the step" if r.get("replanned") else "")
    )
