"""The lowering-cost benchmark compiles each lowering of a plan apart and reports what the guard refused."""

from __future__ import annotations

import json

import pytest

from dpcs_testing import load_benchmark


@pytest.mark.slow
@pytest.mark.inductor
def test_each_lowering_compiles_its_own_graphs_and_dpcs_holds_the_budget_at_the_guards_peak(tmp_path, monkeypatch):
    """At 0.72 of compile's peak the tiny GPT's plan has less room to spare than the measurement tolerance (run
    alone, its unguarded schedule was predicted within the budget by 1.8 KB and measured 6 KB over it: the step
    holds a few KB the model does not count). dpcs's own lowering stays within the budget at the peak of the
    guard on every graph, refusing no more than it: a graph whose schedule cannot lower the step's peak refuses
    nothing (run alone, the forward, `PartCompiler.may_improve`; how many the backward refuses depends on the
    plan the suite's earlier tests leave, bcbba66)."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")  # the plans asserted on: not this CPU's speeds
    module = load_benchmark("lowering_cost")
    assert module.main(["--quick", "--models", "gpt", "--fractions", "0.72", "--steps", "1", "--warmup", "1",
                        "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "lowering_cost_cpu_quick.json").read_text())
    assert payload["torch"] and payload["device"]
    runs = payload["models"]["gpt"]
    assert list(runs) == ["compile", "guarded@0.72", "planned@0.72", "unguarded@0.72", "reuse+ungd@0.72"]
    assert all(r["error"] is None and r["peak_bytes"] and r["step_s"] for r in runs.values()), runs
    guarded, planned, unguarded = runs["guarded@0.72"], runs["planned@0.72"], runs["unguarded@0.72"]
    assert planned["plan_feasible"] and planned["peak_bytes"] <= planned["budget_bytes"], planned
    assert planned["peak_bytes"] == guarded["peak_bytes"], (planned, guarded)
    assert planned["fusions_refused"] <= guarded["fusions_refused"] and guarded["fusions_refused"] >= 1
    assert unguarded["fusions_refused"] == 0
    assert module.LOWERINGS["planned"] == (False, "if_over")
