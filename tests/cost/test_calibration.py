"""calibration: structural scale factors fitted from per-op samples, and samples measured from a graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.cost.calibration import (
    OpSample,
    StepSample,
    fit_calibration,
    fit_step_calibration,
    measure_op_samples,
    recompute_terms,
)
from dpcs_compiler.cost.hardware import FORMAT_VERSION, HardwareProfile
from dpcs_compiler.cost.op_time import Calibration, roofline_seconds
from dpcs_compiler.passes.analysis import op_cost


def synthetic_samples(compute_scale, memory_scale, overhead, n=40, seed=0):
    """Ops spread over six decades of compute and memory time, timed exactly by the calibrated roofline."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        compute = 10.0 ** rng.uniform(-7, -2) if i % 3 else 0.0  # every third op is pointwise
        memory = 10.0 ** rng.uniform(-7, -2)
        measured = overhead + max(compute_scale * compute, memory_scale * memory)
        samples.append(OpSample(f"op{i}", compute, memory, measured))
    return samples


@pytest.mark.parametrize(
    ("compute_scale", "memory_scale", "overhead"),
    [(2.5, 0.7, 3e-6), (1.0, 1.0, 1e-6), (0.3, 4.0, 2e-5)],
)
def test_the_fit_recovers_known_scales_and_overhead(compute_scale, memory_scale, overhead):
    fitted = fit_calibration(synthetic_samples(compute_scale, memory_scale, overhead))
    assert fitted.compute_scale == pytest.approx(compute_scale, rel=1e-6)
    assert fitted.memory_scale == pytest.approx(memory_scale, rel=1e-6)
    assert fitted.overhead_s == pytest.approx(overhead, rel=1e-6)


def test_ops_the_uncalibrated_roofline_misclassifies_are_reclassified():
    # compute 1.0 ms vs memory 1.2 ms looks memory-bound, but with compute x3 it is compute-bound.
    samples = synthetic_samples(3.0, 1.0, 0.0) + [OpSample("close", 1e-3, 1.2e-3, 3e-3)] * 5
    fitted = fit_calibration(samples)
    assert (fitted.compute_scale, fitted.memory_scale) == pytest.approx((3.0, 1.0), rel=1e-6)


def test_a_term_no_sample_is_bound_by_keeps_scale_one():
    samples = [OpSample(f"pointwise{i}", 0.0, m, 2e-6 + 1.5 * m) for i, m in enumerate([1e-5, 1e-4, 1e-3])]
    fitted = fit_calibration(samples)
    assert fitted.compute_scale == 1.0
    assert (fitted.memory_scale, fitted.overhead_s) == pytest.approx((1.5, 2e-6), rel=1e-9)


def test_a_term_indistinguishable_from_overhead_keeps_scale_one_not_zero():
    # every memory-bound op takes 10 us whatever its bytes: NNLS would put memory_scale at 0
    samples = [OpSample(f"m{i}", 0.0, m, 1e-5) for i, m in enumerate([1e-7, 2e-7, 4e-7])]
    samples += [OpSample(f"c{i}", c, 0.0, 1e-5 + 2 * c) for i, c in enumerate([1e-3, 2e-3])]
    fitted = fit_calibration(samples)
    assert fitted.memory_scale == 1.0
    assert fitted.compute_scale > 0


def test_a_fitted_calibration_predicts_the_samples_through_the_roofline():
    profile = HardwareProfile("cpu:test:1", torch.__version__, FORMAT_VERSION, {"float32": 1e12}, 1e11, None, None,
                              1e-6, "2026-01-01T00:00:00+00:00")
    ops = [(10**9, 10**6), (10**7, 10**9), (0, 10**8), (4 * 10**9, 10**7)]  # (flops, bytes)
    samples = [
        OpSample(str(i), f / 1e12, b / 1e11, 7e-6 + max(1.8 * f / 1e12, 0.6 * b / 1e11)) for i, (f, b) in enumerate(ops)
    ]
    fitted = fit_calibration(samples)
    for (flops, nbytes), sample in zip(ops, samples):
        assert roofline_seconds(flops, nbytes, "float32", profile, fitted) == pytest.approx(sample.measured_s, rel=1e-6)


