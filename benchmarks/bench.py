"""`dpcs bench`: dpcs's memory planner against what users have today, measured side by side.

    dpcs bench [--device cpu|cuda] [--models mlp,gpt,llama,convnet] [--steps N] [--warmup N]
               [--strategies eager,eager_ac,sac,compile,amb,dpcs] [--compiler inductor|eager] [--quick]
               [--calibrate] [--check-targets]
               [--out benchmarks/results]
    python benchmarks/bench.py [same arguments]

Per model (an MLP, a minimal 4-layer GPT, a Llama built with `transformers` from a config with random
weights, a ResNet-style conv net, a net with graph breaks, Hugging Face's GPT-2 and the GPT at T=1024), one training step (zero grads, forward, loss, backward; `--sgd` adds an
optimizer step) under each strategy:

  eager               plain PyTorch
  eager_ac            full activation checkpointing per block (torch.utils.checkpoint, use_reentrant=False)
  sac                 torch.compile of the model with selective activation checkpointing per block (torch's
                      SAC, the policy saving matmul, attention and convolution outputs: `models.sac_policy`)
  compile             torch.compile default (Inductor)
  compile_amb=X       torch.compile with torch._functorch.config.activation_memory_budget = X during compile
  dpcs@B              torch.compile(backend="dpcs", options={"memory_budget": B, "on_infeasible": "best",
                      "strict": True}) at B = each distinct measured peak of eager_ac and the compiled
                      upstream strategies, and fractions (--dpcs-below) of the lowest of them

All strategies are compiled first (each on its own copy of the model, with the same weights), their peak
memory measured (dpcs_compiler.measure: CPU profiler memory events, or CUDA max_memory_allocated; parameters,
buffers and inputs counted in), then timed interleaved round-robin in this one process: median step time.
Ratios are against `compile`. A strategy that fails to compile or run is recorded with its error and left
out of the rest. Writes bench_<device>.json (device, torch version, per model and strategy), prints tables,
and plots bench_<device>.png (peak vs step time per model). `--quick` uses tiny sizes and writes
bench_<device>_quick.*.

Targets (issue 18; `--check-targets` exits 1 unless every pairwise and required lowest-peak target holds):
pairwise at the budget of each upstream setting's measured peak, dpcs's peak at most upstream's and its step
time <= 0.95x upstream's where upstream recomputes (amb < 1, eager_ac, sac), <= 1.00x where it does not
(compile, amb 1); on the GPT and the Llama, dpcs's lowest peak <= 0.80x the lowest upstream peak. Also
printed per dpcs budget: its step time against every upstream strategy whose measured peak is >= its own.
dpcs's compile-time share per budget: its passes' seconds over the first step's (`pass_share`). Each pairwise
pair also says whether its target time is under torch's unbudgeted step (`compile`), which only a plan faster
than torch's own at no pressure meets, and the share of upstream's time over that step dpcs pays. Each pair's
ratio also comes paired round by round, with a 95% interval for its median: a miss whose interval holds the
target is flagged as within the run's timing noise (it still fails), and `compile_amb=1` over `compile`,
torch's one plan timed twice, gives that noise per model.

`--compiler eager` is a cheap path (tests, debugging): the torch.compile strategies use backend "aot_eager"
(same partitioner, so activation_memory_budget still applies) and dpcs its option compiler="eager".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without the package installed
    sys.path.insert(0, str(REPO))

from dpcs_compiler.debug import progress  # noqa: E402
from dpcs_compiler.measure import measure_peak_memory, resident_bytes  # noqa: E402
from dpcs_compiler.models import BENCH_MODELS, apply_activation_checkpointing, bench_workload  # noqa: E402
from dpcs_compiler.report import compile_records, records_since, step_records  # noqa: E402

MiB = 2**20
DEFAULT_AMB = (0.0, 0.2, 0.5, 1.0)
DEFAULT_BELOW = (0.85, 0.7)
STRATEGY_KINDS = ("eager", "eager_ac", "sac", "compile", "amb", "dpcs")
# Targets (issue 18), pairwise at the budget of each upstream setting's measured peak: dpcs's step time at most
# RECOMPUTING_TARGET x upstream's where upstream recomputes (activation_memory_budget < 1, eager activation
# checkpointing, SAC), at most NO_RECOMPUTE_TARGET x where it does not (compile, amb 1); dpcs's lowest peak at
# most LOWEST_PEAK_TARGET x upstream's lowest on LOWEST_PEAK_MODELS.
RECOMPUTING_TARGET = 0.95
NO_RECOMPUTE_TARGET = 1.00
LOWEST_PEAK_TARGET = 0.80
LOWEST_PEAK_MODELS = ("gpt", "llama")
# The share of an upstream strategy's time over compile's that dpcs pays is given only where that time is more
# than this fraction of compile's (SAC on CPU runs at compile's own time: a share of it is noise).
SHARE_NOISE = 0.02
DEDUPE_RELATIVE = 0.005  # upstream peaks within 0.5% of each other give one dpcs budget
# How sure the interval of a pairwise time ratio is (`median_interval`): a target missed with the target inside
# that interval is a miss within the timing noise of the run (reported as such; it still fails).
RATIO_CONFIDENCE = 0.95
# CompileRecord fields kept per dpcs graph (read with getattr: the planner's fields may be absent)
RECORD_FIELDS = ("graph", "variant_of", "mode", "compiler", "predicted_peak_bytes", "budget_bytes", "plan_feasible", "solver",
                 "recomputed_values", "offloaded_values", "plan_added_seconds", "partition_peak_bytes", "fallback",
                 "forward_schedule_excess_bytes", "backward_schedule_excess_bytes", "replans", "fusions_refused", "backward_fusion",
                 "hardware_profile", "planned_for", "plan_hash", "pass_seconds", "calibration", "recompute_terms")


class LossModule(nn.Module):
    """The model and its loss in one module, so a compiled strategy compiles forward + loss as one graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs))


class StrategyBackend:
    """A Dynamo backend equal only to itself.

    Dynamo reuses a frame's compiled graph for any model instance whose guards pass and whose backend
    compares equal; two torch.compile(backend="inductor") calls compare equal, so a graph compiled under one
    activation_memory_budget would serve another. A distinct backend object keeps each strategy's graphs.
    """

    def __init__(self, name: str, label: str) -> None:
        self.name, self.label = name, label
        self.fn = torch._dynamo.lookup_backend(name)

    def __call__(self, gm, example_inputs, **kwargs):
        return self.fn(gm, example_inputs, **kwargs)

    def __repr__(self) -> str:
        return f"StrategyBackend({self.name!r}, {self.label!r})"


