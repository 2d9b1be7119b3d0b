"""Measured peak memory of a piece of work, on CPU or CUDA.

CPU: the profiler's memory events (`profile_memory=True`) report every allocation and free of the CPU
allocator, Inductor's buffers included; a running sum of their byte deltas gives the peak above what was
allocated when measuring began. CUDA: `reset_peak_memory_stats` / `max_memory_allocated`.
On CPU the bytes alive before the work (parameters, inputs) are not visible to the profiler, so the
absolute peak is `baseline_bytes + peak_increase_bytes` with a baseline the caller counts
(`resident_bytes` sums tensors exactly, shared storages once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    device: str
    peak_increase_bytes: int  # highest bytes allocated during the work, above the level when it began
    baseline_bytes: int | None  # bytes allocated when it began (CUDA); None on CPU, where it cannot be read

    def absolute(self, baseline_bytes: int | None = None) -> int:
        """The absolute peak: the measured baseline, or one the caller counted (required on CPU)."""
        baseline = self.baseline_bytes if baseline_bytes is None else baseline_bytes
        if baseline is None:
            raise ValueError("the CPU profiler cannot see memory allocated before measuring; pass baseline_bytes")
        return baseline + self.peak_increase_bytes


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and repeats counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


# Kineto writes these to stderr at every profiler start and stop ("USDT: ... profiler_start").
_PROFILER_NOISE = re.compile(rb"^(USDT|STAGE):\S* \S+ \S+ \S+\] ")


@contextlib.contextmanager
def quiet_profiler_logs() -> Iterator[None]:
    """Around a profiler's start or stop: drop kineto's progress lines from stderr, pass every other line on.

    Kineto logs from C++ to file descriptor 2, so the descriptor is pointed at a temporary file for the
    duration (only the start or stop itself: the profiled work writes to the real stderr) and what is not
    kineto's progress noise is written back.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured.read().splitlines(keepends=True) if not _PROFILER_NOISE.match(line))
            if kept:
                os.write(2, kept)


def measure_peak_memory(fn: Callable[..., T], *args: Any, device: str | torch.device = "cpu", **kwargs: Any) -> tuple[T, PeakMemory]:
    """Run `fn(*args, **kwargs)` once and return its result and the peak memory it reached."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline
        return result, PeakMemory(str(device), peak, baseline)
    if device.type != "cpu":
        raise ValueError(f"measure_peak_memory: device {str(device)!r} is not supported; valid choices: 'cpu', 'cuda'")
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_profiler_logs():
        prof.start()
    try:
        result = fn(*args, **kwargs)
    finally:
        with quiet_profiler_logs():
            prof.stop()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for event in events:
        level += event.nbytes()
        peak = max(peak, level)
    return result, PeakMemory("cpu", peak, None)


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """One compiled training step (forward + backward, gradients set to None before it), measured.

    predicted_peak_bytes is dpcs's simulated peak of the step's graph (None unless the step compiled to
    exactly one training graph: a step of several graphs is not one simulated timeline yet).
    """

    device: str
    predicted_peak_bytes: int | None
    measured_peak_bytes: int
    resident_bytes: int  # parameters, buffers and inputs alive before the step
    step_seconds: float  # median wall time of the timed steps (no profiler attached)
    graphs: int

    @property
    def relative_error(self) -> float | None:
        if self.predicted_peak_bytes is None:
            return None
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes


def measure_training_step(
    model: torch.nn.Module,
    compiled: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device: str | torch.device = "cpu",
    predicted_peak_bytes: int | None = None,
) -> StepMeasurement:
    """Warm up (compiles), measure one step's peak memory, then time `repeats` steps; median time.

    The prediction compared against is `predicted_peak_bytes`, else that of the one training graph the
    warm-up compiled (None when it compiled none, e.g. already compiled, or several).
    """
    from dpcs_compiler.report import compile_records, records_since

    records_before = compile_records()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = compiled(*inputs)
        loss = out if loss_fn is None else loss_fn(out)
        loss.backward()

    for _ in range(warmup):
        step()
    model.zero_grad(set_to_none=True)
    resident = resident_bytes([*model.parameters(), *model.buffers(), *inputs])
    _, peak = measure_peak_memory(step, device=device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    new_records = records_since(records_before)
    records = [r for r in new_records if r.mode == "training"]
    predicted = predicted_peak_bytes
    if predicted is None and len(records) == 1:
        predicted = records[0].predicted_peak_bytes
    measured = peak.absolute(resident if peak.baseline_bytes is None else None)
    return StepMeasurement(
        device=str(device),
        predicted_peak_bytes=predicted,
        measured_peak_bytes=measured,
        resident_bytes=resident,
        step_seconds=statistics.median(times),
        graphs=len(new_records),
    )