def test_no_samples_is_an_error():
    with pytest.raises(ValueError, match="no samples"):
        fit_calibration([])


def test_measuring_a_traced_mlp_gives_one_timed_sample_per_costed_node():
    def mlp(x, w1, b1, w2):
        return (torch.relu(torch.nn.functional.linear(x, w1, b1)) @ w2.t(),)

    inputs = (torch.randn(64, 128), torch.randn(256, 128), torch.randn(256), torch.randn(32, 256))
    gm = make_fx(mlp, tracing_mode="fake")(*inputs)
    profile = HardwareProfile("cpu:test:1", torch.__version__, FORMAT_VERSION, {"float32": 1e11}, 1e10, None, None,
                              1e-6, "2026-01-01T00:00:00+00:00")
    samples = measure_op_samples(gm, inputs, profile, op_cost(gm).per_node, repeats=2)

    # the two transposes are views (no cost, no sample); addmm, relu and mm are timed
    assert [s.name for s in samples] == ["addmm", "relu", "mm"]
    by_name = {s.name: s for s in samples}
    assert by_name["addmm"].compute_s == pytest.approx(2 * 64 * 128 * 256 / 1e11)
    assert by_name["mm"].compute_s == pytest.approx(2 * 64 * 256 * 32 / 1e11)
    assert by_name["relu"].compute_s == 0.0
    assert by_name["relu"].memory_s == pytest.approx(2 * 64 * 256 * 4 / 1e10)
    assert all(s.measured_s > 0 for s in samples)


# --- fitted to measured steps of several plans --------------------------------------------------------------


def step_samples(compute_scale, memory_scale, overhead, base, plans, noise=0.0, seed=0):
    """Steps of plans recomputing (compute_s, memory_s, ops), timed by the step model (plus relative noise)."""
    rng = np.random.default_rng(seed)
    return [
        StepSample(c, m, n, (base + compute_scale * c + memory_scale * m + overhead * n) * (1 + noise * rng.standard_normal()))
        for c, m, n in plans
    ]


PLANS = [(0.0, 0.0, 0), (2e-3, 1e-3, 12), (5e-3, 1e-3, 20), (5e-3, 6e-3, 70), (9e-3, 8e-3, 40), (1e-3, 9e-3, 90)]


@pytest.mark.parametrize(("compute_scale", "memory_scale", "overhead"), [(1.3, 0.2, 4e-6), (0.9, 0.0, 0.0), (2.0, 3.0, 1e-5)])
def test_the_step_fit_recovers_each_regimes_cost(compute_scale, memory_scale, overhead):
    fit = fit_step_calibration(step_samples(compute_scale, memory_scale, overhead, 0.05, PLANS), launch_overhead_s=2e-6)
    assert fit.fitted == ("compute_scale", "memory_scale", "overhead_s")
    assert fit.calibration.compute_scale == pytest.approx(compute_scale, abs=1e-6)
    assert fit.calibration.memory_scale == pytest.approx(memory_scale, abs=1e-6)
    assert fit.calibration.overhead_s == pytest.approx(overhead, abs=1e-9)
    assert fit.base_s == pytest.approx(0.05, rel=1e-6)
    assert fit.residual_s == pytest.approx(0.0, abs=1e-9)


def test_a_regime_the_steps_do_not_vary_keeps_the_profiles_value():
    # every plan recomputes the same memory term and no compute: only the per-op cost varies
    plans = [(0.0, 4e-3, 10), (0.0, 4e-3, 30), (0.0, 4e-3, 60)]
    fit = fit_step_calibration(step_samples(1.0, 0.5, 3e-5, 0.02, plans), launch_overhead_s=2e-6)
    assert fit.fitted == ("overhead_s",)
    assert (fit.calibration.compute_scale, fit.calibration.memory_scale) == (1.0, 1.0)
    assert fit.calibration.overhead_s == pytest.approx(3e-5, rel=1e-6)


