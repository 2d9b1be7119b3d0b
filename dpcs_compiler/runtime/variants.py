"""Variants of one Dynamo graph, switched between steps without going through Dynamo.

The backend returns a `GraphDispatcher` instead of the compiled graph. It keeps the Dynamo graph, fake
versions of its example inputs and Dynamo's fake mode (their symbolic shapes included), and compiles the
graph under a set of runtime decisions (`Decisions`: precision mode, regions kept in fp32, budget) into a
variant: AOTAutograd and Inductor, as the backend compiles any graph, with the options those decisions give.
A `VariantControl` holds the current decisions and a version number; per call the dispatcher compares one
integer and, only when the version moved, finds or compiles (once, at the first call in the new state, from
the kept fake inputs) the variant of the new decisions. Variants are cached by the options they compile
with (`DpcsOptions.fingerprint`), so switching back to a seen one compiles nothing, and Dynamo never sees a
change: no guard fails, no recompile, `recompile_limit` is never reached.

A step's forward and backward belong to one variant: the backward is the compiled autograd function the
forward returned, so a switch between steps never mixes plans.

Without a Runtime, every dispatcher is bound to `UNBOUND`, whose version never moves: the graph runs the
variant of its compile options, exactly as before runtimes existed. A Runtime binds the dispatchers of the
graphs that take its model's parameters (`bind`), and a graph compiled after the Runtime was made binds at
compile time, so a resumed run compiles the restored variant first; a graph compiled from fake parameters
(the pieces DDP's graph splitting compiles) binds at its first call, from the real ones.
"""

from __future__ import annotations

import dataclasses
import dis
import fnmatch
import sys
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from dpcs_compiler.cost.op_time import Calibration
from dpcs_compiler.cost.step_model import StepContext, decisions_code
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.options import DpcsOptions, Fp8Options
from dpcs_compiler.passes.analysis.op_sites import module_stack
from dpcs_compiler.passes.infra import copy_graph_module
from dpcs_compiler.distributed.rank_agreement import graph_fingerprint
from dpcs_compiler.report import CompileRecord, compile_records, note_compile_raised, records_since
from dpcs_compiler.runtime.decisions import Decisions
from dpcs_compiler.stages.job import PlanningError, job_of
from dpcs_compiler.step import STEPS

log = logging.getLogger("dpcs.runtime")

# compile(graph, example inputs, options, fallback) -> the compiled callable; `fallback`: a failure may be
# compiled by plain Inductor (the first compile of a graph) instead of raising.
CompileFn = Callable[[fx.GraphModule, Sequence[Any], DpcsOptions, bool], Callable]


@dataclasses.dataclass
class CompileEvent:
    """One variant of one graph compiled (or failed to), for logs and telemetry."""

    graph: str  # the dispatcher's name (its first record's graph name)
    variant: str  # Decisions.key() of the decisions it was compiled for
    decisions: str  # Decisions.describe()
    seconds: float
    plan_hashes: list[str]
    feasible: bool | None  # the memory plan fits its budget (None: no budget)
    predicted_peak_bytes: int | None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class VariantControl:
    """The decisions every bound graph compiles to, and a version that moves when they change.

    `decisions` None means each graph's compile options as they are. `references` holds, per graph
    (`graph_fingerprint`), the bytes a budget scale multiplies: the graph's compiled budget, or the peak its
    unscaled plan predicted without one; it is part of a runtime's state, so a resumed run scales the same
    bytes.
    """

    def __init__(self) -> None:
        self.version = 0
        self.decisions: Decisions | None = None
        self.references: dict[str, int] = {}
        self.events: list[CompileEvent] = []  # drained by the runtime's telemetry
        self.dispatchers: weakref.WeakSet[GraphDispatcher] = weakref.WeakSet()

    def set(self, decisions: Decisions | None) -> bool:
        """Make `decisions` current; True if they changed (every bound graph switches at its next call)."""
        if decisions == self.decisions:
            return False
        self.decisions = decisions
        self.version += 1
        return True