@dataclasses.dataclass
class Strategy:
    name: str
    kind: str  # "upstream" or "dpcs"
    # model copy -> callable (inputs -> loss); a dpcs point's also takes outside_bytes (added to its budget)
    build: Callable[..., Callable[..., torch.Tensor]]
    compile_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    compiled: bool = False
    budget_bytes: int | None = None
    budget_source: str | None = None
    # filled in while running
    module: nn.Module | None = None
    step: Callable[[], None] | None = None
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    times: list[float] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result.get("error") is None and self.step is not None


# --- strategies -------------------------------------------------------------------------------------------


def upstream_strategies(kinds: Sequence[str], amb_budgets: Sequence[float], compiler: str) -> list[Strategy]:
    backend = "inductor" if compiler == "inductor" else "aot_eager"
    out = []
    if "eager" in kinds:
        out.append(Strategy("eager", "upstream", lambda m: m))
    if "eager_ac" in kinds:
        out.append(Strategy("eager_ac", "upstream", _eager_ac))
    if "sac" in kinds:
        out.append(Strategy("sac", "upstream", lambda m: torch.compile(_sac(m), backend=StrategyBackend(backend, "sac"),
                                                                        dynamic=False), compiled=True))
    if "compile" in kinds:
        out.append(Strategy("compile", "upstream", lambda m: torch.compile(m, backend=backend, dynamic=False),
                            compiled=True))
    if "amb" in kinds:
        for budget in amb_budgets:
            label = f"compile_amb={budget:g}"
            out.append(
                Strategy(
                    label,
                    "upstream",
                    lambda m, label=label: torch.compile(m, backend=StrategyBackend(backend, label), dynamic=False),
                    compile_context=lambda budget=budget: torch._functorch.config.patch(
                        activation_memory_budget=budget
                    ),
                    compiled=True,
                )
            )
    return out


def _eager_ac(module: nn.Module) -> nn.Module:
    apply_activation_checkpointing(module.model)
    return module


def _sac(module: nn.Module) -> nn.Module:
    apply_activation_checkpointing(module.model, selective=True)
    return module


def recomputes(upstream: str) -> bool:
    """Whether an upstream strategy recomputes activations (its target ratio is RECOMPUTING_TARGET)."""
    if upstream in ("eager_ac", "sac"):
        return True
    if upstream.startswith("compile_amb="):
        return float(upstream.split("=", 1)[1]) < 1.0
    return False

def log_prepared(model: str, s: Strategy, log: Callable[[str], None]) -> None:
    """One line per strategy as soon as it is measured, so that a run cut short (a lease's deadline) still
    says what each strategy it reached held and what dpcs planned."""
    r = s.result
    if r.get("error"):
        log(f"[{model}] {s.name}: error {str(r['error'])[:300]}")
        return
    fields = [f"peak {r.get('peak_bytes')} B", f"first step {r.get('first_step_s', 0.0):.2f} s"]
    for key in ("predicted_peak_bytes", "feasible", "recomputed_values", "offloaded_values", "first_step_pass_s"):
        if r.get(key) is not None:
            fields.append(f"{key} {r[key]}")
    log(f"[{model}] {s.name}: " + ", ".join(fields))


def dpcs_budgets(upstream: Sequence[Strategy], below: Sequence[float]) -> list[tuple[int, str]]:
    """(budget bytes, where it comes from): each distinct measured peak of eager_ac and the compiled upstream
    strategies, then `below` fractions of the lowest. Peaks within DEDUPE_RELATIVE of each other give one
    budget, the lowest of them (dpcs's point is judged against each, its peak included), and only peaks of
    strategies alike in whether they recompute: the GPT's amb 0 peaked 0.14% under compile's, and a shared
    budget at compile's peak failed that pair on peak, while one at amb 0's would make the pair with
    compile, which nothing presses, recompute."""
    peaks = sorted(
        ((s.result["peak_bytes"], s.name) for s in upstream if s.ok and (s.compiled or s.name == "eager_ac")),
        reverse=True,
    )
    budgets: list[list] = []  # [budget, names, recomputes]
    for peak, name in peaks:
        for kept in budgets:
            if kept[2] == recomputes(name) and abs(kept[0] - peak) <= DEDUPE_RELATIVE * kept[0]:
                kept[0] = min(kept[0], peak)
                kept[1].append(name)
                break
        else:
            budgets.append([peak, [name], recomputes(name)])
    budgets.sort(key=lambda kept: -kept[0])
    out = [(peak, "peak of " + ", ".join(names)) for peak, names, _ in budgets]
    if budgets:
        lowest = budgets[-1][0]
        out += [(int(lowest * f), f"{f:g} x lowest upstream peak") for f in below]
    return out


CALIBRATED_PREFIX = {"ops": "dpcs_cal", "steps": "dpcs_stepcal", "steps_refined": "dpcs_stepcal2"}


def budget_labels(budgets: Sequence[int]) -> list[str]:
    """How each budget is named: MiB to 4 digits, or its bytes where two budgets would share that name (the
    T=1024 GPT's amb 0 peaked 24 KB above compile's: 153.8 MiB both, and the second point was skipped as
    a duplicate)."""
    short = [f"{b / MiB:.4g}MiB" for b in budgets]
    return [label if short.count(label) == 1 else f"{b}B" for b, label in zip(budgets, short)]


def dpcs_strategy(budget: int, source: str, compiler: str, strict: bool = True, calibrate: str | None = None,
                  calibration: dict[str, float | None] | None = None, label: str | None = None) -> Strategy:
    """dpcs at `budget`; calibrate: None (the profile's roofline), "ops" (option calibrate: the roofline fitted
    to the graph's own ops) or "steps" (option calibration: `calibration`, fitted to measured steps). Named
    `<prefix>@<label>` (label: `budget_labels`, by default the budget in MiB)."""
    options: dict[str, Any] = {"memory_budget": int(budget), "on_infeasible": "best", "compiler": compiler}
    if strict:  # a failing dpcs stage is this point's error, not a plain-Inductor point labelled dpcs
        options["strict"] = True
    if calibrate == "ops":  # costed with the roofline fitted to the graph's own ops (`stages/calibrate.py`)
        options["calibrate"] = True
    elif calibrate in ("steps", "steps_refined"):
        if calibration is None:
            raise ValueError("dpcs_strategy: calibrate='steps' needs the calibration fitted to measured steps")
        options["calibration"] = dict(calibration)
    elif calibrate is not None:
        raise ValueError(f"dpcs_strategy: calibrate={calibrate!r} is not valid; valid choices: None, 'ops', 'steps', "
                         "'steps_refined'")
    def build(m: nn.Module, outside_bytes: int = 0) -> Callable[..., torch.Tensor]:
        return torch.compile(m, backend="dpcs", options={**options, "memory_budget": int(budget) + outside_bytes},
                             dynamic=False)

    return Strategy(
        f"{CALIBRATED_PREFIX.get(calibrate, 'dpcs')}@{label or budget_labels([budget])[0]}",
        "dpcs",
        build,
        compiled=True,
        budget_bytes=int(budget),
        budget_source=source,
    )


