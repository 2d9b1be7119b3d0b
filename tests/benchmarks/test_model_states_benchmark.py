"""benchmarks/model_states.py: a quick CPU run of the GPU-scale model's stand-in (the code path the GPU session
runs at 439M parameters), the offload arms and dpcs's own choice side by side."""

from __future__ import annotations

import json

import pytest
import torch

from dpcs_testing import benchmark_script


@pytest.mark.slow
def test_a_quick_run_of_the_llama_stand_in_writes_every_strategy(tmp_path):
    with benchmark_script("model_states") as module:
        torch._dynamo.reset()
        module.main(["--models", "llama_tiny", "--strategies", "stateless,adamw,int8,offload,offload_overlap",
                     "--steps", "2", "--warmup", "1", "--loss-steps", "0", "--dpcs-fractions", "0.7",
                     "--out", str(tmp_path)])
        torch._dynamo.reset()
    rows = json.loads((tmp_path / "model_states_cpu.json").read_text())["models"]["llama_tiny"]["strategies"]
    assert list(rows) == ["stateless", "adamw", "int8", "offload", "offload_overlap", "dpcs@0.7"]
    for name, row in rows.items():
        assert row["step_seconds"] > 0 and row["device_peak"] > 0, name
    assert rows["offload_overlap"]["parameters_device"] < rows["adamw"]["parameters_device"]
    assert rows["offload_overlap"]["host"] == rows["offload"]["host"] > 0
    assert rows["dpcs@0.7"]["chosen"] is not None