class _Unbound(VariantControl):
    """The control of graphs no Runtime drives: its version never moves."""

    def set(self, decisions: Decisions | None) -> bool:
        raise RuntimeError("graphs without a Runtime keep their compile options")


UNBOUND = _Unbound()
_dispatchers: weakref.WeakSet[GraphDispatcher] = weakref.WeakSet()
# id(parameter) -> (the parameter, the control of the Runtime that drives the model holding it), both weakly:
# an id is checked against its parameter, as a dead parameter's id is reused.
_controls_by_parameter: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[VariantControl]]] = {}


def register_parameters(control: VariantControl, parameters: Iterable[torch.Tensor]) -> list[GraphDispatcher]:
    """Drive the graphs that take any of `parameters` by `control`: graphs compiled later bind when they
    compile; those already compiled bind now. Returns the dispatchers bound now."""
    parameters = list(parameters)
    for p in parameters:
        _controls_by_parameter[id(p)] = (weakref.ref(p), weakref.ref(control))
    bound = []
    for dispatcher in list(_dispatchers):
        if any(dispatcher.takes(p) for p in parameters):
            dispatcher.bind(control)
            bound.append(dispatcher)
    return bound


def unregister_parameters(control: VariantControl) -> None:
    """Release the graphs `control` drives: they return to their compile options."""
    for pid, (_, ref) in list(_controls_by_parameter.items()):
        if ref() is control or ref() is None:
            del _controls_by_parameter[pid]
    for dispatcher in list(control.dispatchers):
        dispatcher.bind(UNBOUND)


def _control_for(parameters: Iterable[torch.Tensor]) -> VariantControl:
    for p in parameters:
        entry = _controls_by_parameter.get(id(p))
        if entry is not None and entry[0]() is p and (control := entry[1]()) is not None:
            return control
    return UNBOUND


def live_dispatchers() -> list[GraphDispatcher]:
    return list(_dispatchers)


def fake_inputs(fake_mode: Any, example_inputs: Sequence[Any]) -> list[Any]:
    """The graph's inputs as fake tensors of `fake_mode` (Dynamo's: the fakes it traced with, symbolic sizes
    and all); other inputs (SymInts, numbers) as they are."""
    return [fake_mode.from_tensor(x, static_shapes=False) if isinstance(x, torch.Tensor) else x for x in example_inputs]


def variant_options(base: DpcsOptions, decisions: Decisions | None, modules: frozenset[str], reference: int | None) -> DpcsOptions:
    """The compile options of `decisions` for a graph compiled with `base` whose ops run in `modules`.

    fp8 mode: fp8 linears (the base's fp8 settings, else the defaults) on the base's 16-bit dtype, else bf16.
    Regions kept in fp32 that name no module of this graph are left out (they live in another graph). A
    budget the runtime sets is planned with on_infeasible="best": the tightest plan, with a warning, rather
    than an error in the middle of a training step.
    """
    if decisions is None:
        return base
    mode = decisions.precision
    precision = mode if mode != "fp8" else (base.precision if base.precision != "fp32" else "bf16")
    fp8 = (base.fp8 or Fp8Options()) if mode == "fp8" else None
    # A region's own name, and its children's where it has some (a pattern that names nothing would warn).
    patterns = [p for r in decisions.fp32_regions for p in (r, r + ".*") if p in modules or fnmatch.filter(modules, p)]
    keep = tuple(dict.fromkeys([*base.keep_fp32, *patterns]))
    changes: dict[str, Any] = {"precision": precision, "fp8": fp8, "keep_fp32": keep}
    if decisions.budget_bytes is not None:
        changes.update(memory_budget=decisions.budget_bytes, on_infeasible="best")
    elif decisions.budget_scale is not None:
        if reference is None:
            raise ValueError("a budget scale needs the graph's reference bytes")
        changes.update(memory_budget=max(1, int(reference * decisions.budget_scale)), on_infeasible="best")
    if decisions.calibration is not None and changes.get("memory_budget", base.memory_budget) is not None:
        # Fitted to measured steps: replaces a per-op calibration. A graph without a budget has no plan to
        # cost (and is not compiled again for it).
        compute, memory, overhead = decisions.calibration
        changes.update(calibration=Calibration(compute, memory, overhead), calibrate=False)
    return dataclasses.replace(base, **changes)



