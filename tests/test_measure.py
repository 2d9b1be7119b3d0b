"""measure: peaks read from the CPU profiler, without kineto's progress lines on stderr."""

from __future__ import annotations

import os

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