# --- running ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error_text(error: BaseException) -> str:
    boilerplate = ("Set TORCHDYNAMO", "You can suppress", "    import torch._dynamo", "    torch._dynamo.config")
    lines = [ln for ln in str(error).splitlines() if ln.strip() and not ln.startswith(boilerplate)]
    text = f"{type(error).__name__}: " + " | ".join(lines)
    # long messages (a C++ compile error: the command, then the compiler's output) keep both ends
    return text if len(text) <= 1200 else text[:400] + " ... " + text[-800:]


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def prepare(strategy: Strategy, base: LossModule, inputs: Sequence[torch.Tensor], *, device: torch.device,
            warmup: int, sgd: bool) -> None:
    """Copy the model, build the strategy, compile and warm it up (compile context held), measure its peak."""
    result = strategy.result
    result.update(kind=strategy.kind, compiled=strategy.compiled)
    if strategy.budget_bytes is not None:
        result.update(budget_bytes=strategy.budget_bytes, budget_source=strategy.budget_source)
    records_before = compile_records()
    graphs_before = _unique_graphs()
    try:
        module = copy.deepcopy(base)
        if strategy.kind == "dpcs" and strategy.budget_bytes is not None:
            # dpcs bounds what the process holds at the step's peak (on CUDA the allocator's absolute level):
            # what it holds for the other strategies and for cuBLAS is added to the budget, which, like every
            # peak here, is the model's own (its resident bytes and what its step allocates).
            outside = held_outside(device, [*module.parameters(), *module.buffers(), *inputs])
            result["budget_outside_bytes"] = outside
            fn = strategy.build(module, outside_bytes=outside)
        else:
            fn = strategy.build(module)
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-4) if sgd else None

        def step() -> None:
            module.zero_grad(set_to_none=True)
            fn(*inputs).backward()
            if optimizer is not None:
                optimizer.step()

        with strategy.compile_context(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()  # the first forward and backward compile here, inside the context
            step()
            _sync(device)
            result["first_step_s"] = time.perf_counter() - start
            if strategy.kind == "dpcs":  # dpcs's passes' share of the first step (its compile, mostly)
                first = sum(sum(r.pass_seconds.values()) for r in records_since(records_before))
                result["first_step_pass_s"], result["pass_share"] = first, first / result["first_step_s"]
            # dpcs learns a step on its first run and switches to its step plan at the next; the step after that
            # is measured, and if it held more than the plan, planned again and measured again.
            for _ in range(max(warmup - 1, 5 if strategy.kind == "dpcs" else 0)):
                step()
            graphs = _unique_graphs() - graphs_before
            result["graphs"] = graphs
            if strategy.compiled and graphs == 0:
                raise RuntimeError("compiled no graph of its own (Dynamo reused another strategy's graph)")
            _sync(device)
            module.zero_grad(set_to_none=True)  # gradients freed before, not during, the measured step
            resident = resident_bytes([*module.parameters(), *module.buffers(), *inputs])
            _, peak = measure_peak_memory(step, device=device)
        messages = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught
                                      if not issubclass(w.category, (DeprecationWarning, FutureWarning))))
        result["warnings"] = [m if len(m) <= 400 else m[:397] + "..." for m in messages[:5]]
        result.update(peak_bytes=resident + peak.peak_increase_bytes, resident_bytes=resident, error=None)
        strategy.module, strategy.step = module, step
    except Exception as error:  # noqa: BLE001 - a failing strategy is a result, not the end of the run
        result["error"] = _error_text(error)
    finally:
        records = records_since(records_before)
        if strategy.kind == "dpcs":
            _dpcs_fields(result, records)
            outside = result.get("budget_outside_bytes") if result.get("error") is None and result.get("step") else 0
            for field in ("predicted_peak_bytes", "compiled_peak_bytes"):  # a step plan's: the model's own
                if result.get(field) is not None and outside:
                    result[field] = max(0, result[field] - outside)