_RETURNS = frozenset({"RETURN_VALUE", "RETURN_CONST"})
_DYNAMO_ENTRIES = frozenset({"compile_wrapper", "_fn"})  # torch._dynamo.eval_frame's wrappers of a compiled callable


def _frames_inside_compiled_callable() -> list | None:
    """The frames running inside the torch.compile'd callable (`torch._dynamo.eval_frame`'s wrapper) above the
    compile now under way, innermost first, torch's and dpcs's own left out except the callable itself (the
    wrapper's callee: `Module._wrapped_call_impl` of a compiled module); None outside a wrapper."""
    import os

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    own_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frames, callee = [], None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(torch_dir):
            if code.co_name in _DYNAMO_ENTRIES and code.co_filename.endswith(os.path.join("_dynamo", "eval_frame.py")):
                if callee is not None and (not frames or frames[-1] is not callee):
                    frames.append(callee)
                return frames
        elif not code.co_filename.startswith(own_dir):
            frames.append(frame)
        callee = frame
        frame = frame.f_back
    return None


def more_of_frame_follows() -> bool:
    """Whether the graph being compiled is called from code inside the compiled callable that goes on after
    it returns: then the graph's saved values stay alive while more graphs (or eager code) of the step run,
    as at a graph break, though the graph itself ends normally.

    A graph break inside a nested call (a forward hook, a layer loop: Hugging Face models break there) leaves
    Dynamo compiling the inner frames whole (`compile_subgraph_reason` "return_value", not a graph break),
    called from the outer frames running eagerly or as Dynamo's transformed code. Those callers are the
    frames between the compile and torch.compile's wrapper (`torch._dynamo.eval_frame`), torch's and dpcs's
    own aside; one whose next instruction is not a return goes on. A resume function after a graph break is
    called as its frame's return value: not "more". Outside a wrapper (no caller known): False."""
    frames = _frames_inside_compiled_callable()
    if frames is None:
        return False
    import os

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    # Every frame of the user's code counts, the compiled function's own included (a compiled module's
    # callee is torch's `Module._wrapped_call_impl`, which only returns what its forward returned).
    return any(_goes_on(f) for f in frames if not f.f_code.co_filename.startswith(torch_dir))


def compiled_root_module() -> torch.nn.Module | None:
    """The module torch.compile compiled, when the graph being compiled runs inside one (None for a compiled
    function): its parameters are the step's even where only eager code reads them."""
    frames = _frames_inside_compiled_callable()
    if not frames or frames[-1].f_code.co_name != "_wrapped_call_impl":
        return None
    root = frames[-1].f_locals.get("self")
    return root if isinstance(root, torch.nn.Module) else None


def _goes_on(frame) -> bool:
    following = next((i for i in dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti), None)
    return following is not None and following.opname not in _RETURNS


