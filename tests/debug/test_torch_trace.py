"""dpcs in torch's own tooling: its plan and compile record in a TORCH_TRACE file (what `tlparse` reads), and
its logs turned on by TORCH_LOGS="+dpcs" (both read when torch is imported: a fresh process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

SCRIPT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
options = {"compiler": "eager", "strict": True, "memory_budget": "64MiB"}
torch.compile(model, backend="dpcs", options=options)(torch.randn(4, 8)).sum().backward()
"""


def test_the_trace_holds_dpcs_artifacts_and_torch_logs_turns_on_dpcs_logs(tmp_path):
    env = os.environ | {"TORCH_TRACE": str(tmp_path / "trace"), "TORCH_LOGS": "+dpcs"}
    env.pop("DPCS_OPTIONS", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"graph_000: saved \d+ values", done.stderr)  # dpcs.pipeline's INFO line, through torch's handler
    (trace,) = (tmp_path / "trace").iterdir()
    artifacts: dict[str, list[dict]] = {}
    lines = trace.read_text().splitlines()
    for index, line in enumerate(lines):  # a record line, then its payload lines (tab-indented)
        record = json.loads(line[line.index("{"):]) if "{" in line and not line.startswith("\t") else None
        if record and record.get("artifact", {}).get("name", "").startswith("dpcs_"):
            payload = []
            for follow in lines[index + 1:]:
                if not follow.startswith("\t"):
                    break
                payload.append(follow[1:])
            artifacts.setdefault(record["artifact"]["name"], []).append(
                {"compile": (record.get("frame_id"), record.get("frame_compile_id")), "payload": json.loads("\n".join(payload))})
    assert set(artifacts) == {"dpcs_plan", "dpcs_compile_record"}
    final = artifacts["dpcs_compile_record"][-1]
    assert final["compile"] == (0, 0)  # attached to Dynamo's compile, as tlparse groups them
    assert final["payload"]["graph"] == "graph_000" and final["payload"]["predicted_peak_bytes"] > 0
    assert final["payload"]["budget_bytes"] == 64 * 2**20 and final["payload"]["pass_seconds"]
    assert artifacts["dpcs_plan"][-1]["payload"]["plan_hash"] == final["payload"]["plan_hash"]
