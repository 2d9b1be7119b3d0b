"""The step-anatomy benchmark runs end to end on a tiny model and accounts for dpcs's offload ops per step."""

from __future__ import annotations

import json

import pytest

from dpcs_testing import load_benchmark


def test_a_gpu_profiled_plan_offloads_and_its_ops_are_counted_per_step(tmp_path):
    """Planned with the built-in H100 profile from this CPU, the tiny GPT's `dpcs` point offloads and its four ops a value
    show up once each per step; without the host link the same budget is met by recomputation alone."""
    module = load_benchmark("step_anatomy")
    assert module.main(["--quick", "--compiler", "eager", "--steps", "2", "--warmup", "1", "--profile-steps", "2",
                        "--budget-fractions", "0.75", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "step_anatomy_cpu_quick.json").read_text())
    assert results["torch"] and results["profile"].startswith("cuda:NVIDIA H100")
    runs = results["strategies"]
    assert list(runs) == ["compile", "dpcs@0.75", "dpcs_no_offload@0.75"]
    offloaded = runs["dpcs@0.75"]["offloaded_values"]
    assert offloaded >= 1 and runs["dpcs_no_offload@0.75"]["offloaded_values"] == 0
    anatomy = runs["dpcs@0.75"]["anatomy"]
    assert anatomy["dpcs_op_calls_per_step"] == 4 * offloaded
    assert {r["op"] for r in anatomy["dpcs_ops"]} == {f"dpcs::{op}" for op in ("offload", "wait_offload", "reload",
                                                                              "wait_tensor")}
    assert all(r["calls_per_step"] == offloaded for r in anatomy["dpcs_ops"])
    assert runs["compile"]["anatomy"]["dpcs_op_calls_per_step"] == 0
    for r in runs.values():
        assert r["step_s"] > 0 and r["anatomy"]["wall_ms_per_step"] > 0


def test_a_profile_without_a_host_link_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        load_benchmark("step_anatomy").main(["--quick", "--compiler", "eager", "--profile", "reference-cpu", "--out", str(tmp_path)])
