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