def held_outside(device: torch.device, own: Sequence[torch.Tensor]) -> int:
    """The bytes the process holds on `device` beyond `own` (CUDA: the other strategies' models and
    gradients, cuBLAS's workspaces); 0 on CPU, where dpcs's step meter sees only the step's own memory."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.memory_allocated(device)) - resident_bytes(own))


# Failures of the shared C++ build (Inductor's cache folder is shared with every process of the user; a
# concurrent build of the same precompiled header or kernel has been seen to fail once): retried once.
TRANSIENT_ERRORS = ("CppCompileError",)


def prepare_with_retry(strategy: Strategy, *args: Any, log: Callable[[str], None], **kwargs: Any) -> None:
    prepare(strategy, *args, **kwargs)
    error = strategy.result.get("error")
    if error and strategy.compiled and any(marker in error for marker in TRANSIENT_ERRORS):
        log(f"  {strategy.name}: {error[:120]}... - retrying once")
        strategy.result = {"retried_after": error}
        prepare(strategy, *args, **kwargs)


def _dpcs_fields(result: dict[str, Any], records: list) -> None:
    rows = [{name: getattr(r, name, None) for name in RECORD_FIELDS} for r in records]
    result["records"] = rows
    training = [r for r in rows if r["mode"] == "training"]
    # The whole step's prediction: a step plan's (several graphs), else the one training graph's. With a step
    # plan, each graph runs its latest variant (the first compiles were planned before the step was known).
    steps = [s for s in step_records() if set(s.calls) <= {r["graph"] for r in rows}]
    if steps:
        step = steps[-1]
        result["predicted_peak_bytes"] = step.predicted_peak_bytes
        result["compiled_peak_bytes"] = step.compiled_peak_bytes  # predicted again from the variants compiled
        result["step"] = step.to_json()
        latest = {(r["variant_of"] or r["graph"]): r for r in training}
        training = [latest[g] for g in dict.fromkeys(step.calls) if g in latest]
    else:
        result["predicted_peak_bytes"] = training[0]["predicted_peak_bytes"] if len(training) == 1 else None
    # What the step's plans recompute (each graph's latest plan): with its measured time, one sample of the
    # step calibration (`--calibrate steps`).
    terms = [r["recompute_terms"] for r in training if r["recompute_terms"] is not None]
    result["recompute_terms"] = terms if terms and len(terms) == len(training) else None
    feasible = [r["plan_feasible"] for r in training if r["plan_feasible"] is not None]
    result["plan_feasible"] = (steps[-1].feasible if steps else all(feasible)) if feasible or steps else None
    for field in ("recomputed_values", "offloaded_values"):
        counts = [r[field] for r in training if r[field] is not None]
        result[field] = sum(counts) if counts else None
    fallbacks = [r["fallback"] for r in rows if r["fallback"]]
    result["fallback"] = fallbacks[0] if fallbacks else None
    # dpcs's own compile time: every compile's passes (a step plan's variants too, compiled in warm-up).
    result["pass_s"] = sum(sum((r["pass_seconds"] or {}).values()) for r in rows)
    result["solvers"] = sorted({r["solver"] for r in training if r["solver"]})


# Several benchmarks may share one lent GPU, each compiling on CPU cores of its own (`gpu_session.sh`): their
# timed phases take this file lock in turn, so no step is timed while another process's steps run.
DEVICE_LOCK_ENV = "DPCS_BENCH_DEVICE_LOCK"


@contextlib.contextmanager
def device_to_itself() -> Iterator[None]:
    """Hold the lock file named by $DPCS_BENCH_DEVICE_LOCK (exclusive, blocking) for the block; without the
    variable, nothing. `flock LOCKFILE CMD` takes the same lock from a shell."""
    path = os.environ.get(DEVICE_LOCK_ENV)
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def time_interleaved(strategies: Sequence[Strategy], *, steps: int, warmup: int, device: torch.device,
                     field: str = "step_s") -> None:
    """Round-robin: each round runs one step of every strategy (starting one further each round); the median
    goes to result[field], every time to result[field + "_all"]. The rounds run with the device to themselves
    (`device_to_itself`)."""
    with device_to_itself():
        _time_interleaved(strategies, steps=steps, warmup=warmup, device=device, field=field)


def _time_interleaved(strategies: Sequence[Strategy], *, steps: int, warmup: int, device: torch.device,
                      field: str) -> None:
    live = [s for s in strategies if s.ok]
    for strategy in live:
        strategy.times = []
    graphs_before = _unique_graphs()
    for round_ in range(warmup + steps):
        order = live[round_ % len(live):] + live[: round_ % len(live)] if live else []
        for strategy in order:
            if not strategy.ok:
                continue
            try:
                _sync(device)
                start = time.perf_counter()
                strategy.step()
                _sync(device)
                elapsed = time.perf_counter() - start
            except Exception as error:  # noqa: BLE001
                strategy.result["error"] = "while timing: " + _error_text(error)
                strategy.step = None
                continue
            if round_ >= warmup:
                strategy.times.append(elapsed)
    recompiled = _unique_graphs() - graphs_before
    for strategy in live:
        if strategy.times:
            strategy.result[field] = statistics.median(strategy.times)
            strategy.result[field + "_all"] = strategy.times
        strategy.result["recompiles_while_timing" if field == "step_s" else f"recompiles_while_{field}"] = recompiled


def run_model(name: str, args: argparse.Namespace, device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    torch._dynamo.reset()  # the previous model's strategies are done; start this one with empty caches
    try:
        w = bench_workload(name, quick=args.quick)
    except Exception as error:  # noqa: BLE001 - e.g. transformers not installed
        return {"error": _error_text(error), "strategies": {}}
    base = LossModule(w.model, w.loss_fn).to(device)
    inputs = tuple(x.to(device) for x in w.inputs)
    strategies = upstream_strategies(args.strategies, args.amb, args.compiler)
    with progress.task(f"[{name}] strategies") as model_progress:  # its total: known once dpcs's budgets are
        for s in strategies:
            log(f"[{name}] {s.name}: compiling / warming up")
            model_progress.detail(f"{s.name}: compiling / warming up")
            prepare_with_retry(s, base, inputs, device=device, warmup=args.warmup, sgd=args.sgd, log=log)
            log_prepared(name, s, log)
            model_progress.advance()
        if "dpcs" in args.strategies:
            budgets = dpcs_budgets(strategies, args.dpcs_below)
            for (budget, source), label in zip(budgets, budget_labels([b for b, _ in budgets])):
                variants = [None, "ops"] if args.calibrate == "ops" and source.startswith("peak of ") else [None]
                for calibrate in variants:  # with --calibrate ops, the pairwise budgets also calibrated
                    s = dpcs_strategy(budget, source, args.compiler, strict=not args.dpcs_fallback, calibrate=calibrate,
                                      label=label)
                    if any(t.name == s.name for t in strategies):
                        continue
                    log(f"[{name}] {s.name} ({source}): compiling / warming up")
                    model_progress.detail(f"{s.name}: compiling / warming up")
                    prepare_with_retry(s, base, inputs, device=device, warmup=args.warmup, sgd=args.sgd, log=log)
                    log_prepared(name, s, log)
                    s.result["calibrate"] = calibrate
                    strategies.append(s)
                    model_progress.advance()
        log(f"[{name}] timing {sum(s.ok for s in strategies)} strategies interleaved, {args.steps} steps each")
        model_progress.detail(f"timing {sum(s.ok for s in strategies)} strategies interleaved")
        time_interleaved(strategies, steps=args.steps, warmup=args.warmup, device=device)
        step_fit = None
        if args.calibrate == "steps" and "dpcs" in args.strategies:
            step_fit = calibrate_from_steps(name, strategies, base, inputs, args, device, log, model_progress)
    for s in strategies:
        s.module = s.step = None  # free the copies
    results = {s.name: s.result for s in strategies}
    reference = results.get("compile", {})
    for r in results.values():
        for key, ratio in (("step_s", "step_ratio"), ("peak_bytes", "peak_ratio")):
            if r.get(key) is not None and reference.get(key):
                r[ratio] = r[key] / reference[key]
            else:
                r[ratio] = None
    model_params = sum(p.numel() for p in w.model.parameters())
    return {
        "step_calibration": step_fit,
        "model": type(w.model).__name__,
        "parameters": model_params,
        "inputs": [list(x.shape) for x in w.inputs],
        "strategies": results,
        "targets": targets(name, results),
    }


def step_samples(strategies: Sequence[Strategy], field: str = "step_s") -> list[Any]:
    """One `StepSample` per dpcs point measured by dpcs itself: what its plans recompute, and its step time in
    result[field]. With "step_s", the uncalibrated points (the calibrated ones were timed in another phase:
    fewer strategies interleaved, other step times); with another field, every point timed in that phase."""
    from dpcs_compiler.cost.calibration import StepSample

    return [
        StepSample.of(s.result["recompute_terms"], s.result[field])
        for s in strategies
        if s.kind == "dpcs" and s.result.get(field) is not None
        and (field != "step_s" or not s.result.get("calibrate"))
        and s.result.get("recompute_terms") and not s.result.get("fallback")
        and not s.result.get("offloaded_values")  # copy time is not among the terms
    ]


def calibrate_from_steps(name: str, strategies: list[Strategy], base: LossModule, inputs: Sequence[torch.Tensor],
                         args: argparse.Namespace, device: torch.device, log: Callable[[str], None],
                         model_progress: Any) -> dict[str, Any]:
    """`--calibrate steps`: fit the roofline to the measured steps of the uncalibrated dpcs points
    (`fit_step_calibration`), plan each pairwise budget again with that fit (dpcs_stepcal@...), and time each
    against its uncalibrated plan, interleaved (result["paired_step_s"] of both); then fit again with those
    steps, the re-planned plans' own included, and plan and time each budget once more with the refined fit
    (dpcs_stepcal2@..., result["refined_step_s"]) if it differs."""
    from dpcs_compiler.cost.calibration import fit_step_calibration
    from dpcs_compiler.cost.profiles import resolve_profile
    from dpcs_compiler.options import DpcsOptions

    profile = resolve_profile(DpcsOptions.from_dict({}).hardware_profile, device).profile
    try:
        fit = fit_step_calibration(step_samples(strategies), launch_overhead_s=profile.launch_overhead_s)
    except ValueError as error:
        log(f"[{name}] no step calibration: {error}")
        return {"error": str(error)}
    calibration = dataclasses.asdict(fit.calibration)
    if not fit.fitted:  # the roofline predicts the measured steps best: the calibrated plans are the same plans
        log(f"[{name}] the measured steps keep the roofline (held out {_ms(fit.held_out_s)}): nothing to re-plan")
        return {**fit.to_json(), "error": None}
    log(f"[{name}] fitted to {fit.samples} measured steps: {calibration}, terms fitted {fit.fitted} (base "
        f"{fit.base_s * 1e3:.1f} ms, residual {fit.residual_s * 1e3:.2f} ms, held out {_ms(fit.held_out_s)}, "
        f"roofline held out {_ms(fit.roofline_held_out_s)})")
    plains = [s for s in strategies if s.kind == "dpcs" and s.ok and not s.result.get("calibrate")
              and (s.budget_source or "").startswith("peak of ")]
    pairs = replan_and_time(name, plains, strategies, calibration, "steps", "paired_step_s", base, inputs, args,
                            device, log, model_progress)
    result = {**fit.to_json(), "error": None}
    # Refined as the runtime refines it (`Runtime.calibrate_from_steps` called again): fitted anew to the steps
    # just timed side by side, the re-planned plans' own included (a fit can be wrong about the plans it moves
    # the planner to, and their steps say so), then planned and timed against the uncalibrated plans again.
    try:
        refit = fit_step_calibration(step_samples(pairs, "paired_step_s"), launch_overhead_s=profile.launch_overhead_s)
    except ValueError as error:
        log(f"[{name}] no refined step calibration: {error}")
        return {**result, "refined": {"error": str(error)}}
    result["refined"] = {**refit.to_json(), "error": None}
    if not refit.fitted or refit.calibration == fit.calibration:
        log(f"[{name}] refined with the re-planned plans' steps: {refit.calibration} (fitted "
            f"{', '.join(refit.fitted) or 'none'}): nothing new to plan")
        return result
    log(f"[{name}] refined with the re-planned plans' steps ({refit.samples} samples): {refit.calibration}, held "
        f"out {_ms(refit.held_out_s)} vs the roofline's {_ms(refit.roofline_held_out_s)}")
    replan_and_time(name, plains, strategies, dataclasses.asdict(refit.calibration), "steps_refined",
                    "refined_step_s", base, inputs, args, device, log, model_progress)
    return result


def replan_and_time(name: str, plains: list[Strategy], strategies: list[Strategy], calibration: dict[str, Any],
                    calibrate: str, field: str, base: LossModule, inputs: Sequence[torch.Tensor],
                    args: argparse.Namespace, device: torch.device, log: Callable[[str], None],
                    model_progress: Any) -> list[Strategy]:
    """Plan each of `plains`' budgets again with `calibration` and time each against its uncalibrated plan,
    interleaved: result[field] of both, which is the calibrated point's own step time. Returns the pairs."""
    pairs = []
    for plain in plains:
        s = dpcs_strategy(plain.budget_bytes, plain.budget_source, args.compiler, strict=not args.dpcs_fallback,
                          calibrate=calibrate, calibration=calibration, label=plain.name.split("@", 1)[1])
        log(f"[{name}] {s.name} ({s.budget_source}): compiling / warming up")
        model_progress.detail(f"{s.name}: compiling / warming up")
        prepare_with_retry(s, base, inputs, device=device, warmup=args.warmup, sgd=args.sgd, log=log)
        log_prepared(name, s, log)
        s.result["calibrate"] = calibrate
        strategies.append(s)
        pairs += [plain, s]
    log(f"[{name}] timing {len(pairs) // 2} {calibrate} calibrated plans against their uncalibrated ones, interleaved")
    time_interleaved(pairs, steps=args.steps, warmup=args.warmup, device=device, field=field)
    for s in pairs:  # a calibrated point's own time is its paired time (measured beside its uncalibrated plan)
        if s.result.get("calibrate") == calibrate and s.result.get(field) is not None:
            s.result["step_s"], s.result["step_s_all"] = s.result[field], s.result[field + "_all"]
            s.result["recompiles_while_timing"] = s.result[f"recompiles_while_{field}"]
    return pairs


