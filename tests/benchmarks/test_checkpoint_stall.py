"""The checkpoint stall benchmark runs end to end (one round) and writes its JSON and plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_stall.py"


def test_one_round_writes_results(tmp_path):
    spec = importlib.util.spec_from_file_location("checkpoint_stall", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--rounds", "1", "--steps", "1", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "checkpoint_stall_cpu.json").read_text())
    assert (tmp_path / "checkpoint_stall_cpu.png").stat().st_size > 0
    assert set(results["median_seconds"]) == {"step", "sync_save", "async_save", "step_while_writing", "async_commit",
                                              "async_save_fresh_copies"}
    assert results["async_save_over_fresh_copies"] > 0
    assert all(v > 0 for v in results["median_seconds"].values())
    assert results["checkpoint_bytes"] > 3 * 4 * results["parameters"], "parameters and AdamW's two moments"
