"""measure: peaks read from the CPU profiler, without kineto's progress lines on stderr."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from dpcs_compiler.measure import measure_peak_memory, quiet_profiler_logs


def test_a_measured_peak_prints_no_profiler_progress_lines(capfd):
    _, peak = measure_peak_memory(lambda: torch.ones(1 << 20).sum())
    assert peak.peak_increase_bytes >= 4 << 20
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "USDT" not in err and "STAGE" not in err


def test_only_kinetos_progress_lines_are_dropped(capfd):
    with quiet_profiler_logs():
        os.write(2, b"USDT:2026-11-24 18:58:59 5286:5286 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"STAGE:2026-11-24 18:52:10 3447:3447 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n")
        os.write(2, b"a real error from the profiler\n")
    assert capfd.readouterr().err == "a real error from the profiler\n"


def test_a_training_steps_peak_on_cuda_tells_the_models_own_from_what_the_process_holds_beside(monkeypatch):
    """On CUDA the allocator's level when the step begins includes what the process holds for others
    (on an H200 with torch 2.11, about 65 MiB of cuBLAS workspaces, in every case of the peak-prediction
    table): the measured peak stays absolute (what a budget bounds there), the part held beside the model
    is reported apart and the model's own peak leaves it out. The CUDA reading is stood in for (no GPU in
    CI); on CPU nothing is held apart."""
    import dpcs_compiler.measure as measure

    model = torch.nn.Linear(8, 8)
    inputs = (torch.randn(4, 8),)
    resident = measure.resident_bytes([*model.parameters(), *inputs])

    def cuda_reading(fn, *args, device="cpu", **kwargs):
        return fn(*args, **kwargs), measure.PeakMemory("cuda:0", 1000, resident + (65 << 20))

    cpu = measure.measure_training_step(model, model, inputs, loss_fn=lambda y: y.sum(), repeats=1)
    assert cpu.outside_bytes is None and cpu.measured_peak_bytes >= resident
    monkeypatch.setattr(measure, "measure_peak_memory", cuda_reading)
    cuda = measure.measure_training_step(model, model, inputs, loss_fn=lambda y: y.sum(), repeats=1)
    assert cuda.measured_peak_bytes == resident + (65 << 20) + 1000  # what a budget on CUDA bounds
    assert cuda.outside_bytes == 65 << 20 and cuda.own_peak_bytes == resident + 1000
    assert cpu.own_peak_bytes == cpu.measured_peak_bytes


def test_allocator_windows_read_allocated_and_reserved_between_marks_from_the_history():
    """The allocator's history read between marks (one-byte allocations at noted addresses): sizes counted
    rounded to 512 B, reserved following the segment events, the marks' own allocations left out."""
    from dpcs_compiler.measure import allocator_windows

    MiB = 1 << 20
    events = [
        ("alloc", 100, 1000),  # before the start mark: not counted
        ("alloc", 7, 1), ("free_requested", 7, 1), ("free_completed", 7, 1),  # mark "start" at address 7
        ("segment_alloc", 500, 20 * MiB), ("alloc", 500, 3 * MiB + 1), ("alloc", 600, 100),
        ("free_completed", 600, 100),
        ("alloc", 7, 1), ("free_completed", 7, 1),  # mark "turn", the same address again
        ("alloc", 700, 5 * MiB), ("free_completed", 500, 3 * MiB + 1), ("segment_unmap", 900, 2 * MiB),
    ]
    windows = allocator_windows(events, [("start", 7), ("turn", 7)], allocated=10 * MiB, reserved=40 * MiB)
    first, second = windows
    assert (first.opened_by, first.closed_by, second.closed_by) == ("start", "turn", None)
    assert first.allocated_peak == 10 * MiB + 3 * MiB + 512 + 512
    assert first.allocated_end == 10 * MiB + 3 * MiB + 512 and first.reserved_peak == 60 * MiB
    assert second.allocated_peak == first.allocated_end + 5 * MiB
    assert second.allocated_end == 15 * MiB and second.reserved_end == 58 * MiB and second.reserved_peak == 60 * MiB
    assert allocator_windows(events, [("start", 7), ("lost", 8)], allocated=0, reserved=0) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_a_measured_peak_leaves_the_users_peak_statistics_and_history_alone():
    """dpcs reads peaks from the allocator's history, recorded only while it measures: the user's
    max_memory_allocated still reads their own peak afterwards, and no history is left on."""
    from dpcs_compiler.measure import CudaMemoryTrace, _cuda_history_enabled

    device = torch.device("cuda", torch.cuda.current_device())
    big = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del big
    users_peak = torch.cuda.max_memory_allocated(device)
    level = torch.cuda.memory_allocated(device)
    _, peak = measure_peak_memory(lambda: torch.empty(64 << 20, dtype=torch.uint8, device=device).sum(), device=device)
    assert peak.peak_increase_bytes >= 64 << 20 and peak.baseline_bytes == level
    assert peak.reserved_peak_bytes >= level + (64 << 20)
    assert torch.cuda.max_memory_allocated(device) == max(users_peak, level + peak.peak_increase_bytes)
    assert not _cuda_history_enabled()
    trace = CudaMemoryTrace(device).start()
    a = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    trace.mark("a")
    del a
    b = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    windows = trace.windows()
    del b
    assert [w.opened_by for w in windows] == ["start", "a"]
    assert windows[0].allocated_peak == trace.allocated + (32 << 20)
    assert windows[1].allocated_peak == trace.allocated + (32 << 20) and windows[1].allocated_end == trace.allocated + (16 << 20)


@cuda
def test_cuda_a_programs_own_history_is_read_and_left_recording():
    from dpcs_compiler.measure import _cuda_history_enabled

    torch.cuda.memory._record_memory_history("all", context=None)
    try:
        _, peak = measure_peak_memory(lambda: torch.empty(8 << 20, dtype=torch.uint8, device="cuda").sum(), device="cuda")
        assert peak.peak_increase_bytes >= 8 << 20
        assert _cuda_history_enabled()
        assert any(e["action"] == "alloc" for e in torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    finally:
        torch.cuda.memory._record_memory_history(None)


def test_a_block_freed_unseen_is_counted_freed_where_its_address_is_taken_again():
    """The profiler records no free made on a thread it does not follow (gloo's worker thread releasing a
    collective's buffers): an allocation at the address of a block still counted alive frees it there."""
    from dpcs_compiler.measure import with_unseen_frees

    events = [(1, 100, 0xA), (2, 50, 0xB), (3, -50, 0xB), (4, 80, 0xA), (5, -80, 0xA), (6, -30, 0xC)]
    assert with_unseen_frees(events) == [(1, 100), (2, 50), (3, -50), (4, -100), (4, 80), (5, -80), (6, -30)]
    levels = itertools.accumulate(n for _, n in with_unseen_frees(events))
    assert max(levels) == 150  # 230 counting the unseen block alive to the end
    # A step of one thread frees what it allocates before its address is taken again: nothing is added.
    steady = [(1, 10, 0xA), (2, -10, 0xA), (3, 10, 0xA), (4, -10, 0xA)]
    assert with_unseen_frees(steady) == [(t, n) for t, n, _ in steady]
