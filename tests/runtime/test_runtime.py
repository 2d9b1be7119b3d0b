"""The Runtime end to end on CPU: signals seen, policies switching variants, overrides, OOM retry, state, telemetry."""

from __future__ import annotations

import collections
import copy
import dataclasses
import json

import pytest
import torch

from dpcs_compiler import MemoryPolicy, PrecisionPolicy, Runtime, RuntimeConfig
from dpcs_compiler.runtime import CurvatureProbe
from dpcs_compiler.runtime import default_regions, read_telemetry
from dpcs_compiler.runtime import signals as signals_module
from dpcs_compiler.runtime.decisions import Decisions
from dpcs_testing import dpcs_compile
from runtime_scenarios import Blocks


def train(model, compiled, runtime, steps, *, x=None, poison=(), on_step=None):
    """`steps` SGD steps; at the steps in `poison` a gradient of blocks.1 becomes inf and, as GradScaler
    would, the optimizer skips the step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64) if x is None else x
    dtypes = []
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        out = compiled(x)
        dtypes.append(out.dtype)
        loss = out.float().square().mean()
        loss.backward()
        if step in poison:
            model.blocks[1][0].weight.grad[0, 0] = float("inf")
        else:
            optimizer.step()
        runtime.step(loss=loss, optimizer=optimizer)
        if on_step:
            on_step(step)
    return dtypes


def test_an_overflow_promotes_at_the_next_step_and_the_demotion_reuses_the_cached_variant():
    model = Blocks()
    compiled = dpcs_compile(model, precision="bf16")
    policy = PrecisionPolicy(modes=("fp32", "bf16"), patience=4, cooldown=6, per_region=False)
    runtime = Runtime(model, policies=[policy], signal_every=1)
    dtypes = train(model, compiled, runtime, 20, poison={5})
    [graph] = runtime.graphs
    # step 5 overflowed: steps 6.. run fp32; 6 steps of cooldown (and 4 stable), then bf16 again from step 12
    assert dtypes[:5] == [torch.bfloat16] * 5
    assert dtypes[5:11] == [torch.float32] * 6
    assert dtypes[11:] == [torch.bfloat16] * 9
    assert graph.compiles == 2  # bf16 (compiled by Dynamo's call), fp32 once; back to bf16 compiles nothing
    assert [e.decisions for e in runtime.compile_events] == ["compile options", "fp32"]


def test_an_overflow_in_one_region_keeps_that_region_in_fp32():
    model = Blocks()
    compiled = dpcs_compile(model, precision="bf16")
    runtime = Runtime(model, policies=[PrecisionPolicy(modes=("fp32", "bf16"))], signal_every=1)
    train(model, compiled, runtime, 3, poison={2})
    assert runtime.decisions == Decisions("bf16", ("blocks.1",))
    [graph] = runtime.graphs
    options = [k for k in graph.variants]
    assert len(options) == 2
    from dpcs_compiler.runtime.variants import variant_options

    pinned = variant_options(graph.options, runtime.decisions, graph.modules, None)
    assert pinned.keep_fp32 == ("blocks.1", "blocks.1.*")


def test_signals_read_every_n_steps():
    model = Blocks()
    compiled = dpcs_compile(model)
    seen = []
    runtime = Runtime(model, policies=[], signal_every=4)
    original = runtime._decide

    def spy(signals):
        seen.append(signals)
        return original(signals)

    runtime._decide = spy
    train(model, compiled, runtime, 12)
    assert [s.step for s in seen] == [4, 8, 12] and all(s.steps == 4 for s in seen)
    assert all(s.grad_norm and s.grad_norm > 0 and s.loss and not s.overflow for s in seen)
    assert seen[0].headroom is not None and 0 < seen[0].headroom <= 1 and seen[0].peak_bytes > 0


@pytest.mark.parametrize("min_scale, promoted", [(1.0, False), (256.0, True)])
def test_a_grad_scaler_backing_off_promotes_only_below_min_scale(min_scale, promoted):
    """GradScaler backs off from 256 to 128 at step 3: loss scaling at work, unless below min_scale."""
    model = Blocks()
    compiled = dpcs_compile(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    policy = PrecisionPolicy(modes=("fp32", "bf16"), start="bf16", per_region=False, min_scale=min_scale)
    runtime = Runtime(model, policies=[policy], signal_every=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    for step in range(1, 5):
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(x).float().square().mean()
        scaler.scale(loss).backward()
        if step == 3:
            model.head.weight.grad.fill_(float("nan"))
        scaler.step(optimizer)
        scaler.update()
        runtime.step(loss=loss, optimizer=optimizer, scaler=scaler)
        if step == 2:
            assert runtime.decisions.precision == "bf16"
    assert scaler.get_scale() == 2.0**7
    assert runtime.last_signals.scaler_backoffs == 1 and not runtime.last_signals.overflow
    assert runtime.decisions.precision == ("fp32" if promoted else "bf16")
    if promoted:
        assert "loss scale backed off to 128 < min_scale 256" in policy.reason


def test_a_loss_spike_promotes():
    model = Blocks()
    compiled = dpcs_compile(model, precision="bf16")
    policy = PrecisionPolicy(modes=("fp32", "bf16"), loss_z_limit=6.0, grad_z_limit=1e9)
    runtime = Runtime(model, policies=[policy], signal_every=1)
    runtime.collector.loss.warmup = runtime.collector.grad.warmup = 5
    x = torch.randn(32, 64)
    train(model, compiled, runtime, 10, x=x)
    assert runtime.decisions.precision == "bf16"
    x_spike = x * 50  # the loss jumps by orders of magnitude
    train(model, compiled, runtime, 1, x=x_spike)
    assert runtime.decisions.precision == "fp32" and "loss spike" in policy.reason


def test_low_headroom_tightens_the_budget_into_a_lower_peak_plan(monkeypatch):
    model = Blocks(width=256)
    compiled = dpcs_compile(model)
    runtime = Runtime(model, policies=[MemoryPolicy(low_headroom=0.1, factor=0.9, cooldown=100)], signal_every=2)
    headroom = {"value": 0.5}
    monkeypatch.setattr(signals_module, "host_headroom", lambda device: (headroom["value"], 1 << 20))
    x = torch.randn(512, 256)
    train(model, compiled, runtime, 2, x=x)
    assert runtime.decisions.budget_scale is None
    headroom["value"] = 0.02
    train(model, compiled, runtime, 3, x=x)
    assert runtime.decisions.budget_scale == 0.9
    [graph] = runtime.graphs
    loose, tight = (graph.records[k][0] for k in graph.variants)
    assert tight.budget_bytes == int(0.9 * loose.predicted_peak_bytes) and tight.plan_feasible
    assert tight.predicted_peak_bytes <= tight.budget_bytes < loose.predicted_peak_bytes


def test_run_step_retries_an_out_of_memory_step_with_a_tighter_budget():
    model = Blocks(width=256)
    compiled = dpcs_compile(model)
    runtime = Runtime(model, policies=[MemoryPolicy(factor=0.9)], signal_every=1)
    x = torch.randn(512, 256)
    attempts = []

    def step():
        model.zero_grad(set_to_none=True)
        attempts.append(runtime.decisions.budget_scale)
        loss = compiled(x).square().mean()
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        loss.backward()
        return loss.item()

    assert runtime.run_step(step) > 0
    assert attempts == [None, 0.9]
    runtime.step()  # the next read does not count the OOM a second time
    assert runtime.decisions.budget_scale == 0.9
    runtime.config = RuntimeConfig(max_oom_retries=0)
    attempts.clear()
    with pytest.raises(torch.OutOfMemoryError):
        runtime.run_step(step)


def test_overrides_win_over_policies_until_cleared():
    model = Blocks()
    compiled = dpcs_compile(model)
    runtime = Runtime(model, signal_every=1)
    runtime.force_precision("bf16", regions=["head"])
    runtime.force_budget("1MiB")
    assert runtime.decisions == Decisions("bf16", ("head",), None, 2**20)
    train(model, compiled, runtime, 2)
    assert runtime.decisions.precision == "bf16"
    runtime.clear_overrides()
    assert runtime.decisions == Decisions("fp32")
    with pytest.raises(ValueError, match="'int4'.*valid choices"):
        runtime.force_precision("int4")
    with pytest.raises(ValueError, match=r"\['nope'\] are not regions.*blocks\.0"):
        runtime.force_precision("bf16", regions=["nope"])
    with pytest.raises(ValueError, match="force_budget"):
        runtime.force_budget(0.5)


def test_state_round_trip_compiles_the_same_variant_first_and_decides_the_same():
    def run(model, steps, state=None, path=None):
        torch._dynamo.reset()
        compiled = dpcs_compile(model, precision="bf16")
        policy = PrecisionPolicy(modes=("fp32", "bf16"), patience=3, cooldown=4, per_region=False)
        runtime = Runtime(model, policies=[policy, MemoryPolicy()], signal_every=1, telemetry=path, telemetry_every=1)
        if state is not None:
            runtime.load_state_dict(state)
        torch.manual_seed(1)
        first = runtime.step_count
        train(model, compiled, runtime, steps, x=torch.randn(32, 64), poison={p - first for p in (4, 14) if p > first})
        runtime.compiles = [g.compiles for g in runtime.graphs]
        runtime.close()
        return runtime

    torch.manual_seed(0)
    model = Blocks()
    start = copy.deepcopy(model.state_dict())
    whole = run(model, 8)
    model.load_state_dict(start)
    half = run(model, 5)
    state = json.loads(json.dumps(half.state_dict()))  # plain JSON
    assert state["decisions"]["precision"] == "fp32"  # the overflow at step 4 promoted
    resumed = run(model, 3, state)
    assert resumed.compile_events[0].decisions == "fp32" and resumed.compiles == [1]  # the restored variant first
    assert resumed.step_count == whole.step_count == 8
    assert resumed.decisions == whole.decisions
    assert resumed.policies[0].state_dict() == whole.policies[0].state_dict()
    with pytest.raises(ValueError, match="policies"):
        Runtime(model, policies=[]).load_state_dict(state)


def test_telemetry_lines_carry_step_signals_decisions_and_compiles(tmp_path):
    model = Blocks()
    compiled = dpcs_compile(model, precision="bf16")
    path = tmp_path / "telemetry.jsonl"
    policy = PrecisionPolicy(modes=("fp32", "bf16"), per_region=False)
    with Runtime(model, policies=[policy], telemetry=path, signal_every=2, telemetry_every=4) as runtime:
        train(model, compiled, runtime, 3, poison={2})
        written = read_telemetry(path)
        assert written == []  # buffered: fewer than 4 steps since the first entry
        train(model, compiled, runtime, 4)
    entries = read_telemetry(path)
    signal_steps = [e["step"] for e in entries if e["kind"] == "signals"]
    assert signal_steps == [2, 4, 6]
    promoted = next(e for e in entries if e["kind"] == "signals" and e["changed"])
    assert promoted["decisions"]["precision"] == "fp32" and promoted["signals"]["overflow"]
    assert any("promoted" in r for r in promoted["reasons"])
    compiles = [c for e in entries if e["kind"] == "compiles" for c in e["compiles"]]
    assert [c["decisions"] for c in compiles] == ["compile options", "fp32"]
    assert all(c["seconds"] > 0 and c["plan_hashes"] for c in compiles)


def test_config_and_inputs_are_validated():
    with pytest.raises(ValueError, match=r"RuntimeConfig\.signal_every=0"):
        RuntimeConfig(signal_every=0)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        Runtime("model")
    with pytest.raises(ValueError, match="not both"):
        Runtime(Blocks(), config=RuntimeConfig(), signal_every=3)
    with pytest.raises(ValueError, match="Policy instances"):
        Runtime(Blocks(), policies=["precision"])


def test_default_regions_are_the_blocks_and_the_other_children():
    assert list(default_regions(Blocks())) == ["blocks.0", "blocks.1", "head"]


def test_the_curvature_probe_finds_the_top_eigenvalue_and_its_spike_promotes():
    # A quadratic loss 0.5 x^T A x has the Hessian A: its top eigenvalue is known.
    weights = torch.nn.Parameter(torch.randn(6))
    scales = torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0, 7.0])
    factor = {"value": 1.0}
    probe = CurvatureProbe(lambda: 0.5 * (factor["value"] * scales * weights**2).sum(), [weights], every=2, iterations=30)
    assert probe.top_eigenvalue(0) == pytest.approx(7.0, rel=1e-3)
    model = Blocks()
    compiled = dpcs_compile(model, precision="bf16")
    policy = PrecisionPolicy(modes=("fp32", "bf16"), curvature_limit=3.0)
    runtime = Runtime(model, policies=[policy], curvature=probe, signal_every=2)
    train(model, compiled, runtime, 6)
    assert runtime.decisions.precision == "bf16" and probe.probes == 3 and probe.seconds > 0
    factor["value"] = 10.0  # the curvature jumps 10x
    train(model, compiled, runtime, 2)
    assert runtime.last_signals.curvature == pytest.approx(70.0, rel=1e-3)
    assert runtime.decisions.precision == "fp32" and "curvature spike" in policy.reason
    with pytest.raises(ValueError, match="every=0"):
        CurvatureProbe(lambda: weights.sum(), [weights], every=0)


def test_regions_through_a_ddp_wrapper_are_named_as_its_graphs_name_them():
    wrapped = torch.nn.DataParallel(Blocks())  # DDP needs a process group; DataParallel wraps the same way
    assert list(default_regions(wrapped)) == ["module.blocks.0", "module.blocks.1", "module.head"]


def test_a_runtime_that_drives_no_graph_says_so():
    model = Blocks()
    other = Blocks()
    compiled = dpcs_compile(other)
    runtime = Runtime(model, policies=[], signal_every=2)
    with pytest.warns(UserWarning, match="no graph compiled with backend='dpcs' takes this model's parameters"):
        train(other, compiled, runtime, 2)


def test_gradient_norms_sampled_every_k_steps():
    model = Blocks()
    compiled = dpcs_compile(model)
    runtime = Runtime(model, policies=[], signal_every=4, grad_norm_every=2)
    seen = []
    original = runtime._decide
    runtime._decide = lambda signals: (seen.append(signals), original(signals))[1]
    train(model, compiled, runtime, 8)
    assert runtime.collector.grad.count == 4 and runtime.collector.loss.count == 8
    assert all(s.grad_norm and s.grad_norm > 0 for s in seen)


def test_a_graph_compiled_before_the_runtime_scales_its_own_plans_peak(monkeypatch):
    model = Blocks(width=256)
    compiled = dpcs_compile(model)
    x = torch.randn(512, 256)
    compiled(x).square().mean().backward()  # compiled and run before any Runtime exists
    runtime = Runtime(model, policies=[MemoryPolicy(low_headroom=0.1, factor=0.9)], signal_every=1)
    monkeypatch.setattr(signals_module, "host_headroom", lambda device: (0.02, 1 << 20))
    train(model, compiled, runtime, 2, x=x)
    [graph] = runtime.graphs
    loose, tight = (graph.records[k][0] for k in graph.variants)
    assert graph.compiles == 2 and tight.budget_bytes == int(0.9 * loose.predicted_peak_bytes)
    assert runtime.state_dict()["references"] == {graph.fingerprint: loose.predicted_peak_bytes}


def timed_gpt(tmp_path):
    """A 4-layer GPT compiled with a budget, its Runtime (telemetry at every step) and a loop of n steps."""
    from dpcs_compiler.models import workload

    w = workload("gpt", 4)
    compiled = dpcs_compile(w.model, memory_budget="1GiB")
    runtime = Runtime(w.model, policies=[], signal_every=1, telemetry=tmp_path / "t.jsonl", telemetry_every=1)

    def train_steps(steps):
        for _ in range(steps):
            w.model.zero_grad(set_to_none=True)
            w.loss_fn(compiled(*w.inputs)).backward()
            runtime.step()

    return w, runtime, train_steps


def test_step_times_per_variant_fit_the_costs_of_later_plans(tmp_path, monkeypatch):
    """The runtime times each step per variant (steps that compiled left out), fits the roofline to the
    variants that recompute differently, and plans the next variant with a fit that fits a term; a fit that
    keeps the roofline compiles nothing; the fit survives a restart; too few variants is an error that
    changes nothing."""
    from dpcs_compiler.cost.calibration import StepFit
    from dpcs_compiler.cost.op_time import Calibration
    from dpcs_compiler.runtime import runtime as runtime_module

    w, runtime, train_steps = timed_gpt(tmp_path)

    train_steps(6)
    [graph] = runtime.graphs
    # timed from the end of one step() to the start of the next: 5 intervals, none of which compiled (the
    # first step compiled before the first step() call)
    assert runtime.step_samples(6) == [] and len(runtime.step_samples(5)) == 1
    assert sum(len(t) for t in runtime.step_times.values()) == 5
    with pytest.raises(ValueError, match="at least two plans that recompute differently"):
        runtime.calibrate_from_steps(min_steps=1)
    assert runtime.calibration is None and runtime.decisions.calibration is None
    peak = graph.current_peak_bytes
    for fraction in (0.9, 0.7):  # plans that recompute differently (GPT at these sizes: 6 and 10 values)
        runtime.force_budget(int(peak * fraction))
        train_steps(6)
    samples = runtime.step_samples(5)
    assert len(samples) == 3 and len({(s.compute_s, s.memory_s, s.ops) for s in samples}) == 3
    # The real fit of these measured times (which terms it fits depends on the CPU's noise) ...
    real = runtime.calibrate_from_steps()
    assert real.samples == 3 and real.roofline_held_out_s is not None
    # ... and, made deterministic: a fit that keeps the roofline changes nothing, one that fits a term is
    # planned with from the next step.
    kept = StepFit(Calibration(1.0, 1.0, None), 0.1, (), 3, 0.0, 1e-3, 1e-3)
    monkeypatch.setattr(runtime_module, "fit_step_calibration", lambda samples, **kw: kept)
    compiles = graph.compiles
    runtime.clear_calibration()
    assert runtime.calibrate_from_steps() is kept and runtime.calibration is None
    train_steps(2)
    assert graph.compiles == compiles and runtime.decisions.calibration is None
    fitted = StepFit(Calibration(1.0, 0.25, None), 0.1, ("memory_scale",), 3, 0.0, 1e-3, 2e-3)
    monkeypatch.setattr(runtime_module, "fit_step_calibration", lambda samples, **kw: fitted)
    runtime.calibrate_from_steps()
    assert runtime.decisions.calibration == runtime.calibration == (1.0, 0.25, None)
    train_steps(2)
    calibrated = graph.records[graph.current_key][0]
    assert graph.compiles == compiles + 1
    assert calibrated.calibration == {"compute_scale": 1.0, "memory_scale": 0.25, "overhead_s": None, "source": "option"}
    assert calibrated.budget_bytes == int(peak * 0.7) and calibrated.plan_feasible
    runtime.telemetry.flush()
    fits = [e["fit"]["fitted"] for e in read_telemetry(tmp_path / "t.jsonl") if e["kind"] == "calibration"]
    assert fits[1:] == [[], ["memory_scale"]]
    state = json.loads(json.dumps(runtime.state_dict()))
    restored = Runtime(w.model, policies=[])
    restored.load_state_dict(state)
    assert restored.calibration == runtime.calibration and restored.decisions == runtime.decisions
    restored.clear_calibration()
    assert restored.decisions.calibration is None
    with pytest.raises(ValueError, match="Decisions.calibration"):
        Runtime(w.model, policies=[]).load_state_dict({**state, "calibration": [1.0, -2.0, None]})
    with pytest.raises(ValueError, match="min_steps"):
        runtime.step_samples(0)


def test_a_calibration_whose_plans_measure_slower_is_dropped_and_not_applied_again(tmp_path, monkeypatch):
    """A second fit checks the calibration against the steps of the plans it made: one that measured slower
    than the same budget planned with the roofline goes back to the roofline's variant (compiled already) and
    is never applied again, nor a fit within 5% of it; another fit is applied, and kept while it measures
    faster. The step times are set here so the decisions do not depend on how fast this CPU is."""
    from dpcs_compiler.cost.calibration import StepFit
    from dpcs_compiler.cost.op_time import Calibration
    from dpcs_compiler.runtime import runtime as runtime_module

    w, runtime, train_steps = timed_gpt(tmp_path)

    def fit_to(*calibration):
        fit = StepFit(Calibration(*calibration), 0.1, ("memory_scale",), 3, 0.0, 1e-3, 2e-3)
        monkeypatch.setattr(runtime_module, "fit_step_calibration", lambda samples, **kw: fit)

    def set_times(calibration, seconds):
        (key,) = [k for k, timed in runtime._timed.items()
                  if timed.decisions.calibration == calibration and timed.decisions.budget_bytes == runtime.forced_budget]
        runtime.step_times[key] = collections.deque([seconds] * 5)

    train_steps(2)
    [graph] = runtime.graphs
    runtime.force_budget(int(graph.current_peak_bytes * 0.7))
    train_steps(7)
    assert runtime.calibration_checks() == []  # no calibration yet
    fit_to(1.0, 0.25, None)
    runtime.calibrate_from_steps()
    train_steps(7)  # the calibrated variant compiles, then runs 6 timed steps
    compiles = graph.compiles
    set_times(None, 1.0)
    set_times((1.0, 0.25, None), 2.0)
    assert runtime.calibration_checks() == [(2.0, 1.0)]
    fit_to(1.0, 0.26, None)  # the refined fit, within 5% of the slower calibration
    runtime.calibrate_from_steps()
    assert runtime.calibration is None and runtime.decisions.calibration is None
    assert runtime.rejected_calibrations == [(1.0, 0.25, None)]
    train_steps(2)
    assert graph.compiles == compiles  # back to the roofline's variant, compiled already
    fit_to(1.0, 0.5, None)  # a different fit is applied ...
    runtime.calibrate_from_steps()
    assert runtime.calibration == runtime.decisions.calibration == (1.0, 0.5, None)
    train_steps(7)
    assert graph.compiles == compiles + 1
    set_times((1.0, 0.5, None), 0.5)
    runtime.calibrate_from_steps()  # ... and kept while it measures faster
    assert runtime.calibration == (1.0, 0.5, None) and runtime.calibration_checks() == [(0.5, 1.0)]
    runtime.telemetry.flush()
    events = [e for e in read_telemetry(tmp_path / "t.jsonl") if e["kind"] == "calibration"]
    assert [e["rejected"] for e in events] == [None, [1.0, 0.25, None], None, None]
    assert [e["refused"] for e in events] == [False, True, False, False]
    restored = Runtime(w.model, policies=[])
    restored.load_state_dict(json.loads(json.dumps(runtime.state_dict())))
    assert restored.rejected_calibrations == [(1.0, 0.25, None)] and restored.calibration == (1.0, 0.5, None)


def test_decisions_carry_a_calibration_into_the_variant_options():
    from dpcs_compiler.cost.op_time import Calibration
    from dpcs_compiler.options import DpcsOptions
    from dpcs_compiler.runtime.variants import variant_options

    base = DpcsOptions.from_dict({"memory_budget": 1000, "calibrate": True})
    decisions = Decisions(calibration=(1.5, 0.0, None))
    options = variant_options(base, decisions, frozenset(), None)
    assert options.calibration == Calibration(1.5, 0.0, None) and options.calibrate is False
    assert Decisions.from_json(json.loads(json.dumps(decisions.to_json()))) == decisions
    assert Decisions().key() == "3a120f1c8e30"  # as before decisions could carry a calibration (04bad1e)
    assert decisions.key() != Decisions().key() and "compute x1.5" in decisions.describe()
    with pytest.raises(ValueError, match=r"Decisions.calibration=\(1.0, -1.0, None\) is not valid"):
        Decisions(calibration=(1.0, -1.0, None))
