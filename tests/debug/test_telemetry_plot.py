"""`dpcs plot`: a Runtime's telemetry drawn as a PNG, its series read from a real run's file."""

from __future__ import annotations

import json

import torch

from dpcs_compiler import PrecisionPolicy, Runtime
from dpcs_compiler.cli import main
from dpcs_compiler.debug.telemetry_plot import telemetry_series
from dpcs_compiler.runtime import read_telemetry
from dpcs_testing import dpcs_compile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def telemetry_of_a_run(path):
    """6 steps in bf16 under a Runtime; the gradients of step 3 overflow: promoted to fp32 at step 3."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    compiled = dpcs_compile(model, precision="bf16")
    policy = PrecisionPolicy(modes=("fp32", "bf16"), per_region=False)
    with Runtime(model, policies=[policy], telemetry=path, signal_every=1) as runtime:
        for step in range(1, 7):
            loss = compiled(torch.randn(8, 16)).float().square().mean()
            loss.backward()
            if step == 3:
                model[0].weight.grad[0, 0] = float("inf")
            runtime.step(loss=loss)
            model.zero_grad(set_to_none=True)
    return read_telemetry(path)


def test_series_follow_the_run(tmp_path):
    series = telemetry_series(telemetry_of_a_run(tmp_path / "t.jsonl"))
    assert series["step"] == [1, 2, 3, 4, 5, 6]
    assert series["mode"] == ["bf16", "bf16", "fp32", "fp32", "fp32", "fp32"]
    assert [step for step, _ in series["switches"]] == [3]
    assert [step for step, _ in series["compiles"]] == [1, 4]  # compile options at step 1, fp32 in step 4
    assert all(h is not None and 0 < h <= 1 for h in series["headroom"])


def test_dpcs_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    telemetry_of_a_run(path)
    with path.open("a") as out:
        out.write('{"step": 7, "kind": "sig')  # a line cut short by a killed process is skipped
    assert main(["plot", str(path), "-o", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG_MAGIC
    assert "6 signal reads, 2 variant compiles" in capsys.readouterr().out


def test_dpcs_plot_names_a_missing_or_empty_file(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "none.jsonl")]) == 2
    assert "no telemetry file at" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text(json.dumps({"step": 1, "kind": "other"}) + "\n")
    assert main(["plot", str(tmp_path / "empty.jsonl")]) == 2
    assert "no signal reads, compile events or cadence syncs" in capsys.readouterr().err