def targets(model: str, results: dict[str, dict]) -> dict[str, Any]:
    """Per dpcs budget: its step time against every upstream strategy with a measured peak >= its own;
    the model: dpcs's lowest peak against every upstream peak (a target on the GPT)."""
    upstream = {n: r for n, r in results.items() if r["kind"] == "upstream" and r.get("step_s") is not None}
    every = {n: r for n, r in results.items() if r["kind"] == "dpcs" and r.get("step_s") is not None}
    dpcs = {n: r for n, r in every.items() if not r.get("calibrate")}
    # With --calibrate: each calibrated point against the uncalibrated one at the same budget (with "steps",
    # the times measured side by side after the fit, "paired_step_s").
    calibrated = {}
    for name, r in every.items():
        if r.get("calibrate"):
            plain = next((p for p in dpcs.values() if p.get("budget_bytes") == r.get("budget_bytes")), None)
            # the uncalibrated plan's time in the phase the calibrated one was timed in
            phase = {"steps": "paired_step_s", "steps_refined": "refined_step_s"}.get(r["calibrate"], "step_s")
            plain_s = (plain.get(phase) or plain["step_s"]) if plain else None
            calibrated[name] = {
                "calibrate": r["calibrate"],
                "budget_source": r.get("budget_source"),
                "step_s": r["step_s"], "peak_bytes": r["peak_bytes"],
                "uncalibrated_step_s": plain_s,
                "uncalibrated_peak_bytes": plain["peak_bytes"] if plain else None,
                "time_ratio_to_uncalibrated": r["step_s"] / plain_s if plain_s else None,
                "within_budget": r["peak_bytes"] <= r["budget_bytes"] if r.get("budget_bytes") else None,
            }
    per_budget = {}
    for name, r in dpcs.items():
        compared = {u: ur for u, ur in upstream.items() if ur["peak_bytes"] >= r["peak_bytes"]}
        slower_than = sorted(u for u, ur in compared.items() if r["step_s"] > ur["step_s"])
        fallback = bool(r.get("fallback"))  # compiled by plain Inductor, not by dpcs: not a dpcs result
        per_budget[name] = {
            "budget_bytes": r.get("budget_bytes"),
            "peak_bytes": r["peak_bytes"],
            "within_budget": r["peak_bytes"] <= r["budget_bytes"] if r.get("budget_bytes") else None,
            "compared_with": sorted(compared),
            "slower_than": slower_than,
            "worst_time_ratio": max((r["step_s"] / ur["step_s"] for ur in compared.values()), default=None),
            "fallback": fallback,
            "step_time_holds": not slower_than and not fallback,
        }
    # Pairwise (issue 18): for each upstream strategy, dpcs at the budget of its measured peak must measure an
    # equal or lower peak and a step time within the target ratio (stricter where upstream recomputes).
    # Torch's unbudgeted step, what any plan under a budget pays for against: a target time under it asks
    # dpcs to beat torch's own plan at no pressure, which no choice of what to keep can reach.
    unbudgeted_s = upstream["compile"]["step_s"] if "compile" in upstream else None
    per_upstream = {}
    for name, r in dpcs.items():
        source = r.get("budget_source") or ""
        if not source.startswith("peak of "):
            continue
        for u in source[len("peak of "):].split(", "):
            if u in upstream:
                ur = upstream[u]
                ratio = r["step_s"] / ur["step_s"]
                target = RECOMPUTING_TARGET if recomputes(u) else NO_RECOMPUTE_TARGET
                paired = paired_ratio(r.get("step_s_all"), ur.get("step_s_all"))
                interval = paired["time_ratio_interval"]
                per_upstream[u] = {
                    "dpcs": name,
                    "upstream_recomputes": recomputes(u),
                    "upstream_peak_bytes": ur["peak_bytes"],
                    "upstream_step_s": ur["step_s"],
                    "dpcs_peak_bytes": r["peak_bytes"],
                    "dpcs_step_s": r["step_s"],
                    "time_ratio": ratio,
                    "target_ratio": target,
                    "holds": r["peak_bytes"] <= ur["peak_bytes"] and ratio <= target and not r.get("fallback"),
                    **paired,
                    # slower than the target, but by less than the run can tell apart (still a failure)
                    "time_miss_within_noise": ratio > target and interval is not None and interval[0] <= target,
                    **against_unbudgeted(r["step_s"], ur["step_s"], target, unbudgeted_s),
                }
    # The run's timing noise: torch's one plan timed twice (activation_memory_budget 1 is torch's default).
    same = ("compile_amb=1", "compile")
    noise = ({"strategies": list(same), **paired_ratio(upstream[same[0]].get("step_s_all"),
                                                       upstream[same[1]].get("step_s_all"))}
             if all(u in upstream for u in same) else None)
    upstream_peaks = [r["peak_bytes"] for r in upstream.values()]
    dpcs_peaks = [r["peak_bytes"] for r in dpcs.values() if not r.get("fallback")]
    ratio = min(dpcs_peaks) / min(upstream_peaks) if dpcs_peaks and upstream_peaks else None
    lowest = {
        "required": model in LOWEST_PEAK_MODELS,
        "dpcs_min_peak_bytes": min(dpcs_peaks, default=None),
        "upstream_min_peak_bytes": min(upstream_peaks, default=None),
        "ratio": ratio,
        "target_ratio": LOWEST_PEAK_TARGET,
        "holds": ratio <= LOWEST_PEAK_TARGET if ratio is not None else None,
    }
    return {
        "per_budget": per_budget,
        "step_time_holds": all(b["step_time_holds"] for b in per_budget.values()) if per_budget else None,
        "per_upstream": per_upstream,
        "pairwise_holds": all(p["holds"] for p in per_upstream.values()) if per_upstream else None,
        "same_plan_noise": noise,
        "lowest_peak": lowest,
        "calibrated": calibrated,
    }


