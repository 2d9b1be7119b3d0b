"""The El Che benchmark runs end to end (2 gloo ranks, one short repetition) and writes its JSON and plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cadence.py"


def test_one_repetition_writes_results(tmp_path):
    spec = importlib.util.spec_from_file_location("cadence_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--reps", "1", "--steps", "4", "--warmup", "2", "--slowdowns", "3", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cadence_cpu.json").read_text())
    assert (tmp_path / "cadence_cpu.png").stat().st_size > 0
    (row,) = results["rows"]
    assert row["slowdown"] == 3 and row["ddp"]["samples_per_second"] > 0 and row["throughput_ratio"] > 0
    # Plain DDP: one micro-batch per rank per step; El Che's first steps run the equal counts it starts from.
    assert row["ddp"]["micro_batches_per_step_per_rank"] == [1, 1]
    assert all(len(rank["results"]) == 2 for rank in results["raw"])
