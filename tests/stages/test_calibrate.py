"""Option `calibrate`: a graph planned with the roofline fitted to its own ops' times (`stages/calibrate.py`)."""

from __future__ import annotations

import pytest
import torch

from dpcs_testing import dpcs_compile
from dpcs_compiler import clear_compile_records, compile_records
from dpcs_compiler.cost.op_time import Calibration
from dpcs_compiler.models import workload
from dpcs_compiler.stages import calibrate


@pytest.fixture(autouse=True)
def fresh_fits():
    calibrate.clear_calibrations()
    yield
    calibrate.clear_calibrations()


def step(w, **options):
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(w.model, "eager", **options)
    w.model.zero_grad(set_to_none=True)
    w.loss_fn(compiled(*w.inputs)).backward()
    grads = {n: p.grad.clone() for n, p in w.model.named_parameters()}
    (record,) = [r for r in compile_records() if r.mode == "training"]
    return record, grads


def test_a_calibrated_plan_is_costed_with_the_fit_of_its_own_ops(monkeypatch):
    """The graph's ops are timed once (a fit per graph, reused by a second compile of it), the record names
    the fit, and a fit that makes compute 1000x dearer changes what the plan pays for a recomputation."""
    w = workload("gpt", 4)
    low, _ = step(w, memory_budget=1, on_infeasible="best")
    budget = int(low.predicted_peak_bytes * 1.15)
    plain, grads = step(w, memory_budget=budget)
    assert plain.calibration is None
    fitted, calibrated_grads = step(w, memory_budget=budget, calibrate=True)
    fit = fitted.calibration
    assert fit["samples"] > 20 and fit["seconds"] > 0 and fit["compute_scale"] >= 0 and fit["overhead_s"] >= 0
    assert "plan/calibrate" in fitted.pass_seconds
    for name, grad in grads.items():
        torch.testing.assert_close(calibrated_grads[name], grad)
    # A second compile of the same graph reuses the fit: nothing is timed again.
    timed = []
    monkeypatch.setattr(calibrate, "measure_op_samples", lambda *a, **k: timed.append(1) or [])
    again, _ = step(w, memory_budget=budget, calibrate=True)
    assert not timed and again.calibration == fit
    # The plan's added time is priced by the fit: compute 1000x dearer, recomputation costs more.
    calibrate.clear_calibrations()
    monkeypatch.setattr(calibrate, "measure_op_samples", lambda *a, **k: ["sample"])
    monkeypatch.setattr(calibrate, "fit_calibration", lambda samples: Calibration(1000.0, 1.0, 0.0))
    dear, _ = step(w, memory_budget=budget, calibrate=True)
    assert dear.calibration["compute_scale"] == 1000.0
    assert dear.plan_added_seconds > 10 * plain.plan_added_seconds > 0


def test_a_graph_whose_ops_cannot_be_timed_is_planned_uncalibrated_with_a_warning(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("index out of range")

    monkeypatch.setattr(calibrate, "measure_op_samples", fails)
    w = workload("mlp", 64)
    with pytest.warns(UserWarning, match=r"could not time the ops of graph_\d+ \(RuntimeError: index out of range\)"):
        record, _ = step(w, memory_budget="1GiB", calibrate=True)
    assert record.calibration is None and record.plan_feasible


def test_calibrate_and_keep_torch_plan_are_validated_and_off_by_default_hash_as_before():
    from dpcs_compiler.options import DpcsOptions

    for key in ("calibrate", "keep_torch_plan"):
        with pytest.raises(ValueError, match=rf"'{key}'='yes' is not valid; valid choices: True, False"):
            DpcsOptions.from_dict({key: "yes"})
    default = DpcsOptions.from_dict({"memory_budget": 10})
    assert DpcsOptions.from_dict({"memory_budget": 10, "calibrate": False, "keep_torch_plan": True}).fingerprint() == (
        default.fingerprint()
    )
    assert DpcsOptions.from_dict({"memory_budget": 10, "calibrate": True}).fingerprint() != default.fingerprint()
    assert DpcsOptions.from_dict({"memory_budget": 10, "keep_torch_plan": False}).fingerprint() != default.fingerprint()
