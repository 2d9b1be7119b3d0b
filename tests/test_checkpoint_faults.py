"""A job killed at random points of its run (most of it spent saving) resumes from the newest complete
checkpoint and ends with the model of a run never killed, bit for bit (2 gloo ranks, FSDP2, CPU)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from dpcs_compiler import checkpoint
from dpcs_testing import run_rank_processes

WORKER = Path(__file__).resolve().parent / "checkpoint_rank_worker.py"
TRIALS = 20
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def commands(tmp: Path, name: str, directory: Path, ready: Path | None = None) -> list[list[str]]:
    return [[sys.executable, str(WORKER), str(rank), "2", str(tmp / f"{name}.store"), str(directory),
             str(tmp / f"{name}{rank}.pt"), "run", *([str(ready)] if ready else [])] for rank in range(2)]


def killed_at(tmp: Path, name: str, directory: Path, delay: float) -> tuple[bool, float]:
    """Start both ranks, and SIGKILL both `delay` seconds after rank 0's loop starts (the job dies, as on a
    lost node). Returns whether they were killed (not finished first), and the seconds from the loop's start
    to their end."""
    ready = tmp / f"{name}.ready"
    logs = [open(tmp / f"{name}{rank}.log", "w") for rank in range(2)]
    processes = [subprocess.Popen(c, env=ENV, stdout=log, stderr=subprocess.STDOUT)
                 for c, log in zip(commands(tmp, name, directory, ready), logs)]
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and all(p.poll() is None for p in processes):
            assert time.monotonic() < deadline, "the ranks never started their loop"
            time.sleep(0.01)
        started = time.monotonic()
        while time.monotonic() - started < delay and any(p.poll() is None for p in processes):
            time.sleep(0.002)
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in processes:
            p.wait(timeout=60)
        codes = [p.returncode for p in processes]
        assert set(codes) <= {0, -signal.SIGKILL}, (codes, (tmp / f"{name}0.log").read_text())
    finally:
        for log in logs:
            log.close()
    return -signal.SIGKILL in codes, time.monotonic() - started


def test_a_job_killed_while_saving_resumes_and_ends_as_one_never_killed(tmp_path):
    # The uninterrupted run, timed from its loop's start (its steps and saves) to its end.
    interrupted, loop = killed_at(tmp_path, "ref", tmp_path / "reference", 600.0)
    assert not interrupted
    expected = torch.load(tmp_path / "ref0.pt")["parameters"]
    rng = random.Random(0)
    killed = in_save = resumed_from = 0
    for trial in range(TRIALS):
        directory = tmp_path / f"trial{trial}"
        # A kill at a random point of the loop (saves are most of it), then a run to the end.
        killed += killed_at(tmp_path, f"t{trial}k", directory, rng.uniform(0.0, 0.8 * loop))[0]
        in_save += any(directory.glob(".step_*.partial"))  # killed between a save's start and its commit
        newest = checkpoint.latest(directory)
        assert not list(directory.glob("step_*")) or newest is not None, "a committed checkpoint always checks"
        run_rank_processes(commands(tmp_path, f"t{trial}end", directory), [ENV] * 2)
        results = [torch.load(tmp_path / f"t{trial}end{rank}.pt") for rank in range(2)]
        want = 0 if newest is None else int(newest.name.removeprefix("step_"))
        assert all(r["start"] == want for r in results), (trial, want, [r["start"] for r in results])
        resumed_from += want > 0
        for a, b in zip(expected, results[0]["parameters"]):
            assert torch.equal(a, b), trial
    print(f"{TRIALS} trials (loop {loop:.2f} s): {killed} killed before their end, {in_save} of them inside a save "
          f"(a partial checkpoint left), {resumed_from} resumed from a checkpoint, every final model equal to the "
          "uninterrupted run's")
    assert killed >= TRIALS * 3 // 4 and in_save >= TRIALS // 4 and resumed_from >= TRIALS // 2
