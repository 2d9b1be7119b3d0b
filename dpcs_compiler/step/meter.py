"""Measuring a planned step and the optimizer step after it: the absolute peak, at the step's turn and
elsewhere, on CUDA from the caching allocator's history and on CPU from the profiler's memory events."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dpcs_compiler.measure import CpuMemoryProfile, CudaMemoryTrace


class _Meter:
    """The absolute peak of one step, from its first forward call to the end of its last backward, in two
    parts: at the step's turn (after its last forward call returned, before its first backward started: eager
    code there, such as a loss) and elsewhere.

    CUDA: the caching allocator's history between marks (`measure.CudaMemoryTrace`: everything allocated
    counts, optimizer state and memory outside the graphs included; the allocator's peak statistics, the
    user's, are not touched), and the most it reserved over the step (`reserved_peak`). CPU: the profiler's
    memory events, with the marks recorded in its timeline, above `baseline`: what the step's own tensors hold
    when it starts, counted from its calls (parameters, gradients already there, DDP's buckets, FSDP2's
    shards, the first call's inputs). Memory allocated before the step for anything else (optimizer state) is
    not seen on CPU. The profiler is stopped later, outside the backward (`read`): one stopped inside a
    backward hook stays on for its thread. No CPU step is measured while another profiler runs.
    """

    FORWARD_END, BACKWARD_START, STEP_END = "dpcs::forward_end", "dpcs::backward_start", "dpcs::step_end"

    def __init__(self, device: torch.device, profile: CpuMemoryProfile | None = None,
                 trace: CudaMemoryTrace | None = None) -> None:
        self.device, self.profile, self.trace = device, profile, trace
        self.backward_started = False
        self.reserved_peak: int | None = None  # CUDA, once read: the most reserved over the step

    @classmethod
    def start(cls, args: Sequence[Any]) -> _Meter | None:
        device = next((x.device for x in args if isinstance(x, torch.Tensor)), torch.device("cpu"))
        if device.type == "cuda":
            return cls(device, trace=CudaMemoryTrace(device).start())
        if device.type == "cpu" and not CpuMemoryProfile.busy():
            return cls(device, CpuMemoryProfile().start())
        return None

    def mark(self, name: str) -> None:
        if name == self.BACKWARD_START:
            if self.backward_started:
                return
            self.backward_started = True
        if self.profile is not None:
            CpuMemoryProfile.mark(name)
        elif self.trace is not None:
            self.trace.mark(name)

    def discard(self) -> None:
        """Stop measuring (a CPU profiler is stopped; call outside a backward)."""
        if self.profile is not None:
            self.profile.stop()
        elif self.trace is not None:
            self.trace.stop()

    def read(self, baseline: int, at_end: bool = False) -> tuple[int, int, int | None] | None:
        """(the step's absolute peak outside its turn, at its turn, and, `at_end`, what is allocated now: the
        step ended, an optimizer step starts), outside the backward (a CPU profiler is stopped here); None if it
        was not measured to its end."""
        if self.profile is not None:
            ends, starts, done = (self.profile.mark_times(n) for n in (self.FORWARD_END, self.BACKWARD_START, self.STEP_END))
            if not (ends and starts and done) or ends[0] > starts[0]:
                return None
            turn_start = max(t for t in ends if t <= starts[0])
            before, turn, after, _ = self.profile.window_peaks([turn_start, starts[0], done[0]])
            return baseline + max(before, after), baseline + turn, baseline + self.profile.level() if at_end else None
        windows = self.trace.windows() if self.trace is not None else None
        if windows is None:
            return None
        closed = [w.closed_by for w in windows]
        if self.STEP_END not in closed or self.BACKWARD_START not in closed:
            return None
        turn = closed.index(self.BACKWARD_START)
        if windows[turn].opened_by != self.FORWARD_END:
            return None
        last = closed.index(self.STEP_END)
        self.reserved_peak = max(w.reserved_peak for w in windows[: last + 1])
        others = [w.allocated_peak for i, w in enumerate(windows[: last + 1]) if i != turn]
        if at_end:
            torch.cuda.synchronize(self.device)
        return max(others), windows[turn].allocated_peak, int(torch.cuda.memory_allocated(self.device)) if at_end else None


class _OptimizerMeter:
    """What one optimizer step allocates beyond what it starts and ends with: its temporaries (a first step's
    new state, alive at its end, is not among them). CUDA: the caching allocator's history over it
    (`measure.CudaMemoryTrace`); CPU: the profiler's memory events."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, start: int,
                 profile: CpuMemoryProfile | None, trace: CudaMemoryTrace | None = None) -> None:
        self.optimizer, self.device, self.start_bytes, self.profile = weakref.ref(optimizer), device, start, profile
        self.trace = trace

    @classmethod
    def start(cls, optimizer: torch.optim.Optimizer) -> _OptimizerMeter | None:
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        device = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
        if device.type == "cuda":
            trace = CudaMemoryTrace(device).start()
            return cls(optimizer, device, trace.allocated, None, trace)
        if CpuMemoryProfile.busy():
            return None
        return cls(optimizer, device, 0, CpuMemoryProfile().start())

    def read(self) -> tuple[int, int]:
        """(bytes allocated at its peak beyond both its start and its end, bytes it left allocated beyond its start)."""
        if self.profile is not None:
            peak, end = self.profile.peak_increase_bytes(), self.profile.level()
        else:
            torch.cuda.synchronize(self.device)
            windows = self.trace.windows() if self.trace is not None else None
            end = int(torch.cuda.memory_allocated(self.device)) - self.start_bytes
            peak = windows[0].allocated_peak - self.start_bytes if windows else max(0, end)
        return max(0, peak - max(0, end)), max(0, end)

    def discard(self) -> None:
        if self.profile is not None:
            self.profile.stop()
        elif self.trace is not None:
            self.trace.stop()
