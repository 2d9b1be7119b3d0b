"""Measured peak memory of a piece of work, on CPU or CUDA.

CPU: the profiler's memory events (`profile_memory=True`) report every allocation and free of the CPU
allocator, Inductor's buffers included; a running sum of their byte deltas gives the peak above what was
allocated when measuring began. CUDA: the caching allocator's history over the work (`CudaMemoryTrace`),
allocated and reserved; the allocator's peak statistics are the user's and are never reset.
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
from torch._C._profiler import _ExtraFields_Allocation as _Allocation

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    device: str
    peak_increase_bytes: int  # highest bytes allocated during the work, above the level when it began
    baseline_bytes: int | None  # bytes allocated when it began (CUDA); None on CPU, where it cannot be read
    reserved_peak_bytes: int | None = None  # CUDA: the most the caching allocator held from the device

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


# Kineto writes these to stderr at every profiler start and stop ("USDT: ... profiler_start"); the CPU
# allocator's reporter warns when a block allocated before profiling is freed during it (every 1000th time).
_PROFILER_NOISE = re.compile(
    rb"^(USDT|STAGE):\S* \S+ \S+ \S+\] |^\[W\S* \S+ CPUAllocator\.cpp:\d+\] Memory block of unknown size"
)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of an optimizer's state on its device: a dpcs `CompressedOptimizer`'s (its host buffers left out),
    or the distinct storages of a torch optimizer's state tensors (step counts left out)."""
    state_bytes = getattr(optimizer, "state_bytes", None)
    if callable(state_bytes):
        return state_bytes()["device"]
    return resident_bytes([t for state in optimizer.state.values() for t in state.values()
                           if isinstance(t, torch.Tensor) and t.dim() > 0])


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