def test_terms_that_move_together_fit_only_the_first():
    # memory and op count proportional to compute: the steps tell only one slope, carried by compute
    plans = [(k * 1e-3, k * 2e-3, 5 * k) for k in range(4)]
    fit = fit_step_calibration(step_samples(1.8, 1.0, 2e-6, 0.01, plans), launch_overhead_s=2e-6)
    assert fit.fitted == ("compute_scale",)
    assert fit.calibration.compute_scale == pytest.approx(1.8, rel=1e-6)
    assert (fit.calibration.memory_scale, fit.calibration.overhead_s) == (1.0, None)  # None: the profile's
    assert fit.residual_s == pytest.approx(0.0, abs=1e-9) and fit.held_out_s < fit.roofline_held_out_s


def test_steps_the_roofline_already_explains_keep_it():
    """Steps timed exactly as the profile's roofline prices them: no term is fitted (fewer terms win a tie)."""
    fit = fit_step_calibration(step_samples(1.0, 1.0, 2e-6, 0.05, PLANS), launch_overhead_s=2e-6)
    assert fit.fitted == () and fit.calibration == Calibration(1.0, 1.0, None)
    assert fit.base_s == pytest.approx(0.05) and fit.held_out_s == fit.roofline_held_out_s


def test_noise_the_terms_cannot_explain_keeps_the_roofline():
    """Step times whose spread (1 ms) exceeds what the terms' rise (a few ms, all rising together) explains:
    a fit would explain the noise and mispredict the next plan; the held-out error keeps the roofline."""
    plans = [(k * 1e-3, k * 0.5e-3, 10 * k) for k in range(6)]
    rng = np.random.default_rng(0)
    samples = [StepSample(c, m, n, 0.2 + c + m + 4e-6 * n + 1e-3 * rng.standard_normal()) for c, m, n in plans]
    fit = fit_step_calibration(samples, launch_overhead_s=4e-6)
    assert fit.fitted == () and (fit.calibration.compute_scale, fit.calibration.memory_scale) == (1.0, 1.0)
    assert fit.held_out_s == fit.roofline_held_out_s


def test_the_step_fit_tolerates_measurement_noise():
    plans = PLANS * 4
    fit = fit_step_calibration(step_samples(1.5, 0.25, 0.0, 0.05, plans, noise=0.002, seed=3), launch_overhead_s=2e-6)
    # 0.2% noise on a 50 ms step is 0.1 ms: the slopes hold to about that over ms-sized terms
    assert fit.calibration.compute_scale == pytest.approx(1.5, abs=0.15)
    assert fit.calibration.memory_scale == pytest.approx(0.25, abs=0.15)
    assert fit.residual_s < 0.2e-3


def test_step_samples_sum_a_steps_graphs_and_refuse_too_few_plans():
    sample = StepSample.of([{"compute_s": 1e-3, "memory_s": 2e-3, "ops": 4}, {"compute_s": 0.0, "memory_s": 1e-3, "ops": 1}], 0.1)
    assert (sample.compute_s, sample.memory_s, sample.ops) == pytest.approx((1e-3, 3e-3, 5))
    with pytest.raises(ValueError, match="at least two plans that recompute differently"):
        fit_step_calibration([sample, sample], launch_overhead_s=1e-6)
    with pytest.raises(ValueError, match="measured_s must be finite"):
        StepSample(0.0, 0.0, 0, float("nan"))
    with pytest.raises(ValueError, match="launch_overhead_s"):
        fit_step_calibration([sample, StepSample(0.0, 0.0, 0, 0.09)], launch_overhead_s=-1.0)


def test_recompute_terms_count_each_op_in_the_term_that_bounds_it():
    terms = recompute_terms([(2e-3, 1e-3), (1e-4, 5e-4), (0.0, 2e-4)])
    assert terms == {"compute_s": pytest.approx(2e-3), "memory_s": pytest.approx(7e-4), "ops": 3}