def median_interval(values: Sequence[float], confidence: float = RATIO_CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` (order statistics: the k-th smallest and the
    k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2), or None where n
    values cannot give that confidence (n < 6 at 95%)."""
    if not 0 < confidence < 1:
        raise ValueError(f"median_interval: confidence must be in (0, 1), got {confidence!r}")
    ordered = sorted(values)
    n = len(ordered)
    tail, below, k = (1 - confidence) / 2, 0.0, 0  # below: P(Binomial(n, 1/2) < k + 1) as k grows
    while k < n:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k >= 1 else None


def paired_ratio(dpcs_times: Sequence[float] | None, upstream_times: Sequence[float] | None) -> dict[str, Any]:
    """dpcs's step time over upstream's round by round (the two ran in the same round of `time_interleaved`,
    so slow stretches of the machine touch both): the median of those ratios and its interval
    (`median_interval`); Nones without per-round times."""
    if not dpcs_times or not upstream_times:
        return {"paired_time_ratio": None, "time_ratio_interval": None}
    ratios = [d / u for d, u in zip(dpcs_times, upstream_times)]
    interval = median_interval(ratios)
    return {"paired_time_ratio": statistics.median(ratios), "time_ratio_interval": list(interval) if interval else None}


def against_unbudgeted(dpcs_s: float, upstream_s: float, target: float, unbudgeted_s: float | None) -> dict[str, Any]:
    """A pairwise pair against torch's unbudgeted step (`compile`): whether the target time is under it (then
    only a plan faster than torch's own at no pressure meets it), and the share of upstream's time over it
    that dpcs pays (None where upstream is within SHARE_NOISE of it: a share of noise is noise)."""
    if unbudgeted_s is None:
        return {"unbudgeted_step_s": None, "target_under_unbudgeted": None, "overhead_share": None}
    over = upstream_s - unbudgeted_s
    return {
        "unbudgeted_step_s": unbudgeted_s,
        "target_under_unbudgeted": target * upstream_s < unbudgeted_s,
        "overhead_share": (dpcs_s - unbudgeted_s) / over if over > SHARE_NOISE * unbudgeted_s else None,
    }


# --- output -----------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / MiB:.1f}" if n >= 10 * MiB else f"{n / MiB:.3g}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _interval(interval: Sequence[float] | None) -> str:
    """', paired per round 0.98-1.05x (95%)', or nothing without an interval."""
    if not interval:
        return ""
    return f", paired per round {interval[0]:.2f}-{interval[1]:.2f}x ({RATIO_CONFIDENCE:.0%})"


def print_tables(payload: dict[str, Any], console) -> None:
    from rich.table import Table

    for model, m in payload["models"].items():
        if m.get("error"):
            console.print(f"[red]{model}: {m['error']}[/red]", highlight=False)
            continue
        table = Table(title=f"{model} ({m['model']}, {m['parameters'] / 1e6:.2f}M params) - {payload['device']}, "
                            f"torch {payload['torch']}, compiler {payload['compiler']}")
        for column in ("strategy", "budget MiB", "peak MiB", "peak / compile", "step ms", "step / compile",
                       "predicted MiB", "feasible", "first step s", "dpcs passes", "note"):
            table.add_column(column, justify="left" if column in ("strategy", "note") else "right",
                             overflow="fold")
        for name, r in m["strategies"].items():
            note = r.get("error") or (f"fallback: {r['fallback']}" if r.get("fallback") else "")
            table.add_row(
                name, _mib(r.get("budget_bytes")), _mib(r.get("peak_bytes")), _ratio(r.get("peak_ratio")),
                "-" if r.get("step_s") is None else f"{r['step_s'] * 1e3:.1f}", _ratio(r.get("step_ratio")),
                _mib(r.get("predicted_peak_bytes")),
                "-" if r.get("plan_feasible") is None else str(r["plan_feasible"]),
                "-" if r.get("first_step_s") is None else f"{r['first_step_s']:.1f}",
                "-" if r.get("pass_share") is None else f"{r['pass_share']:.0%}",
                note[:160] + ("..." if len(note) > 160 else ""),
            )
        console.print(table)
        t = m["targets"]
        for name, b in t["per_budget"].items():
            if b["step_time_holds"]:
                verdict = "[green]holds[/green]"
            else:
                why = [f"slower than {', '.join(b['slower_than'])}"] if b["slower_than"] else []
                why += ["fell back to plain Inductor"] if b["fallback"] else []
                verdict = f"[red]fails[/red] ({'; '.join(why)})"
            console.print(f"  target step time, {name}: {verdict}; worst ratio {_ratio(b['worst_time_ratio'])} vs "
                          f"{len(b['compared_with'])} upstream at >= its peak; within budget: {b['within_budget']}",
                          highlight=False)
        if not t["per_budget"]:
            console.print("  target step time: no dpcs point ran", highlight=False)
        for u, p in t.get("per_upstream", {}).items():
            verdict = "[green]holds[/green]" if p["holds"] else "[red]fails[/red]"
            share = p.get("overhead_share")
            if share is not None:  # below zero: dpcs's point ran faster than torch's unbudgeted step
                verdict += (f"; pays {share:.0%} of its time over compile's" if share >= 0
                            else "; ran faster than compile's own unbudgeted step")
            if not p["holds"] and p.get("target_under_unbudgeted"):
                verdict += (f" (the target, {p['target_ratio'] * p['upstream_step_s'] * 1e3:.1f} ms, is under "
                            f"compile's unbudgeted {p['unbudgeted_step_s'] * 1e3:.1f} ms)")
            if p.get("time_miss_within_noise"):
                verdict += "; the miss is within the run's timing noise"
            console.print(
                f"  pairwise vs {u}: {_mib(p['upstream_peak_bytes'])} MiB / {p['upstream_step_s'] * 1e3:.1f} ms, "
                f"{p['dpcs']}: {_mib(p['dpcs_peak_bytes'])} MiB / {p['dpcs_step_s'] * 1e3:.1f} ms "
                f"({p['time_ratio']:.2f}x{_interval(p.get('time_ratio_interval'))}, target <= {p['target_ratio']:.2f}x): "
                f"{verdict}",
                highlight=False,
            )
        noise = t.get("same_plan_noise")
        if noise and noise.get("paired_time_ratio") is not None:
            console.print(f"  timing noise: {noise['strategies'][0]} over {noise['strategies'][1]} (torch's one plan "
                          f"timed twice) {noise['paired_time_ratio']:.3f}x{_interval(noise['time_ratio_interval'])}",
                          highlight=False)
        fit = m.get("step_calibration")
        if fit:
            console.print(f"  step calibration: {fit['error']}" if fit.get("error") else
                          f"  step calibration from {fit['samples']} measured dpcs steps: compute x"
                          f"{fit['compute_scale']:.3g}, memory x{fit['memory_scale']:.3g}, per op "
                          f"{(fit['overhead_s'] or 0) * 1e6:.3g} us (fitted: {', '.join(fit['fitted']) or 'none, the roofline kept'}; "
                          f"residual {fit['residual_s'] * 1e3:.2f} ms; held-out error {_ms(fit['held_out_s'])} vs "
                          f"the roofline's {_ms(fit['roofline_held_out_s'])})", highlight=False)
        refined = (fit or {}).get("refined")
        if refined:
            console.print(f"  refined step calibration: {refined['error']}" if refined.get("error") else
                          f"  refined with the re-planned plans' steps ({refined['samples']} samples): compute x"
                          f"{refined['compute_scale']:.3g}, memory x{refined['memory_scale']:.3g} (fitted: "
                          f"{', '.join(refined['fitted']) or 'none, the roofline kept'}; held-out error "
                          f"{_ms(refined['held_out_s'])} vs the roofline's {_ms(refined['roofline_held_out_s'])})",
                          highlight=False)
        for c, p in t.get("calibrated", {}).items():
            console.print(f"  calibrated {c} ({p['budget_source']}): {p['step_s'] * 1e3:.1f} ms, "
                          f"{_ratio(p['time_ratio_to_uncalibrated'])} the uncalibrated plan's time; within budget: "
                          f"{p['within_budget']}", highlight=False)
        low = t["lowest_peak"]
        tag = "target" if low["required"] else "info"
        console.print(f"  {tag} lowest peak: dpcs {_mib(low['dpcs_min_peak_bytes'])} MiB vs upstream "
                      f"{_mib(low['upstream_min_peak_bytes'])} MiB ({_ratio(low['ratio'])}, target <= "
                      f"{low['target_ratio']:.2f}x): "
                      + {True: "[green]holds[/green]", False: "[red]fails[/red]", None: "n/a"}[low["holds"]],
                      highlight=False)


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(payload["models"].items())
    cols = min(2, max(len(models), 1))
    rows = (len(models) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 5 * rows), squeeze=False)
    for ax, (model, m) in zip(axes.flat, models):
        ax.set_title(model)
        ax.set_xlabel("median step time (ms)")
        ax.set_ylabel("measured peak (MiB)")
        points = {n: r for n, r in m.get("strategies", {}).items()
                  if r.get("step_s") is not None and r.get("peak_bytes")}
        if not points:
            ax.text(0.5, 0.5, m.get("error") or "no strategy ran", ha="center", va="center", wrap=True,
                    transform=ax.transAxes, fontsize=8)
            continue
        for kind, marker, color in (("upstream", "o", "tab:blue"), ("dpcs", "^", "tab:red"),
                                    ("dpcs, calibrated", "v", "tab:orange"),
                                    ("dpcs, fell back to Inductor", "x", "tab:gray")):
            sel = [(n, r) for n, r in points.items()
                   if r["kind"] == kind.split(",")[0] and bool(r.get("fallback")) == kind.endswith("Inductor")
                   and bool(r.get("calibrate")) == kind.endswith("calibrated")]
            if not sel:
                continue
            xs = [r["step_s"] * 1e3 for _, r in sel]
            ys = [r["peak_bytes"] / MiB for _, r in sel]
            ax.scatter(xs, ys, marker=marker, color=color, label=kind, zorder=3)
            frontier = _pareto(list(zip(xs, ys)))
            if marker != "x":
                ax.step([p[0] for p in frontier], [p[1] for p in frontier], where="post", color=color, alpha=0.4)
            for (n, r), x, y in zip(sel, xs, ys):
                label = f"B={_mib(r['budget_bytes'])}" if r["kind"] == "dpcs" and r.get("budget_bytes") else n
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
        failed = [n for n, r in m.get("strategies", {}).items() if r.get("error")]
        if failed:
            ax.text(0.01, 0.01, "failed: " + ", ".join(failed), transform=ax.transAxes, fontsize=6, va="bottom",
                    wrap=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.suptitle(f"peak memory vs step time ({payload['device']}, torch {payload['torch']}, compiler "
                 f"{payload['compiler']}); lower-left is better", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both step time and peak, by increasing time."""
    frontier: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not frontier or y < frontier[-1][1]:
            frontier.append((x, y))
    return frontier


# --- entry point ------------------------------------------------------------------------------------------


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list]:
    return lambda text: [kind(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpcs bench",
        description="Measure dpcs's memory planner against eager, activation checkpointing and torch.compile: "
        "peak memory and median step time per model and strategy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__[__doc__.index("Per model"):],
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", type=_csv(str), default=list(BENCH_MODELS),
                        help=f"comma-separated, from {','.join(BENCH_MODELS)} (default: all)")
    parser.add_argument("--strategies", type=_csv(str), default=list(STRATEGY_KINDS),
                        help=f"comma-separated, from {','.join(STRATEGY_KINDS)} (default: all)")
    parser.add_argument("--amb", type=_csv(float), default=list(DEFAULT_AMB),
                        help="activation_memory_budget values of the compile_amb strategies (default: 0,0.2,0.5,1)")
    parser.add_argument("--dpcs-below", type=_csv(float), default=list(DEFAULT_BELOW),
                        help="extra dpcs budgets as fractions of the lowest upstream peak (default: 0.85,0.7)")
    parser.add_argument("--dpcs-fallback", action="store_true",
                        help="let a dpcs graph whose dpcs stage fails fall back to plain Inductor (recorded as "
                        "fallback) instead of recording the error (default: dpcs option strict=True)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per strategy (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per strategy first (default: 3)")
    parser.add_argument("--compiler", choices=("inductor", "eager"), default="inductor",
                        help="inductor (default), or eager: aot_eager for torch.compile, compiler='eager' for dpcs")
    parser.add_argument("--sgd", action="store_true", help="add an SGD step to each training step")
    parser.add_argument("--quick", action="store_true", help="tiny model sizes (tests)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    parser.add_argument("--check-targets", action="store_true", help="exit 1 when a target does not hold")
    parser.add_argument("--calibrate", nargs="?", const="steps", choices=("steps", "ops"), default=None,
                        help="also plan each pairwise budget calibrated, side by side with the uncalibrated plan: "
                        "'steps' (the default): the roofline fitted to the measured step times of the uncalibrated "
                        "dpcs points (dpcs_stepcal@..., option calibration), each timed again beside its "
                        "uncalibrated plan, then fitted again with those steps and timed once more "
                        "(dpcs_stepcal2@...); 'ops': fitted to each graph's own ops timed one by one (dpcs_cal@..., "
                        "option calibrate)")
    return parser


@contextlib.contextmanager
def compile_afresh() -> Iterator[None]:
    """Each compile derives its graphs anew (no FX-graph or AOTAutograd cache hits across strategies), and
    every strategy may add a Dynamo cache entry without reaching the recompile limit."""
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with contextlib.ExitStack() as stack:
        for config, key, value in ((torch._inductor.config, "fx_graph_cache", False),
                                   (torch._functorch.config, "enable_autograd_cache", False),
                                   (torch._dynamo.config, limit_name, 256)):
            if hasattr(config, key):
                stack.enter_context(config.patch(**{key: value}))
        yield


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for model in args.models:
        if model not in BENCH_MODELS:
            parser.error(f"unknown model {model!r}; valid choices: {', '.join(BENCH_MODELS)}")
    for kind in args.strategies:
        if kind not in STRATEGY_KINDS:
            parser.error(f"unknown strategy {kind!r}; valid choices: {', '.join(STRATEGY_KINDS)}")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    device = torch.device(args.device)
    log = lambda text: console.print(text, style="dim", highlight=False, markup=False)  # noqa: E731

    payload: dict[str, Any] = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "compiler": args.compiler,
        "steps": args.steps,
        "warmup": args.warmup,
        "sgd": args.sgd,
        "quick": args.quick,
        "amb": args.amb,
        "dpcs_below": args.dpcs_below,
        "dpcs_strict": not args.dpcs_fallback,
        "calibrate": args.calibrate,
        "models": {},
        "load_average_before": _load_average(),
    }
    load = payload["load_average_before"]
    if device.type == "cpu" and load is not None and load > (os.cpu_count() or 1):
        log(f"warning: the 1-minute load average is {load:.1f} on {os.cpu_count()} CPUs: "
            "other processes compete for the CPU and step times will be noisy")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"bench_{device.type}" + ("_quick" if args.quick else ""))
    with compile_afresh(), progress.task("dpcs bench", total=len(args.models)) as bench_progress:
        for model in args.models:
            bench_progress.detail(model)
            payload["models"][model] = run_model(model, args, device, log)
            bench_progress.advance()
            # Each model's results are on disk as soon as they are measured: a run cut short keeps them.
            partial = {**payload, "partial": len(payload["models"]) < len(args.models)}
            written = stem.with_suffix(".json.partial")
            written.write_text(json.dumps(partial, indent=2) + "\n")
            os.replace(written, stem.with_suffix(".json"))  # whole or not at all, if the run is killed meanwhile
    torch._dynamo.reset()
    payload["load_average_after"] = _load_average()
    payload["partial"] = False

    print_tables(payload, console)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(payload, stem.with_suffix(".png"))
    console.print(f"wrote {stem}.json and {stem}.png", highlight=False, markup=False)
    if args.check_targets:
        ok = all(
            m.get("targets", {}).get("pairwise_holds") is True
            and (not m["targets"]["lowest_peak"]["required"] or m["targets"]["lowest_peak"]["holds"] is True)
            for m in payload["models"].values()
        )
        return 0 if ok else 1
    return 0


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
