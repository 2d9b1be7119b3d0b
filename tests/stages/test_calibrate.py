"""Option `calibrate`: a graph planned with the roofline fitted to its own ops' times (`stages/calibrate.py`)."""

from __future__ import annotations

import pytest
import torch

from dpcs_testing import dpcs_compile, expecting_best_plan
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
    with expecting_best_plan():
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


def test_a_plan_records_what_it_recomputes_and_plans_with_a_given_calibration():
    """Option `calibration` (a fit to measured steps) prices the plan: a plan that recomputes records its
    terms, torch's plan at no pressure records what min-cut recomputes, and memory-bound recomputation made
    free moves the plan toward it, with gradients still those of the uncalibrated plan."""
    w = workload("gpt", 4)
    with expecting_best_plan():
        low, _ = step(w, memory_budget=1, on_infeasible="best")
    budget = int(low.predicted_peak_bytes * 1.15)
    plain, grads = step(w, memory_budget=budget)
    terms = plain.recompute_terms
    assert plain.recomputed_values > 0 and terms["ops"] >= plain.recomputed_values
    assert terms["compute_s"] >= 0 and terms["memory_s"] > 0
    free, free_grads = step(w, memory_budget=budget, calibration={"compute_scale": 1.0, "memory_scale": 0.0, "overhead_s": 0.0})
    assert free.calibration == {"compute_scale": 1.0, "memory_scale": 0.0, "overhead_s": 0.0, "source": "option"}
    assert free.plan_feasible and free.predicted_peak_bytes <= budget
    # Priced by the given calibration: its added time is the compute term of what it recomputes.
    assert free.plan_added_seconds == pytest.approx(free.recompute_terms["compute_s"], rel=1e-9, abs=1e-12)
    assert free.recompute_terms["compute_s"] <= terms["compute_s"] + 1e-12
    for name, grad in grads.items():
        torch.testing.assert_close(free_grads[name], grad)


def test_calibration_option_is_validated_and_hashed():
    from dpcs_compiler.options import DpcsOptions

    with pytest.raises(ValueError, match=r"'calibration'=\{'scale': 2\} is not valid; valid choices: None, a Calibration"):
        DpcsOptions.from_dict({"calibration": {"scale": 2}})
    with pytest.raises(ValueError, match="memory_scale must be a finite number >= 0, got -0.5"):
        DpcsOptions.from_dict({"calibration": {"memory_scale": -0.5}})
    for bad in ({"compute_scale": True}, {"memory_scale": "2"}, {"overhead_s": float("nan")}):
        with pytest.raises(ValueError, match=r"'calibration'=.* is not valid \(calibration: \w+ must be a finite"):
            DpcsOptions.from_dict({"calibration": bad})
    with pytest.raises(ValueError, match="'calibrate'=True and 'calibration' both"):
        DpcsOptions.from_dict({"calibrate": True, "calibration": {"compute_scale": 2.0}})
    given = DpcsOptions.from_dict({"memory_budget": 10, "calibration": {"compute_scale": 2.0}})
    assert given.calibration == Calibration(2.0, 1.0, None)
    assert given.fingerprint() != DpcsOptions.from_dict({"memory_budget": 10}).fingerprint()
    assert DpcsOptions.from_dict({"memory_budget": 10, "calibration": None}).fingerprint() == "a6cd43ea9bb91b18"  # 04bad1e's
    # Without a budget there is no plan to cost: the same compiled code, the same hash.
    assert DpcsOptions.from_dict({"calibration": {"compute_scale": 2.0}}).fingerprint() == DpcsOptions().fingerprint()
