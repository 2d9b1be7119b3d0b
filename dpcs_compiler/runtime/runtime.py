"""The Runtime: called once per step, it reads the run's signals, runs the policies and switches every graph
dpcs compiled for the model to the variant of their decisions.

    rt = dpcs_compiler.Runtime(model, telemetry="runs/telemetry.jsonl")
    for batch in data:
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(batch)
        loss.backward()
        optimizer.step()
        rt.step(loss=loss, optimizer=optimizer)    # after the optimizer step; with AMP: scaler=scaler

Per step it only queues device ops (`runtime/signals.py`); every `signal_every` steps it reads them, combined
over the ranks of a distributed job, and the policies (`runtime/policies.py`) propose decisions, taken on
rank 0 (`distributed/signals.py`). A change takes effect at the next step: each graph runs the variant of
the new decisions, compiled at its first call and cached (`runtime/variants.py`). A thrash guard allows at
most `max_compiles` new variants per `compile_window` steps; beyond it the decisions hold and the log says so.

It also times each step (from one `step` call to the next, steps that compiled left out) per variant.
`calibrate_from_steps` fits the roofline to those times across the variants that recompute differently
(`cost.calibration.fit_step_calibration`, on rank 0) and plans the variants compiled from then on with it.

`run_step(step_fn)` runs one training step and, when it runs out of memory, frees, tightens the plan and
reruns it exactly (no update lost or applied twice), or says why it cannot (docs/oom.md).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.calibration import StepFit, StepSample, fit_step_calibration
from dpcs_compiler.cost.profiles import resolve_profile
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.ops import offload_ops  # noqa: F401  (times its ops in a CUDA profile measured here)
from dpcs_compiler.options import parse_memory_budget
from dpcs_compiler.report import compile_count
from dpcs_compiler.runtime.curvature import CurvatureProbe
from dpcs_compiler.runtime.decisions import Decisions, check_mode
from dpcs_compiler.runtime.oom_retry import StepAttempt
from dpcs_compiler.distributed.signals import decide_on_rank_zero, reduce_signals
from dpcs_compiler.options import config_from
from dpcs_compiler.runtime.policies import MemoryPolicy, Policy, PrecisionPolicy, Signals
from dpcs_compiler.runtime.signals import SignalCollector, reduce_rule
from dpcs_compiler.runtime.telemetry import Telemetry
from dpcs_compiler.runtime.variants import (
    CompileEvent,
    GraphDispatcher,
    VariantControl,
    mode_of,
    register_parameters,
    unregister_parameters,
)

log = logging.getLogger("dpcs.runtime")

STATE_VERSION = 1
STEP_TIMES_KEPT = 64  # the latest step times kept per variant


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """signal_every: steps per read of the signals (one host read, one small collective in a distributed
    job); decisions are taken at reads. grad_norm_every: steps per gradient-norm sample (the norms read every
    gradient once: most of the runtime's per-step cost; 1 samples every step). max_compiles / compile_window: at most this many new variants per
    window of steps (the thrash guard). telemetry_every: steps per telemetry write. max_oom_retries: how
    often `run_step` reruns a step that ran out of memory, each time with a tighter budget (0: never)."""

    signal_every: int = 10
    grad_norm_every: int = 1
    max_compiles: int = 4
    compile_window: int = 100
    telemetry_every: int = 10
    max_oom_retries: int = 2

    def __post_init__(self) -> None:
        for field, minimum in (("signal_every", 1), ("grad_norm_every", 1), ("max_compiles", 1), ("compile_window", 1), ("telemetry_every", 1),
                               ("max_oom_retries", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"RuntimeConfig.{field}={value!r} is not valid; valid choices: an int >= {minimum}")


def default_regions(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """The model's regions: the children of its containers (ModuleList, Sequential, ModuleDict: `blocks.0`)
    and every other child of the root as itself, each with its parameters; named as the compiled model's
    graphs name them (through a DDP wrapper: `module.blocks.0`)."""
    regions: dict[str, list[torch.nn.Parameter]] = {}
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)

    def visit(prefix: str, module: torch.nn.Module) -> None:
        if isinstance(module, wrappers):  # DDP(model): its modules are named "module.<name>" in the graph
            visit(f"{prefix}module.", module.module)
            return
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, wrappers):
                visit(f"{full}.", child)
            elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
                for sub_name, sub in child.named_children():
                    if any(True for _ in sub.parameters()):
                        regions[f"{full}.{sub_name}"] = list(sub.parameters())
            elif any(True for _ in child.parameters()):
                regions[full] = list(child.parameters())

    visit("", model)
    return regions


def _modules(models: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    models = [models] if isinstance(models, torch.nn.Module) else list(models)
    if not models or not all(isinstance(m, torch.nn.Module) for m in models):
        raise ValueError(f"Runtime needs a model or a list of models (torch.nn.Module), got {models!r}")
    # torch.compile's wrapper, DDP and FSDP wrappers hold the same parameters as the module they wrap.
    return [getattr(m, "_orig_mod", m) for m in models]


class _Timed(NamedTuple):
    """A timed variant (`Runtime._time_step`): its training plans' recompute terms (None when some graph has
    no memory plan, or offloads: no step sample) and the runtime decisions it ran under."""

    recomputes: list[dict[str, float]] | None
    decisions: Decisions


class Runtime:
    """Adapts the plans dpcs compiled for `models` between steps; see the module docstring."""

    def __init__(
        self,
        models: torch.nn.Module | Sequence[torch.nn.Module],
        policies: Sequence[Policy] | None = None,
        telemetry: str | Path | Telemetry | None = None,
        *,
        regions: Mapping[str, Iterable[torch.nn.Parameter]] | None = None,
        curvature: CurvatureProbe | None = None,
        config: RuntimeConfig | None = None,
        **config_fields: Any,
    ) -> None:
        self.config = config_from(RuntimeConfig, config, config_fields, "Runtime")
        modules = _modules(models)
        self.modules = modules
        self.parameters = list({id(p): p for m in modules for p in m.parameters()}.values())
        if regions is None:
            regions = {name: params for m in modules for name, params in default_regions(m).items()}
        self.regions = {name: list(params) for name, params in regions.items()}
        self.policies = list(policies) if policies is not None else [PrecisionPolicy(), MemoryPolicy()]
        if not all(isinstance(p, Policy) for p in self.policies):
            raise ValueError(f"Runtime policies must be Policy instances, got {self.policies!r}")
        if isinstance(telemetry, (str, Path)):
            telemetry = Telemetry(telemetry, every=self.config.telemetry_every)
        self.telemetry = telemetry
        if curvature is not None and not isinstance(curvature, CurvatureProbe):
            raise ValueError(f"Runtime curvature={curvature!r} is not valid; valid choices: None or a CurvatureProbe")
        self.curvature = curvature
        self._curvature: tuple[float, float | None] | None = None  # the last probe since the last read
        self.control = VariantControl()
        register_parameters(self.control, self.parameters)
        self.collector = SignalCollector(
            self.regions, [p for p in self.parameters if p.requires_grad], every=self.config.signal_every,
            watch_overflow_flag=self._graphs_detect_overflow,
        )
        self.step_count = 0
        self.seen: set[str] = set()  # decision keys whose variants were compiled
        self.compile_steps: list[int] = []  # steps at which the runtime switched to an unseen variant
        self.compile_events: list[CompileEvent] = []  # every variant compiled for the model, in order
        self.forced_precision: tuple[str, tuple[str, ...]] | None = None
        self.forced_budget: int | None = None
        self.last_signals: Signals | None = None
        self._launched_at: int | None = None
        self._closed = False
        self._warned_unbound = False
        # Step times per variant key, and what each variant's plans recompute (`calibrate_from_steps`).
        self.step_times: dict[str, collections.deque[float]] = {}
        # Each timed variant: what its plans recompute (None: no sample) and the decisions it ran under.
        self._timed: dict[str, _Timed] = {}
        # (when the step began, the compile count then, the decisions it runs under)
        self._timing: tuple[float, int, Decisions] | None = None
        self.calibration: tuple[float, float, float | None] | None = None
        self.step_fit: StepFit | None = None
        # Calibrations whose plans measured slower than the roofline's: never applied again.
        self.rejected_calibrations: list[tuple[float, float, float | None]] = []
        # ids of the buffers a step writes in place, copied before each `run_step` attempt to rerun it exactly:
        # the running statistics of norm layers from the start, and those a step run by `run_step` wrote.
        self._written_buffers = {id(b) for m in modules for sub in m.modules()
                                 if isinstance(sub, torch.nn.modules.batchnorm._NormBase) for b in sub.buffers(recurse=False)}

    # ---- what the runtime drives -------------------------------------------------------------------------

    @property
    def graphs(self) -> list[GraphDispatcher]:
        """The dispatchers of the graphs compiled for the model so far."""
        return sorted(self.control.dispatchers, key=lambda d: d.name)

    @property
    def decisions(self) -> Decisions:
        """The current decisions (before the first, the compile options' mode)."""
        return self.control.decisions or self._compiled()

    def _compiled(self) -> Decisions:
        graphs = self.graphs
        return Decisions(precision=mode_of(graphs[0].options) if graphs else "fp32")

    def _graphs_detect_overflow(self) -> bool:
        return any(d.options.overflow_detected for d in self.control.dispatchers)

    # ---- the step ----------------------------------------------------------------------------------------

    def step(self, loss: torch.Tensor | None = None, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None) -> Decisions | None:
        """Call once per step, after the optimizer step. Returns the new decisions when they changed at this
        step (they apply from the next step), else None."""
        if self._closed:
            raise RuntimeError("this Runtime was closed")
        ended = time.perf_counter()  # the training step ran until this call (the runtime's own work is not timed)
        del optimizer  # accepted for the loop's symmetry; the gradients are read from the parameters
        self.step_count += 1
        self.collector.collect(loss=loss, scaler=scaler, gradients=self.step_count % self.config.grad_norm_every == 0)
        if self.curvature is not None and self.curvature.due(self.step_count):
            value, ratio = self.curvature.probe(self.step_count)
            ratios = [r for r in (ratio, self._curvature[1] if self._curvature else None) if r is not None]
            self._curvature = (value, max(ratios) if ratios else None)  # the largest ratio since the last read
        changed = None
        if self.step_count % self.config.signal_every == 0:
            self.collector.launch_read()
            self._launched_at = self.step_count
        if self.step_count == self.config.signal_every and not self.control.dispatchers and not self._warned_unbound:
            self._warned_unbound = True
            warnings.warn(
                "dpcs Runtime: no graph compiled with backend='dpcs' takes this model's parameters, so its decisions "
                "change nothing; pass the module you compiled (or its parameters' owner) to Runtime",
                category=DpcsWarning, stacklevel=2,
            )
        if self._launched_at is not None and self.step_count >= self._launched_at + self.collector.lag:
            self._launched_at = None
            value, ratio = self._curvature or (None, None)
            vector = self.collector.take_read(curvature=value, curvature_ratio=ratio)
            vector = reduce_signals(vector, reduce_rule(len(self.collector.region_names)))
            self._curvature = None
            changed = self._decide(self.collector.snapshot_from(vector, self.step_count))
        self._record_compiles()
        self._time_step(ended)
        return changed

    # ---- step times and the calibration fitted to them ----------------------------------------------------

    def _time_step(self, ended: float) -> None:
        """The time from the end of the last `step` call to the start of this one is the training step that
        just ran; kept, under the variants its training graphs ran (each graph's compiled variant, the step
        planner's included), unless something compiled meanwhile (a compile, not the step, would be timed).
        Host time: on CUDA it is the device's step when the loop waits for it (reading its loss each step)."""
        count = compile_count()
        training = self._training_records()
        if self._timing is not None and self._timing[1] == count and training:
            ran = "+".join(f"{d.name}:{d.current_key}" for d, _ in training)
            self.step_times.setdefault(ran, collections.deque(maxlen=STEP_TIMES_KEPT)).append(ended - self._timing[0])
            records = [r for _, rs in training for r in rs]
            # A graph without a memory plan, or a plan that offloads (its copy time is not among the terms):
            # no sample.
            usable = all(r.recompute_terms is not None and not r.offloaded_values for r in records)
            self._timed[ran] = _Timed([r.recompute_terms for r in records] if usable else None, self._timing[2])
        self._timing = (time.perf_counter(), count, self.decisions)

    def _training_records(self) -> list[tuple[GraphDispatcher, list[Any]]]:
        """Each graph whose current variant is a training graph, with that variant's training records (an
        inference graph of the same model is not part of a training step's time)."""
        out = []
        for dispatcher in self.graphs:
            records = [r for r in dispatcher.records.get(dispatcher.current_key) or () if r.mode == "training"]
            if records:
                out.append((dispatcher, records))
        return out

    def step_samples(self, min_steps: int = 5) -> list[StepSample]:
        """One sample per variant timed at least `min_steps` times whose training graphs all have a memory plan
        that offloads nothing: what they recompute and the median of its step times."""
        if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
            raise ValueError(f"Runtime min_steps={min_steps!r} is not valid; valid choices: an int >= 1")
        return [
            StepSample.of(self._timed[key].recomputes, statistics.median(times))
            for key, times in self.step_times.items()
            if len(times) >= min_steps and key in self._timed and self._timed[key].recomputes
        ]

    def calibration_checks(self, min_steps: int = 5) -> list[tuple[float, float]]:
        """Each variant planned with the current calibration that was timed at least `min_steps` times, against
        the same decisions planned with the profile's roofline, timed as often: (its median step time, the
        roofline's). Empty without a calibration, or before both sides of a pair have run."""
        if self.calibration is None:
            return []
        timed: dict[Decisions, list[str]] = {}
        for key, entry in self._timed.items():
            if len(self.step_times[key]) >= min_steps:
                timed.setdefault(entry.decisions, []).append(key)
        checks = []
        for decisions, keys in timed.items():
            if decisions.calibration != self.calibration:
                continue
            for key in keys:
                for other in timed.get(dataclasses.replace(decisions, calibration=None), ()):
                    checks.append((statistics.median(self.step_times[key]), statistics.median(self.step_times[other])))
        return checks

    def calibrate_from_steps(self, min_steps: int = 5) -> StepFit:
        """Fit the roofline to the step times of the variants timed so far (`fit_step_calibration`: needs two
        variants that recompute differently, each timed `min_steps` times; fitting k terms takes k + 2) and,
        if it fits any term, cost the plans of the variants compiled from the next step on with it; a fit
        that keeps the profile's roofline plans with the roofline (no variant is compiled again for costs it
        was planned with).

        Call it again once a calibrated variant has run `min_steps` steps: the fit is refined with the steps
        of the plans it made, and the calibration is checked against them (`calibration_checks`). One whose
        variant measured slower than the same decisions planned with the roofline is dropped and never
        applied again (`rejected_calibrations`), as is a new fit within 5% of a rejected one: a fit explains
        the plans it was fitted to, and can be wrong about the plans it moves the planner to.
        Rank 0's fit and check are every rank's; every rank must call it at the same step. Too few variants:
        ValueError (on the other ranks of a job, RuntimeError naming rank 0's), and nothing changes."""

        def fit() -> tuple[StepFit, list[tuple[float, float]]]:
            samples = self.step_samples(min_steps)
            graphs = self.graphs
            if not graphs:
                raise ValueError("Runtime.calibrate_from_steps: no graph compiled with backend='dpcs' runs this model")
            device = next((p.device for p in self.parameters), torch.device("cpu"))
            profile = resolve_profile(graphs[0].options.hardware_profile, device).profile
            return fit_step_calibration(samples, launch_overhead_s=profile.launch_overhead_s), self.calibration_checks(min_steps)

        fitted, checks = rank_agreement.from_rank_zero(fit, "step calibration") if rank_agreement.world() else fit()
        self.step_fit = fitted
        calibration = fitted.calibration
        rejected = None
        if self.calibration is not None and any(mine > roofline for mine, roofline in checks):
            rejected, self.calibration = self.calibration, None
            self.rejected_calibrations.append(rejected)
            log.warning("step %d: plans costed with %s measured slower than the roofline's (%s): back to the "
                        "roofline, and this calibration is not applied again", self.step_count, rejected,
                        ", ".join(f"{a * 1e3:.3g} vs {b * 1e3:.3g} ms" for a, b in checks))
        values = (calibration.compute_scale, calibration.memory_scale, calibration.overhead_s)
        refused = fitted.fitted and any(_near(values, r) for r in self.rejected_calibrations)
        if self.telemetry is not None:
            self.telemetry.record({
                "step": self.step_count, "kind": "calibration", "fit": fitted.to_json(),
                "checks": [list(c) for c in checks], "rejected": None if rejected is None else list(rejected),
                "refused": refused,
            })
        if not fitted.fitted or refused:
            log.info("step %d: %d variants' step times %s (held-out error %.3g ms)", self.step_count, fitted.samples,
                     "fit a calibration already measured slower: the roofline stays" if refused
                     else "keep the profile's roofline", (fitted.held_out_s or 0.0) * 1e3)
            if rejected is not None or self.calibration is not None:  # back to the roofline's plans
                self.calibration = None
                self._decide_now()
            return fitted
        self.calibration = values
        log.info("step %d: costs fitted to %d variants' step times: %s (residual %.3g ms)", self.step_count,
                 fitted.samples, calibration, fitted.residual_s * 1e3)
        self._decide_now()
        return fitted

    def clear_calibration(self) -> None:
        """Plan with each graph's roofline as compiled again, from the next step."""
        self.calibration = self.step_fit = None
        self._decide_now()

    def run_step(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `step_fn(*args, **kwargs)`, one whole training step (zero the gradients, every micro-batch's
        forward and backward, the optimizer step); on `torch.OutOfMemoryError`, free, tighten the plan and
        rerun it, up to `max_oom_retries` times, when the rerun is exact. Returns what `step_fn` returns; call
        `step()` after it, once per step, retried or not.

        A rerun is exact when the failed attempt changed nothing a rerun would change again. Before an
        optimizer step begins, the parameters and the optimizer state are untouched: the rerun starts from
        every gradient set to None. Inside an optimizer step (tracked by torch's global optimizer step hooks)
        the parameters' version counters and a shallow copy of the state tell, without copying a tensor,
        whether the step had written anything that existed before it: if not (an OOM while it allocates its
        state, or its temporaries before the first write), the state it created is dropped and the rerun
        creates it again; if it had (foreach AdamW's weight decay is its first write), the update is partly
        applied and nothing cheap restores it: RuntimeError, raised from the OOM, saying so. So is an OOM
        after an optimizer step completed (a rerun would apply it twice), in a step that updated a buffer in
        place that run_step had not copied (it copies norm layers' running statistics, and the buffers a
        completed step updated, before each attempt: they are small), or in a step that did not zero the
        gradients it was given (accumulation over calls: the rerun would lose them). Retrying just the
        optimizer step was not chosen: what `step_fn` runs after it (a scheduler, logging) would not run, or
        run twice. The watch costs ~0.3 ms a step for 200 parameters (AdamW), no device work but the buffer copies.

        Each out-of-memory error is decided at once (`Signals(oom=True)`: `MemoryPolicy` tightens one level)
        and recorded in the telemetry (kind "oom": step, attempt, phase, the decisions after; "oom_recovered"
        when a rerun completed). With no retry left the OOM propagates, as without a Runtime, the parameters,
        optimizer state and buffers as before the step. In a distributed job it propagates at once, with no
        decision: the other ranks are in the step's
        collectives or past them, so a rank that reran alone would wait in collectives the others do not
        repeat, and a decision is itself a collective they do not join."""
        if self._closed:
            raise RuntimeError("this Runtime was closed")
        step = self.step_count + 1  # the number `step()` gives it
        attempt = 1
        while True:
            watch = StepAttempt(self)
            try:
                result = step_fn(*args, **kwargs)
            except torch.OutOfMemoryError as error:
                distributed = rank_agreement.world() is not None
                inexact = None if distributed else watch.inexact(self)
                retry = not distributed and inexact is None and attempt <= self.config.max_oom_retries
                phase = watch.phase(error)
                if not distributed and inexact is None:
                    watch.restore()  # for the rerun, or for a caller that catches the OOM and goes on
                if retry:
                    traceback.clear_frames(error.__traceback__)  # the failed attempt's frames hold its tensors
                self._on_oom(step, attempt, phase, watch, error, retry=retry, why=inexact, decide=not distributed)
                if inexact is not None:
                    raise RuntimeError(f"dpcs Runtime.run_step: step {step} ran out of memory ({phase}) and is not rerun, "
                                       f"as a rerun would not be exact: {inexact}") from error
                if not retry:
                    raise
            else:
                self._written_buffers.update(
                    id(b) for (_, b), version in zip(watch.buffers, watch.buffer_versions) if b._version != version)
                if attempt > 1 and self.telemetry is not None:
                    self.telemetry.record({
                        "step": step, "kind": "oom_recovered", "attempts": attempt, "decisions": self.decisions.to_json(),
                        "variant": self.decisions.key(), "budget_bytes": self._budget_bytes(),
                        "planned_peak_bytes": self._planned_peak_bytes(),
                    })
                return result
            finally:
                watch.remove_hooks()
            for p in [*self.parameters, *(p for o in watch.optimizers for g in o.param_groups for p in g["params"])]:
                p.grad = None
            del watch
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            attempt += 1

    def _on_oom(self, step: int, attempt: int, phase: str, watch: StepAttempt, error: BaseException, *, retry: bool,
                why: str | None, decide: bool) -> None:
        """Decide on a caught out-of-memory error at once (the next read does not count it again) and record it."""
        failed = (self._budget_bytes(), self._planned_peak_bytes())  # the attempt's variant
        self._record_compiles()  # its compiles: a plan that did not fit stops the policy going tighter
        changed = self._decide(Signals(step=self.step_count, steps=0, oom=True)) if decide else None
        optimizer = watch.running[-1].optimizer if watch.running else None
        log.warning("step %d ran out of memory (%s, attempt %d): %s", step, phase, attempt,
                    f"rerun with {self.decisions.describe()}" if retry else "not rerun" + (f" ({why})" if why else ""))
        if self.telemetry is not None:
            self.telemetry.record({
                "step": step, "kind": "oom", "attempt": attempt, "phase": phase,
                "optimizer": None if optimizer is None else type(optimizer).__name__,
                "error": str(error).splitlines()[0][:200] if str(error) else type(error).__name__,
                "budget_bytes": failed[0], "planned_peak_bytes": failed[1], "retried": retry, "why_not": why,
                "decisions": self.decisions.to_json(), "variant": self.decisions.key(), "changed": changed is not None,
            })
            if not retry:
                self.telemetry.flush()  # the error may end the process

    def _decide(self, signals: Signals) -> Decisions | None:
        self.last_signals = signals
        for policy in self.policies:
            if isinstance(policy, PrecisionPolicy):
                policy.start(self._compiled().precision)
            policy.update(signals)
        reasons = [f"{p.name}: {p.reason}" for p in self.policies if p.reason]
        proposed, held = decide_on_rank_zero(self._proposal)
        if held:
            log.warning("step %d: %s", self.step_count, held)
        changed = self._apply(proposed)
        for reason in reasons:
            log.info("step %d: %s", self.step_count, reason)
        if self.telemetry is not None:
            self.telemetry.record({
                "step": self.step_count, "kind": "signals", "signals": signals.to_json(), "decisions": self.decisions.to_json(),
                "variant": self.decisions.key(), "changed": changed is not None, "reasons": reasons, "held": held,
                "budget_bytes": self._budget_bytes(), "planned_peak_bytes": self._planned_peak_bytes(),
                **({"curvature_seconds": round(self.curvature.seconds, 4), "curvature_probes": self.curvature.probes}
                   if self.curvature is not None else {}),
            })
        return changed

    def _proposal(self) -> tuple[Decisions, str | None]:
        """The policies' decisions with the overrides on top, and why they are held if the guard holds them."""
        decisions = self._compiled()  # each policy sets its own part; overrides go on top
        for policy in self.policies:
            decisions = policy.propose(decisions)
        decisions = self._overridden(decisions)
        current = self.control.decisions or self._compiled()
        if decisions.key() not in self.seen and decisions not in (current, self._compiled()):
            recent = [s for s in self.compile_steps if s > self.step_count - self.config.compile_window]
            if len(recent) >= self.config.max_compiles:
                return current, (
                    f"thrash guard: {len(recent)} variants compiled in the last {self.config.compile_window} steps "
                    f"(max_compiles={self.config.max_compiles}); holding {current.describe()} instead of compiling "
                    f"{decisions.describe()}"
                )
        return decisions, None

    def _overridden(self, decisions: Decisions) -> Decisions:
        if self.forced_precision is not None:
            mode, regions = self.forced_precision
            decisions = dataclasses.replace(decisions, precision=mode, fp32_regions=regions)
        if self.forced_budget is not None:
            decisions = dataclasses.replace(decisions, budget_bytes=self.forced_budget, budget_scale=None)
        if self.calibration is not None:
            decisions = dataclasses.replace(decisions, calibration=self.calibration)
        return decisions

    def _apply(self, decisions: Decisions) -> Decisions | None:
        if self.control.decisions is None and decisions == self._compiled():
            return None
        if not self.control.set(decisions):
            return None
        if decisions.key() not in self.seen:
            self.compile_steps.append(self.step_count)
            self.seen.add(decisions.key())
        log.info("step %d: switching to %s (variant %s)", self.step_count, decisions.describe(), decisions.key())
        return decisions

    def _record_compiles(self) -> None:
        events, self.control.events[:] = list(self.control.events), []
        if events and self.telemetry is not None:
            self.telemetry.record({
                "step": self.step_count, "kind": "compiles", "compiles": [e.to_json() for e in events],
                "variant": self.decisions.key(), "decisions": self.decisions.to_json(), "budget_bytes": self._budget_bytes(),
                "planned_peak_bytes": self._planned_peak_bytes(),
            })
        self.compile_events.extend(events)
        for event in events:
            if event.feasible is False:
                for policy in self.policies:
                    if isinstance(policy, MemoryPolicy) and self.decisions.budget_scale is not None:
                        policy.no_tighter()

    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return list({id(b): (name, b) for m in self.modules for name, b in m.named_buffers()}.values())

    def _budget_bytes(self) -> int | None:
        budgets = [d.current_budget_bytes for d in self.control.dispatchers if d.current_budget_bytes is not None]
        return max(budgets) if budgets else None

    def _planned_peak_bytes(self) -> int | None:
        peaks = [d.current_peak_bytes for d in self.control.dispatchers if d.current_peak_bytes is not None]
        return max(peaks) if peaks else None

    # ---- overrides ---------------------------------------------------------------------------------------

    def force_precision(self, mode: str, regions: Iterable[str] = ()) -> None:
        """Run in `mode` (and keep `regions` in fp32) from the next step, whatever the policies say, until
        `clear_overrides`. Every rank must call it at the same step (rank 0's call decides)."""
        check_mode("Runtime.force_precision mode", mode)
        regions = tuple(regions)
        unknown = [r for r in regions if r not in self.regions]
        if unknown:
            raise ValueError(f"Runtime.force_precision regions {unknown} are not regions of the model; valid choices: {sorted(self.regions)}")
        self.forced_precision = (mode, regions)
        self._decide_now()

    def force_budget(self, budget: int | str) -> None:
        """Plan every graph with this memory budget (bytes, or "6GiB") from the next step, until `clear_overrides`."""
        value = parse_memory_budget(budget)
        if not isinstance(value, int):
            raise ValueError(f"Runtime.force_budget({budget!r}) is not valid; valid choices: bytes as an int > 0 or a size string like '6GiB'")
        self.forced_budget = value
        self._decide_now()

    def clear_overrides(self) -> None:
        """Back to the policies' decisions from the next step."""
        self.forced_precision = None
        self.forced_budget = None
        self._decide_now()

    def _decide_now(self) -> None:
        proposed, held = decide_on_rank_zero(self._proposal)
        if held:
            log.warning("step %d: %s", self.step_count, held)
        self._apply(proposed)

    # ---- state -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to compile the same variant first and take the same decisions."""
        return {
            "version": STATE_VERSION,
            "step": self.step_count,
            "decisions": None if self.control.decisions is None else self.control.decisions.to_json(),
            "forced_precision": None if self.forced_precision is None else [self.forced_precision[0], list(self.forced_precision[1])],
            "forced_budget": self.forced_budget,
            "policies": [{"name": p.name, "type": type(p).__name__, "state": p.state_dict()} for p in self.policies],
            "references": dict(self.control.references),
            "seen": sorted(self.seen),
            "compile_steps": list(self.compile_steps),
            "signals": self.collector.state_dict(),
            "launched_at": self._launched_at,  # a read launched, taken at a later step (accelerators)
            "curvature": None if self.curvature is None else self.curvature.state_dict(),
            "calibration": None if self.calibration is None else list(self.calibration),
            "rejected_calibrations": [list(c) for c in self.rejected_calibrations],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Runtime state version {state.get('version')!r} is not valid; valid choices: {STATE_VERSION}")
        saved = [(p["name"], p["type"]) for p in state["policies"]]
        mine = [(p.name, type(p).__name__) for p in self.policies]
        if saved != mine:
            raise ValueError(f"Runtime state was saved with policies {saved}; this runtime has {mine}")
        for policy, saved_policy in zip(self.policies, state["policies"]):
            policy.load_state_dict(saved_policy["state"])
        self.step_count = state["step"]
        forced = state["forced_precision"]
        self.forced_precision = None if forced is None else (forced[0], tuple(forced[1]))
        self.forced_budget = state["forced_budget"]
        self.control.references.update(state["references"])
        self.seen = set(state["seen"])
        self.compile_steps = list(state["compile_steps"])
        self.collector.load_state_dict(state["signals"])
        self._launched_at = state.get("launched_at")
        calibration = state.get("calibration")
        # Checked here (Decisions validates it), not at the next decision.
        self.calibration = None if calibration is None else Decisions(calibration=tuple(calibration)).calibration
        self.rejected_calibrations = [Decisions(calibration=tuple(c)).calibration
                                      for c in state.get("rejected_calibrations", ())]
        self._timing = None  # the first interval after a restore would span the restore
        if self.curvature is not None and state.get("curvature") is not None:
            self.curvature.load_state_dict(state["curvature"])
        decisions = state["decisions"]
        self.control.set(None if decisions is None else Decisions.from_json(decisions))

    def close(self) -> None:
        """Write the telemetry left in the buffer and return the graphs to their compile options."""
        if self._closed:
            return
        self._record_compiles()
        if self.telemetry is not None:
            self.telemetry.close()
        unregister_parameters(self.control)
        self._closed = True

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _near(a: Sequence[float | None], b: Sequence[float | None], tolerance: float = 0.05) -> bool:
    """Whether two calibrations (compute_scale, memory_scale, overhead_s) are within `tolerance` of each other
    in every term (an overhead of None, the profile's, only near None)."""
    return all(
        x is y is None or (x is not None and y is not None and abs(x - y) <= tolerance * max(abs(x), abs(y)))
        for x, y in zip(a, b)
    )
