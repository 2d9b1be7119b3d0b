"""Measured peak memory of a piece of work, on CPU or CUDA.

CPU: the profiler's memory events (`profile_memory=True`) report every allocation and free of the CPU
allocator, Inductor's buffers included; a running sum of their byte deltas gives the peak above what was
allocated when measuring began. CUDA: `reset_peak_memory_stats` / `max_memory_allocated`.
On CPU the bytes alive before the work (parameters, inputs) are not visible to the profiler, so the
absolute peak is `baseline_bytes + peak_increase_bytes` with a baseline the caller counts
(`resident_bytes` sums tensors exactly, shared storages once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
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

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
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
