"""The examples a user copies from run, and show what they say they show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_adaptive_demonstration_shows_each_event(tmp_path):
    """`train_gpt.py --adaptive` (eager final compiler, batch 2): promotion on the injected overflow with one
    compile, demotion reusing the cached variant, a squeezed budget with a lower measured peak."""
    out = tmp_path / "demo"
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), "--adaptive", "--compiler", "eager", "--batch", "2",
         "--steps", "30", "--overflow-step", "5", "--squeeze-step", "20", "--release-step", "25", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checks"] and all(summary["checks"].values()), summary["checks"]
    assert [e["decisions"] for e in summary["compile_events"]][:2] == ["compile options", "fp32"]
    assert (out / "telemetry.png").read_bytes()[:4] == b"\x89PNG"
    assert "ok  the squeezed plan's measured peak is lower" in result.stdout