class GraphDispatcher:
    """What the backend returns for one Dynamo graph: the current variant, switched by its control."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: DpcsOptions, compile_fn: CompileFn) -> None:
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.options = options
        self.compile_fn = compile_fn
        # Kept to compile other variants: the graph as Dynamo made it, and fake inputs in Dynamo's fake mode
        # (symbolic sizes and all; no real tensor is kept alive).
        self.graph_module = copy_graph_module(gm)
        self.fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
        try:
            self.fake_inputs: list[Any] | None = fake_inputs(self.fake_mode, example_inputs)
        except Exception as error:  # an input fake tensors cannot stand for: the graph keeps its first variant
            self.fake_inputs = None
            self.no_variants = f"its inputs cannot be kept as fake tensors ({type(error).__name__}: {error})"
            log.warning("%s; a Runtime cannot switch this graph to other variants", self.no_variants)
        # The parameters it takes, weakly (a dead parameter's id is reused): `takes`, `parameter_ids`.
        self.parameter_refs = {
            id(p): weakref.ref(p) for p in [*(x for x in example_inputs if isinstance(x, torch.nn.Parameter)), *gm.parameters()]
        }
        self.modules = frozenset(m for node in gm.graph.nodes for m in module_stack(node) if m)
        self.fingerprint = graph_fingerprint(gm.code, example_inputs)
        self.name = "graph"
        self.variants: dict[str, Callable] = {}  # by options fingerprint
        self.records: dict[str, list[CompileRecord]] = {}
        self.compiles = 0
        self.events: list[CompileEvent] = []  # every variant this graph compiled
        self.own_reference: int | None = None  # its unscaled plan's budget, or predicted peak without one
        self.control: VariantControl = UNBOUND
        # Step planning (`step/`): the context the step planner gave this graph, under which
        # decisions, and whether the step recorder is watching its calls.
        self.step_contexts: dict[tuple[int, ...], StepContext] = {}  # by size bucket
        self.provisional: set[tuple[int, ...]] = set()  # buckets whose context was set before the step was known
        # Buckets whose step the step planner has planned: until then a first plan that holds least (the graph
        # ends at a graph break) runs uncompiled (`_variant`).
        self.step_planned: set[tuple[int, ...]] = set()
        self.step_context_for: Decisions | None = None
        # Dynamic shapes: the shape symbols of the inputs, their traced sizes and the size bucket of the
        # current call; each bucket is its own variant, planned for the bucket's sizes (`size_bucket`).
        # (Without a memory budget no plan depends on the sizes: one variant serves them all.)
        self.size_symbols = size_symbols(self.fake_inputs or ()) if options.memory_budget is not None else ()
        self.traced_sizes = tuple(s.traced for s in self.size_symbols)
        self.bucket = self.traced_sizes
        self.buckets_seen = {self.bucket}
        self.jobs: dict[str, list[Any]] = {}  # variant key -> the jobs that compiled it (their memory problems)
        self._watch = False
        self._control_version = -1
        self.bind(_control_for(p for ref in self.parameter_refs.values() if (p := ref()) is not None))
        # The first variant compiles now, inside Dynamo's compile (its tracing context current), from the
        # inputs Dynamo gave, as a backend without runtimes would.
        self.current_key = ""
        self.root: weakref.ref[torch.nn.Module] | None = None
        self.forward_only = False  # a watched call made no autograd graph (`StepRecorder.call`)
        self.participates = participates = options.memory_budget is not None and options.budget_scope == "step"
        if participates:
            # Before the step's order is known (the step planner plans it again after the step): compiled in the
            # middle of a step, planned against what the graphs that ran before it hold; ending at a graph break,
            # so more graphs follow while it holds what it saved, planned to hold least.
            # The module compiled: its parameters are alive through the step, read by a graph or not.
            root = compiled_root_module()
            self.root = weakref.ref(root) if root is not None else None
            follows = getattr(getattr(gm, "compile_subgraph_reason", None), "graph_break", False) or more_of_frame_follows()
            # What it takes: its inputs, and its own parameters where Dynamo kept modules in the graph.
            takes = [*example_inputs, *gm.parameters()]
            provisional = STEPS.provisional_context(takes, root, follows)
            # The step's first graph: what the step holds around it from its first run on (optimizer state to
            # come, on CUDA what the process holds beside it), kept as a graph alone's own (not provisional).
            first = STEPS.first_graph_context(takes, root, follows) if not STEPS.calls else None
            if follows:
                provisional = dataclasses.replace(provisional or first or StepContext(), hold_least=True)
            if provisional is not None:
                self.step_contexts[self.bucket] = provisional
                self.provisional.add(self.bucket)
            elif first is not None:
                self.step_contexts[self.bucket] = first
            self.step_context_for = self.control.decisions
        with warnings.catch_warnings():
            if self.step_context is not None:  # the step is planned as a whole after its first run
                warnings.filterwarnings("ignore", message=r".*(cannot be met|fits memory_budget).*")
            self._fn = self._variant(self.control.decisions, example_inputs)
        # The first call looks at the real inputs once: graphs that got fake parameters at compile time (DDP's
        # graph splitting compiles its pieces from fake tensors) bind to their runtime there.
        self._first_call = True
        self._version = -1
        _dispatchers.add(self)
        if participates:
            STEPS.arm(self)

    def takes(self, parameter: torch.Tensor) -> bool:
        """Whether this graph takes `parameter` (as an input or as its own)."""
        ref = self.parameter_refs.get(id(parameter))
        return ref is not None and ref() is parameter

    @property
    def parameter_ids(self) -> frozenset[int]:
        """The ids of the live parameters it takes."""
        return frozenset(i for i, ref in self.parameter_refs.items() if ref() is not None)

    def bind(self, control: VariantControl) -> None:
        self.control.dispatchers.discard(self)
        if self.control is UNBOUND and control is not UNBOUND:
            control.events.extend(self.events)  # what it compiled before it was bound (the runtime reports it)
        self.control = control
        control.dispatchers.add(self)
        self._version = -1  # select at the next call (a known variant compiles nothing)

    @property
    def step_context(self) -> StepContext | None:
        """The step planner's context for this graph at the current size bucket."""
        return self.step_contexts.get(self.bucket)

    def __call__(self, *args: Any) -> Any:
        if self.size_symbols:
            bucket = tuple(size_bucket(args[s.arg][s.dim] if s.dim is not None else args[s.arg], s.traced) for s in self.size_symbols)
            if bucket != self.bucket:
                self.bucket = bucket
                self._version = -1  # another size bucket: its own variant
                if bucket not in self.buckets_seen:
                    self.buckets_seen.add(bucket)
                    if self.participates:
                        STEPS.arm(self)  # its step at these sizes is planned anew
        if self._version != self.control.version:
            self._select(args)
        if self._watch:
            return STEPS.call(self, args)
        if self.participates and torch.is_grad_enabled():
            STEPS.glance(self)
            if self._watch:  # an order not planned for: this step is watched from its start
                return STEPS.call(self, args)
        return self._fn(*args)

    def set_step_context(self, context: StepContext | None) -> None:
        """Plan this graph inside its training step from its next call on (None: alone), under the current
        runtime decisions (another decision plans it alone until the step is planned again)."""
        if context is None:
            self.step_contexts.pop(self.bucket, None)
        else:
            self.step_contexts[self.bucket] = context
        self.provisional.discard(self.bucket)
        self.step_context_for = self.control.decisions
        self._version = -1

    def step_was_planned(self) -> None:
        """The step planner planned this graph's step at its current sizes: a first plan that ran uncompiled is
        compiled by the final compiler from its next call on (under whatever context it has now)."""
        if self.bucket not in self.step_planned:
            self.step_planned.add(self.bucket)
            self._version = -1

    def current_job(self) -> Any | None:
        """The job that compiled the current variant's training graph (None: gone, or fell back)."""
        return next((j for j in self.jobs.get(self.current_key, ()) if j is not None and j.problem is not None), None)

    def step_graph(self, credit: bool = False, as_compiled: bool = False) -> Any | None:
        """(GraphStep, decisions) of the current variant, for the step planner; None without a memory plan.
        `credit`: as its compile judged it, inside a step offered torch's partitions; `as_compiled`: predicting
        the compiled step (`GraphJob.step_graph`)."""
        job = self.current_job()
        if job is None:
            return None
        return job.step_graph(held_excess=self.bucket not in self.provisional, credit=credit, as_compiled=as_compiled,
                              known=self.known_excess(job))

    def known_excess(self, job: Any) -> dict[str, dict[str, int]]:
        """What the compiled graphs of this graph's plans held beyond the plan model, by `decisions_code`, as its
        compiles read them (each variant's plan, and those it planned again from, `GraphJob.read_excess`): those
        for the sizes and candidates of `job`, the latest reading of a plan standing."""
        names = tuple(c.name for c in job.problem.candidates)
        known: dict[str, dict[str, int]] = {}
        for jobs in self.jobs.values():
            for j in jobs:
                if (j is None or j.problem is None or j.options.stands_in_for is not None
                        or j.options.size_hints != job.options.size_hints
                        or tuple(c.name for c in j.problem.candidates) != names):
                    continue
                known.update(j.read_excess)
                if j.held_excess is not None:
                    known[decisions_code(j.plan.decisions)] = dict(j.held_excess)
        return known

    @property
    def reference(self) -> int | None:
        """The bytes a budget scale multiplies: the control's (restored with a runtime's state), else what this
        graph's unscaled plan gave, which then becomes the control's (a graph compiled before it was bound)."""
        reference = self.control.references.get(self.fingerprint)
        if reference is None and self.own_reference is not None:
            reference = self.control.references[self.fingerprint] = self.own_reference
        return reference

    def _select(self, args: Sequence[Any]) -> None:
        if self._first_call:
            from torch._subclasses.fake_tensor import is_fake

            params = [x for x in args if isinstance(x, torch.nn.Parameter)]
            if not any(is_fake(p) for p in params):  # DDP's graph splitting runs the pieces on fakes first
                self._first_call = False
                self.parameter_refs.update((id(p), weakref.ref(p)) for p in params)
                if self.control is UNBOUND and params:
                    self.bind(_control_for(params))
        version = self.control.version
        if version != self._control_version:
            if self._control_version >= 0 and self.step_context is not None:
                STEPS.arm(self)  # another variant: the step is planned again for it
            self._control_version = version
        try:
            self._fn = self._variant(self.control.decisions, None)
        except Exception as error:
            if self.options.strict:
                raise
            if not self.options.falls_back:  # under a budget the current variant may not fit what was decided
                raise PlanningError(
                    f"dpcs could not compile {self.name} for the runtime's decisions "
                    f"({self.control.decisions.describe() if self.control.decisions else 'compile options'}) under "
                    f"memory_budget={self.options.memory_budget!r}: {type(error).__name__}: {error}; its current "
                    "variant was planned for another step or budget (options={'on_failure': 'fallback'} keeps it)"
                ) from error
            warnings.warn(
                f"dpcs could not compile {self.name} for the runtime's decisions "
                f"({self.control.decisions.describe() if self.control.decisions else 'compile options'}): "
                f"{type(error).__name__}: {error}; it keeps running its current variant",
                category=DpcsWarning, stacklevel=3,
            )
        self._version = -1 if self._first_call else version  # until the first real call, look again

    def _variant(self, decisions: Decisions | None, dynamo_inputs: Sequence[Any] | None) -> Callable:
        """The variant of `decisions`, compiled if new: from `dynamo_inputs` inside Dynamo's compile, else from
        the kept fake inputs in a tracing context of Dynamo's fake mode (between steps)."""
        if decisions is not None and decisions.budget_scale is not None and decisions.budget_bytes is None and self.reference is None:
            self._variant(None, dynamo_inputs)  # the unscaled plan gives the bytes the scale multiplies
        options = variant_options(self.options, decisions, self.modules, self.reference)
        if self.bucket != self.traced_sizes:  # planned for the bucket's sizes, not the traced ones
            options = dataclasses.replace(options, size_hints=tuple((s.name, b) for s, b in zip(self.size_symbols, self.bucket)))
        if self.step_context is not None and decisions == self.step_context_for:
            # Planned inside its step: what the step planner found feasible is compiled without an error
            # in the middle of training (the planner raised already if no step plan fits).
            options = dataclasses.replace(options, step_context=self.step_context, on_infeasible="best")
            if self.step_context.hold_least and options.compiler == "inductor" and self.bucket not in self.step_planned:
                # A first plan that holds least, made before the step's other graphs are known, lasts until the
                # step planner plans the step (at the next step's first call). It runs the same partitioned
                # graphs uncompiled (compiler="eager", its memory planned for that), so Inductor compiles this
                # graph once, for the plan that stays, instead of twice (issue 18: compile time).
                options = dataclasses.replace(options, compiler="eager", stands_in_for="inductor")
        first, previous = not self.variants, self.current_key
        try:
            fn = self._compiled(options, decisions, dynamo_inputs, first)
            if options.stands_in_for is not None and self.current_over() and self._compiled_may_hold():
                # Uncompiled, its plans cannot hold its target, and as Inductor runs it one can (Inductor's fused
                # kernels hold less than the FX graph they stand in for: the graph-break net's first step, at a
                # tenth of the way from its lowest peak to its peak without a budget, measured 20% over its
                # budget): compiled by Inductor now, in the same step context (its plans solved again for the
                # graph Inductor runs). Where no plan holds it either way, the stand-in stays: a compile more
                # would buy nothing.
                options = dataclasses.replace(options, compiler=options.stands_in_for, stands_in_for=None)
                fn = self._compiled(options, decisions, dynamo_inputs, first)
        except Exception:
            self.current_key = previous  # the variant that runs stays the current one
            raise
        return fn

    def current_over(self) -> bool:
        """Whether the current variant's plan is predicted over its budget (or its step's target)."""
        records = self.records.get(self.current_key) or []
        return bool(records) and records[0].plan_feasible is False

    def _compiled_may_hold(self) -> bool:
        """For the current variant, a stand-in: whether the graph as the compiler it stands in for runs it (its
        step view, `GraphJob.step_view`) has a plan within its target in its step context (True where that
        view cannot be built: compiled, to be sure)."""
        from dpcs_compiler.cost.step_model import in_step
        from dpcs_compiler.solve import fits

        job = self.current_job()
        view = job.step_view if job is not None else None
        if view is None:
            return True
        context = job.options.step_context
        if context is not None:
            context = dataclasses.replace(context, boundary_cap=None, hold_least=False)
        return fits(in_step(view.problem, context, job.target), job.target)[1]

    def _compiled(self, options: DpcsOptions, decisions: Decisions | None, dynamo_inputs: Sequence[Any] | None,
                  first: bool) -> Callable:
        """The variant compiled with `options`, made current; compiled now if new (`_variant`). `first`: the
        graph's first compile (a failure may fall back to plain Inductor, `CompileFn`)."""
        key = options.fingerprint()
        if key in self.variants:
            self.current_key = key
            return self.variants[key]
        before = compile_records()
        start = time.perf_counter()
        error = None
        if dynamo_inputs is None and self.fake_inputs is None:
            raise RuntimeError(f"no variant of this graph can be compiled between steps: {self.no_variants}")
        graph = copy_graph_module(self.graph_module)
        try:
            if dynamo_inputs is not None:
                fn = self.compile_fn(graph, list(dynamo_inputs), options, first)
            else:
                from torch._guards import TracingContext, tracing

                with tracing(TracingContext(self.fake_mode)):
                    fn = self.compile_fn(graph, list(self.fake_inputs), options, False)
        except Exception as exc:
            error = exc
            raise
        finally:
            records = records_since(before)
            # Dynamo's RestartAnalysis is its control flow (it traces again and calls the backend anew), not a
            # failed compile: no event, or telemetry and `dpcs plot` would report a failure that never was.
            from torch._dynamo.exc import RestartAnalysis

            if not isinstance(error, RestartAnalysis):
                self._note_compile(decisions, records, time.perf_counter() - start, error)
            if error is not None:
                note_compile_raised()
            error = None  # the error's traceback holds this frame: not kept in it (a reference cycle)
        self.variants[key] = fn
        self.records[key] = records
        self.jobs[key] = [job_of(r.graph) for r in records]
        self.current_key = key
        return fn

    @property
    def current_budget_bytes(self) -> int | None:
        """The memory budget the current variant was planned with (None: no budget)."""
        records = self.records.get(self.current_key) or []
        return records[0].budget_bytes if records else None

    @property
    def current_reserved_budget_bytes(self) -> int | None:
        """On CUDA, the memory budget of the current variant on what the caching allocator reserves (None: no
        budget, or not on CUDA)."""
        records = self.records.get(self.current_key) or []
        return records[0].reserved_budget_bytes if records else None

    def take_deferred_infeasible(self) -> str | None:
        """The budget verdict its current variant's compile left to the step (`CompileRecord.infeasible_deferred`:
        its outputs might be dropped before its backward), taken once: the step gives it, or plans it away."""
        records = self.records.get(self.current_key) or []
        message = next((r.infeasible_deferred for r in records if r.infeasible_deferred), None)
        for r in records:
            r.infeasible_deferred = None
        return message

    @property
    def current_peak_bytes(self) -> int | None:
        """The peak the current variant's plan predicts."""
        records = self.records.get(self.current_key) or []
        return records[0].predicted_peak_bytes if records else None

    def _note_compile(self, decisions: Decisions | None, records: list[CompileRecord], seconds: float, error: Exception | None) -> None:
        self.compiles += 1
        if records and self.name == "graph":
            self.name = records[0].graph
        elif self.name != "graph":
            from dpcs_compiler.debug.dump import write_summary

            for record in records:
                record.variant_of = self.name
                write_summary(record)
        main = records[0] if records else None
        unscaled = decisions is None or (decisions.budget_scale is None and decisions.budget_bytes is None)
        if main is not None and error is None and unscaled and self.own_reference is None:
            reference = main.budget_bytes or main.predicted_peak_bytes
            self.own_reference = int(reference) if reference else None
        event = CompileEvent(
            graph=self.name,
            variant=decisions.key() if decisions else "compiled",
            decisions=decisions.describe() if decisions else "compile options",
            seconds=round(seconds, 4),
            plan_hashes=[r.plan_hash for r in records if r.plan_hash],
            feasible=main.plan_feasible if main else None,
            predicted_peak_bytes=main.predicted_peak_bytes if main else None,
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
        self.events.append(event)
        if self.control is not UNBOUND:
            self.control.events.append(event)
        log.info("%s: compiled variant %s (%s) in %.2f s", event.graph, event.variant, event.decisions, seconds)


@dataclasses.dataclass(frozen=True)
class SizeSymbol:
    """A shape symbol of a graph's inputs: input `arg` (dimension `dim`, or the input itself when it is a
    SymInt), the symbol's name and its traced size."""

    arg: int
    dim: int | None
    name: str
    traced: int


def size_symbols(fake_inputs: Sequence[Any]) -> tuple[SizeSymbol, ...]:
    """Each plain shape symbol of the inputs, once, where it first appears."""
    import sympy

    found: dict[str, SizeSymbol] = {}
    for i, x in enumerate(fake_inputs):
        dims = list(enumerate(x.shape)) if isinstance(x, torch.Tensor) else [(None, x)]
        for d, size in dims:
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            if isinstance(expr, sympy.Symbol) and expr.name not in found and size.node.hint is not None:
                found[expr.name] = SizeSymbol(i, d, expr.name, int(size.node.hint))
    return tuple(found.values())


def size_bucket(size: int, traced: int) -> int:
    """The size a call's plan is made for: the traced one up to it, else the next power of two (a plan's peak
    grows with the sizes, so it holds for every size up to its bucket's; at most log2 variants)."""
    size = int(size)
    return traced if size <= traced else 1 << (size - 1).bit_length()


def mode_of(options: DpcsOptions) -> str:
    """The runtime's precision mode of compile options."""
    return "fp8" if options.fp8 is not None else options.precision