class CpuMemoryProfile:
    """The CPU allocator's events from `start()` to `stop()`, read from the profiler (`profile_memory=True`).

    A `mark(name)` in between (from any thread the profiler follows, the autograd engine's included) records a
    point in time; `window_peaks` gives the peak above the level at `start()` between such points. Stop
    it from the thread that started it, outside a backward: the autograd engine restores a thread's profiler
    state after its hooks, so a profiler stopped inside one stays on for that thread.
    Functions that want the profiler to themselves finish these first (`BEFORE_PROFILING`).
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._events: list[Any] | None = None

    @staticmethod
    def busy() -> bool:
        """Whether a profiler is on in this thread (another cannot start)."""
        return bool(torch.autograd.profiler._is_profiler_enabled)

    _primed = False

    def start(self) -> CpuMemoryProfile:
        with quiet_profiler_logs():
            primer = torch.empty(64, dtype=torch.uint8) if not CpuMemoryProfile._primed else None
            self._profile.start()
            # The allocator warns at the first free of a block allocated before profiling, and then at every
            # 1000th: a measured training step frees such blocks (the last step's loss). Make the first here,
            # where the warning is filtered, not in the user's step.
            del primer
            CpuMemoryProfile._primed = True
        return self

    @staticmethod
    def mark(name: str) -> None:
        with torch.profiler.record_function(name):
            pass

    def stop(self) -> None:
        if self._events is not None:
            return
        with quiet_profiler_logs():
            self._profile.stop()
        self._events = list(self._profile.profiler.kineto_results.events())

    def mark_times(self, name: str) -> list[int]:
        """When each mark `name` was made (profiler clock, ns), in order; stops the profiler first."""
        return sorted(e.start_ns() for e in self._stopped_events() if e.name() == name)

    def window_peaks(self, bounds: Sequence[int]) -> list[int]:
        """The highest bytes allocated above the level at `start()` in each window: up to `bounds[0]`, then
        between consecutive bounds (profiler clock, ns, ascending), then after the last; stops the profiler."""
        memory = sorted(self._allocations(), key=lambda event: event[0])  # stable: one instant keeps its order
        peaks = [0] * (len(bounds) + 1)
        window = level = 0
        for at, nbytes in memory:
            while window < len(bounds) and at > bounds[window]:
                window += 1
                peaks[window] = level  # what is allocated when a window opens counts in it
            level += nbytes
            peaks[window] = max(peaks[window], level)
        for later in range(window + 1, len(peaks)):
            peaks[later] = level
        return peaks

    def level(self) -> int:
        """The bytes allocated above the level at `start()` when it stopped; stops the profiler."""
        return sum(nbytes for _, nbytes in self._allocations())

    def peak_increase_bytes(self) -> int:
        """The highest bytes allocated above the level at `start()`; stops the profiler first."""
        return self.window_peaks(())[0]

    def _allocations(self) -> list[tuple[int, int]]:
        """(when, bytes: negative for a free) of each CPU allocator event, in the profiler's order.

        A block freed on a thread the profiler does not follow has no free event (its state is per thread: gloo's
        worker thread drops the last reference to a collective's buffers when the rank's thread did not, a few
        ms later). An allocation at the address of a block still counted alive shows it was freed by then: it
        is counted freed there, not alive to the end (FSDP2 on gloo: steps of one plan measured 35.7-41.0 MB,
        in whole blocks' gathers, for want of those frees)."""
        self.stop()
        return with_unseen_frees(sorted(
            ((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr) for e in self._tree()
             if isinstance(e.extra_fields, _Allocation) and e.extra_fields.device.type == "cpu"),
            key=lambda event: event[0]))

    def _tree(self) -> Iterator[Any]:
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            yield event
            stack.extend(event.children)

    def _stopped_events(self) -> list[Any]:
        self.stop()
        assert self._events is not None
        return self._events


def with_unseen_frees(events: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(when, bytes: negative for a free) of allocator events given as (when, bytes, address) in time order, with
    a free added where a block counted alive was freed unseen: just before an allocation takes its address."""
    alive: dict[int, int] = {}
    out: list[tuple[int, int]] = []
    for at, nbytes, address in events:
        if nbytes > 0:
            unseen = alive.pop(address, 0)
            if unseen:
                out.append((at, -unseen))
            alive[address] = nbytes
        else:
            alive.pop(address, None)
        out.append((at, nbytes))
    return out


CUDA_MARKER_BYTES = 1  # a mark in the allocator's history: a one-byte allocation at an address noted
CUDA_HISTORY_ENTRIES = 2_000_000  # the most history entries kept while dpcs records (a ring: older ones go)
_recording = {"traces": 0}  # CudaMemoryTraces that recorded history and have not stopped


def _cuda_history_enabled() -> bool:
    """Whether the allocator records its history now (the program's own recording, or dpcs's)."""
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if query is not None:
        return bool(query())
    return any(torch.cuda.memory._snapshot()["device_traces"])  # turning it off clears the history


@dataclasses.dataclass(frozen=True)
class MemoryWindow:
    """The allocator between two marks: the highest bytes allocated and reserved, and both at its end."""

    opened_by: str
    closed_by: str | None  # None: the last window, to the end of the history read
    allocated_peak: int
    reserved_peak: int
    allocated_end: int
    reserved_end: int


def allocator_windows(events: Sequence[Sequence[Any]], marks: Sequence[tuple[str, int]], allocated: int,
                      reserved: int) -> list[MemoryWindow] | None:
    """Allocated and reserved levels between marks, from the allocator's history: `events` as
    [action, address, size] (the trace's entries), `marks` the (name, address) of each mark's one-byte
    allocation in the order made, the first being where `allocated` and `reserved` were read. Allocations
    count their size rounded to the allocator's 512 B; reserved follows the segment events. None if a mark
    is missing from the history (a ring that wrapped)."""
    positions, i = [], 0
    for _, address in marks:
        while i < len(events) and not (events[i][0] == "alloc" and events[i][1] == address
                                       and events[i][2] == CUDA_MARKER_BYTES):
            i += 1
        if i == len(events):
            return None
        positions.append(i)
        i += 1
    skip = set(positions)
    skip.update(_marker_frees(events, positions))
    windows: list[MemoryWindow] = []
    level, held = allocated, reserved
    start = positions[0] if positions else 0
    bounds = positions[1:] + [len(events)]
    names = [n for n, _ in marks] or ["start"]
    at = start + 1
    for w, end in enumerate(bounds):
        peak_allocated, peak_reserved = level, held
        for j in range(at, end):
            if j in skip:
                continue
            action, size = events[j][0], int(events[j][2])
            if action == "alloc":
                level += -(-size // 512) * 512
            elif action == "free_completed":
                level -= -(-size // 512) * 512
            elif action in ("segment_alloc", "segment_map"):
                held += size
            elif action in ("segment_free", "segment_unmap"):
                held -= size
            peak_allocated, peak_reserved = max(peak_allocated, level), max(peak_reserved, held)
        windows.append(MemoryWindow(names[w], names[w + 1] if w + 1 < len(names) else None, peak_allocated,
                                    peak_reserved, level, held))
        at = end + 1
    return windows


def _marker_frees(events: Sequence[Sequence[Any]], positions: Sequence[int]) -> list[int]:
    """The positions of the free entries of each mark's allocation (the first free of its address after it)."""
    found = []
    for p in positions:
        address = events[p][1]
        for j in range(p + 1, len(events)):
            if events[j][1] == address and events[j][0] in ("free_requested", "free_completed"):
                found.append(j)
                if events[j][0] == "free_completed":
                    break
    return found


class CudaMemoryTrace:
    """The caching allocator's history on one CUDA device from `start()` to `stop()`: what it allocated and
    reserved between marks, read without the allocator's peak statistics, which are the program's own (dpcs
    never resets them).

    History is recorded (`torch.cuda.memory._record_memory_history`, no stack frames) only while a trace
    runs, unless the program records it itself: then its history is read and left as it is. `mark(name)`,
    from any thread, places a mark: a one-byte allocation whose address is noted.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.marks: list[tuple[str, int]] = []
        self.recording = False  # whether this trace turned the history on (and turns it off)
        self.allocated = self.reserved = 0
        self._windows: list[MemoryWindow] | None = None
        self._stopped = False

    def start(self) -> CudaMemoryTrace:
        if _recording["traces"] > 0 or not _cuda_history_enabled():
            if _recording["traces"] == 0:
                torch.cuda.memory._record_memory_history("all", context=None, max_entries=CUDA_HISTORY_ENTRIES)
            _recording["traces"] += 1
            self.recording = True
        self.allocated = int(torch.cuda.memory_allocated(self.device))
        self.reserved = int(torch.cuda.memory_reserved(self.device))
        self.mark("start")
        return self

    def mark(self, name: str) -> None:
        marker = torch.empty(CUDA_MARKER_BYTES, dtype=torch.uint8, device=self.device)
        self.marks.append((name, marker.data_ptr()))
        del marker

    def stop(self) -> None:
        """Read the history (once; later calls do nothing) and stop recording if this trace started it."""
        if self._stopped:
            return
        self._stopped = True
        try:
            traces = torch.cuda.memory._snapshot()["device_traces"]
        finally:
            if self.recording:
                _recording["traces"] -= 1
                if _recording["traces"] == 0:
                    torch.cuda.memory._record_memory_history(None)
        trace = traces[self.device.index] if self.device.index < len(traces) else []
        events = [(e["action"], e.get("addr", 0), e.get("size", 0)) for e in trace]
        self._windows = allocator_windows(events, self.marks, self.allocated, self.reserved)

    def windows(self) -> list[MemoryWindow] | None:
        """The windows between marks (the first opened by `start`); None if the history lost a mark."""
        self.stop()
        return self._windows


# Called before dpcs measures with the profiler: whoever keeps a profiler running across calls (the step
# recorder's meter) finishes with it, as only one profiler runs at a time.
BEFORE_PROFILING: list[Callable[[], None]] = []


def measure_peak_memory(fn: Callable[..., T], *args: Any, device: str | torch.device = "cpu", **kwargs: Any) -> tuple[T, PeakMemory]:
    """Run `fn(*args, **kwargs)` once and return its result and the peak memory it reached."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        trace = CudaMemoryTrace(device).start()
        try:
            result = fn(*args, **kwargs)
            torch.cuda.synchronize(device)
        finally:
            trace.stop()
        windows = trace.windows()
        if windows is None:
            raise RuntimeError("measure_peak_memory: the allocator's history lost the start of the work (its ring "
                               f"of {CUDA_HISTORY_ENTRIES} entries wrapped, or the program's own is shorter)")
        window = windows[0]
        return result, PeakMemory(str(device), window.allocated_peak - trace.allocated, trace.allocated,
                                  window.reserved_peak)
    if device.type != "cpu":
        raise ValueError(f"measure_peak_memory: device {str(device)!r} is not supported; valid choices: 'cpu', 'cuda'")
    for finish in BEFORE_PROFILING:
        finish()
    profile = CpuMemoryProfile().start()
    try:
        result = fn(*args, **kwargs)
    finally:
        profile.stop()
    return result, PeakMemory("cpu", profile.peak_increase_bytes(), None)


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """One compiled training step (forward + backward, and the optimizer's step when one is given; gradients
    set to None before it), measured.

    predicted_peak_bytes is dpcs's simulated peak of the step's graph (None unless the step compiled to
    exactly one training graph: a step of several graphs is not one simulated timeline yet).
    measured_peak_bytes is what a budget bounds: on CPU the resident bytes plus the highest the step allocated
    above the level it began at (the profiler sees nothing else); on CUDA the allocator's absolute peak, which
    includes what the process holds beside the model (other models, cuBLAS's workspaces, made at a thread's
    first matrix product: about 65 MiB on an H200 with torch 2.11). That part, allocated when the step began
    beyond `resident_bytes`, is `outside_bytes` (None on CPU); `own_peak_bytes` leaves it out.
    """

    device: str
    predicted_peak_bytes: int | None
    measured_peak_bytes: int
    resident_bytes: int  # parameters, buffers and inputs alive before the step
    step_seconds: float  # median wall time of the timed steps (no profiler attached)
    graphs: int
    outside_bytes: int | None = None  # CUDA: allocated when the step began beyond `resident_bytes`

    @property
    def own_peak_bytes(self) -> int:
        """The model's own peak: its resident bytes and what its step allocated (a graph's simulated peak)."""
        return self.measured_peak_bytes - (self.outside_bytes or 0)

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
    held_bytes: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
) -> StepMeasurement:
    """Warm up (compiles), measure one step's peak memory, then time `repeats` steps; median time. With an
    `optimizer`, each step ends with its step (the parameters train on): the peak is the whole step's.

    The prediction compared against is `predicted_peak_bytes`, else that of the one training graph the
    warm-up compiled (None when it compiled none, e.g. already compiled, or several). `held_bytes`: memory
    alive through the step that the CPU profiler cannot see (an optimizer's state, allocated before).
    """
    from dpcs_compiler.report import compile_records, records_since

    records_before = compile_records()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = compiled(*inputs)
        loss = out if loss_fn is None else loss_fn(out)
        loss.backward()
        if optimizer is not None:
            optimizer.step()

    for _ in range(warmup):
        step()
    model.zero_grad(set_to_none=True)
    resident = resident_bytes([*model.parameters(), *model.buffers(), *inputs]) + held_bytes
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
    return StepMeasurement(
        device=str(device),
        predicted_peak_bytes=predicted,
        measured_peak_bytes=peak.absolute(resident if peak.baseline_bytes is None else None),
        resident_bytes=resident,
        step_seconds=statistics.median(times),
        graphs=len(new_records),
        outside_bytes=None if peak.baseline_bytes is None else max(0, peak.baseline_bytes - resident),
    )
