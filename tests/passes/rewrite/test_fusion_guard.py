"""PlannedFusionChoices: no fusion across allocations that makes outputs early, checked on generated code and measured
peak."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from dpcs_compiler.measure import measure_peak_memory
from dpcs_compiler.passes.rewrite.fusion_guard import PlannedFusionChoices, planned_fusion_choices, scheduled_under_each_rule

N = 256
BUFFER = N * N * 4
# Sums of N float32 products, reduced in another order by Inductor's vectorized kernels.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-3}


def silu_backward_like(g, u, grad, w):
    # The shape of a SwiGLU backward with its product recomputed: h (recomputed for a weight gradient) and
    # grad_g (the silu backward) read the same inputs, so Inductor fuses them into one kernel that runs
    # before the weight-gradient matmul, and grad_g exists while that matmul's output is made. Kept
    # apart, grad_g is made after the weight gradient is reduced and freed.
    h = F.silu(g) * u
    weight_grad = (h.t() @ grad).sum(dim=0)
    sg = torch.sigmoid(g)
    grad_g = grad * u * sg * (1 + g * (1 - sg))
    return weight_grad, (grad_g @ w).sum(dim=0)


def compile_and_measure(guarded: bool):
    torch._dynamo.reset()
    inputs = [torch.randn(N, N) for _ in range(4)]
    compiled = torch.compile(silu_backward_like, backend="inductor", dynamic=False)
    # Inductor's caches key on the graph, not on the heuristics object: compile afresh each time.
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        with planned_fusion_choices() if guarded else contextlib.nullcontext() as guard:
            outputs, (code,) = run_and_get_code(compiled, *inputs)
        _, peak = measure_peak_memory(compiled, *inputs)
    return outputs, silu_backward_like(*inputs), code, peak.peak_increase_bytes, guard


@pytest.mark.inductor
def test_guard_keeps_siblings_apart_and_lowers_the_measured_peak():
    outputs, expected, code, guarded_peak, guard = compile_and_measure(guarded=True)
    torch.testing.assert_close(outputs, expected, **TOLERANCE)
    assert guard.refused >= 1
    # h's kernel, the weight-gradient matmul, then grad_g's kernel.
    FileCheck().check("cpp_fused_mul_silu").check("extern_kernels.mm").check("cpp_fused").check("sigmoid").check(
        "extern_kernels.mm"
    ).run(code)

    outputs, expected, code, plain_peak, _ = compile_and_measure(guarded=False)
    torch.testing.assert_close(outputs, expected, **TOLERANCE)
    FileCheck().check("sigmoid_silu").check("extern_kernels.mm").check("extern_kernels.mm").run(code)  # one kernel
    assert plain_peak - guarded_peak == pytest.approx(BUFFER, abs=4096)


@pytest.mark.inductor
def test_neighbouring_siblings_still_fuse():
    def neighbours(a, b):
        return (a.sin() * b).sum(dim=0), (a.cos() + b).sum(dim=0)

    torch._dynamo.reset()
    inputs = [torch.randn(N, N) for _ in range(2)]
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), planned_fusion_choices() as guard:
        outputs, (code,) = run_and_get_code(torch.compile(neighbours, backend="inductor"), *inputs)
    torch.testing.assert_close(outputs, neighbours(*inputs), **TOLERANCE)
    assert guard.refused == 0
    assert code.count("cpp_fused") - code.count("def cpp_fused") >= 1


def producer_read_early(a, b, w, v):
    # The shape of a Llama SwiGLU backward at its lowest plan: e (a recomputed product) is read by a matmul
    # (a weight gradient) and by a later pointwise kernel that also reads another matmul's output. Fused
    # with that consumer, e is made after the second matmul, and the first runs after both, with the
    # consumer's output and the second matmul's alive: 1 MB over the plan on the bench Llama.
    e = torch.relu(a * b)
    weight_grad = (e.t() @ w).sum(dim=0)
    d = b @ v
    consumer = d * e + 1
    return weight_grad, (consumer @ w).sum(dim=0)


@pytest.mark.inductor
def test_guard_keeps_a_producer_read_early_apart_from_its_later_consumer():
    inputs = [torch.randn(N, N) for _ in range(4)]
    peaks, refused, would = {}, {}, {}
    for guarded in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(producer_read_early, backend="inductor", dynamic=False)
        with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
            # Off (the default), the rule leaves producer/consumer fusions to Inductor.
            with planned_fusion_choices(keep_producers_apart=guarded, count_refusable=True) as guard:
                outputs, (code,) = run_and_get_code(compiled, *inputs)
            _, peak = measure_peak_memory(compiled, *inputs)
        torch.testing.assert_close(outputs, producer_read_early(*inputs), **TOLERANCE)
        peaks[guarded], refused[guarded] = peak.peak_increase_bytes, guard.refused_vertical
        would[guarded] = guard.would_refuse_vertical
        if guarded:  # e's kernel, the weight gradient's matmul, the second matmul, then the consumer's kernel
            FileCheck().check("cpp_fused_mul_relu").check("extern_kernels.mm").check("extern_kernels.mm").check(
                "cpp_fused").check("extern_kernels.mm").run(code)
        else:  # one kernel for e and the consumer, after the second matmul
            FileCheck().check("extern_kernels.mm").check("cpp_fused_add_mul_relu").check("extern_kernels.mm").run(code)
    assert refused[False] == 0 and refused[True] >= 1, refused
    # Off, the guard counts the fusions the rule would refuse (what tells dpcs the rule changes the schedule);
    # on, it refuses them instead.
    assert would[False] >= 1 and would[True] == 0, would
    assert peaks[False] - peaks[True] >= BUFFER - 4096, peaks


def lowered_and_scheduled(monkeypatch, rule: bool | None, keep: bool = True):
    """producer_read_early compiled with Inductor, its schedule read by the probe: under one rule (`rule`:
    producers apart or not), or from one lowering under both, keeping the scheduler of `keep` (None)."""
    from torch._inductor.graph import GraphLowering

    from dpcs_compiler.passes.analysis.inductor_schedule import probe_scheduled_peak

    lowerings = [0]
    run = GraphLowering.run

    def counted(self, *args):
        lowerings[0] += 1
        return run(self, *args)

    monkeypatch.setattr(GraphLowering, "run", counted)
    torch._dynamo.reset()
    inputs = [torch.randn(N, N, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    compiled = torch.compile(producer_read_early, backend="inductor", dynamic=False)
    asked = []

    def choose(readings):
        asked.append({rule: peak for rule, (peak, _) in readings.items()})
        return keep

    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), \
            probe_scheduled_peak() as probe, planned_fusion_choices(keep_producers_apart=bool(rule)), \
            scheduled_under_each_rule(probe, choose) if rule is None else contextlib.nullcontext():
        outputs, (code,) = run_and_get_code(compiled, *inputs)
    with torch.no_grad():
        _, peak = measure_peak_memory(compiled, *inputs)
    torch.testing.assert_close(outputs, producer_read_early(*inputs), **TOLERANCE)
    monkeypatch.setattr(GraphLowering, "run", run)
    return list(probe.peaks), asked, code, peak.peak_increase_bytes, lowerings[0]


@pytest.mark.inductor
@pytest.mark.parametrize("keep", [True, False], ids=["producers_apart", "inductor_fusions"])
def test_both_rules_scheduled_from_one_lowering_read_and_run_as_each_rule_lowered_alone(monkeypatch, keep):
    """`scheduled_under_each_rule` lowers the graph once and schedules it under both rules: each reading equals
    that rule's own compile's, and the rule chosen (either: Inductor's fusions are scheduled first, so keeping
    them generates code from a scheduler made before the other) generates that rule's code, measures that
    rule's peak and gives eager's outputs."""
    alone = {rule: lowered_and_scheduled(monkeypatch, rule) for rule in (False, True)}
    readings, asked, code, peak, lowerings = lowered_and_scheduled(monkeypatch, None, keep)
    assert lowerings == 1 and all(alone[rule][4] == 1 for rule in alone), (lowerings, alone)
    assert len(asked) == 1 and asked[0] == {False: alone[False][0][0], True: alone[True][0][0]}, (asked, alone)
    assert asked[0][False].increase_bytes > asked[0][True].increase_bytes, asked  # the rule changes the schedule
    assert readings == alone[keep][0] and readings[0] is asked[0][keep], readings  # the other reading is taken off
    if keep:  # e's kernel, the weight gradient's matmul, the second matmul, then the consumer's kernel
        FileCheck().check("cpp_fused_mul_relu").check("extern_kernels.mm").check("extern_kernels.mm").check(
            "cpp_fused").check("extern_kernels.mm").run(code)
    else:  # one kernel for e and the consumer, after the second matmul
        FileCheck().check("extern_kernels.mm").check("cpp_fused_add_mul_relu").check("extern_kernels.mm").run(code)
    assert peak == alone[keep][3], (peak, alone[keep][3])


@pytest.mark.inductor
def test_a_graph_the_rule_changes_nothing_in_is_scheduled_once():
    """Where the rule would refuse no fusion, the graph is scheduled once, with Inductor's fusions; the rule
    chosen is Inductor's heuristics object only inside the block."""
    from torch._inductor.virtualized import V
    from dpcs_compiler.passes.analysis.inductor_schedule import probe_scheduled_peak

    def neighbours(a, b):
        return (a.sin() * b).sum(dim=0), (a.cos() + b).sum(dim=0)

    torch._dynamo.reset()
    inputs = [torch.randn(N, N) for _ in range(2)]
    asked = []
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), probe_scheduled_peak() as probe, \
            scheduled_under_each_rule(probe, lambda readings: asked.append(dict(readings)) or False):
        outputs = torch.compile(neighbours, backend="inductor")(*inputs)
    torch.testing.assert_close(outputs, neighbours(*inputs), **TOLERANCE)
    assert len(asked) == 1 and list(asked[0]) == [False] and asked[0][False][1].would_refuse_vertical == 0, asked
    assert len(probe.peaks) == 1, probe.peaks
    assert not isinstance(V.choices, PlannedFusionChoices), V.choices


@pytest.mark.inductor
def test_under_max_autotune_only_inductors_fusions_are_scheduled(monkeypatch):
    """Max-autotune rewrites the lowered graph while it schedules it: no second scheduler is made from it."""
    from dpcs_compiler.passes.analysis.inductor_schedule import probe_scheduled_peak

    torch._dynamo.reset()
    inputs = [torch.randn(N, N) for _ in range(4)]
    asked = []
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True, max_autotune_gemm=True,
                                                       max_autotune_gemm_backends="ATEN"), \
            probe_scheduled_peak() as probe, \
            scheduled_under_each_rule(probe, lambda readings: asked.append(dict(readings)) or False):
        outputs = torch.compile(producer_read_early, backend="inductor", dynamic=False)(*inputs)
    torch.testing.assert_close(outputs, producer_read_early(*inputs), **TOLERANCE)
    assert len(asked) == 1 and list(asked[0]) == [False] and asked[0][False][1].would_refuse_vertical >= 1, asked


@pytest.mark.inductor
def test_a_rule_not_scheduled_is_refused_by_name():
    from dpcs_compiler.passes.analysis.inductor_schedule import probe_scheduled_peak

    torch._dynamo.reset()
    inputs = [torch.randn(N, N) for _ in range(4)]
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), probe_scheduled_peak() as probe, \
            scheduled_under_each_rule(probe, lambda readings: "apart"), pytest.raises(Exception, match="'apart'"):
        torch.compile(producer_read_early, backend="inductor", dynamic=False)(*inputs)


def guarded_if_over(monkeypatch, fn, inputs, fits, lower=True, may_improve=True, **config):
    """`fn` compiled with Inductor under `scheduled_guarded_if_over` (`fits`, `lower` and `may_improve`
    answering): its outputs, code, measured peak, the probe's readings, the readings `fits` and `check` were
    given, the choices used and the lowerings and schedulings made."""
    from torch._inductor.graph import GraphLowering

    from dpcs_compiler.passes.analysis.inductor_schedule import probe_scheduled_peak
    from dpcs_compiler.passes.rewrite.fusion_guard import scheduled_guarded_if_over

    counts = {"lowerings": 0, "schedulings": 0}
    run, update = GraphLowering.run, GraphLowering._update_scheduler

    def counted_run(self, *args):
        counts["lowerings"] += 1
        return run(self, *args)

    def counted_update(self):
        counts["schedulings"] += 1
        return update(self)

    monkeypatch.setattr(GraphLowering, "run", counted_run)
    monkeypatch.setattr(GraphLowering, "_update_scheduler", counted_update)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="inductor", dynamic=False)
    asked, checked = [], []
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True, **config), \
            probe_scheduled_peak() as probe, \
            scheduled_guarded_if_over(probe, lambda peak: asked.append(peak) or fits, checked.append,
                                      lower=lambda peak, than: lower, may_improve=lambda peak: may_improve) as used:
        outputs, (code,) = run_and_get_code(compiled, *inputs)
    with torch.no_grad():
        _, peak = measure_peak_memory(compiled, *inputs)
    monkeypatch.setattr(GraphLowering, "run", run)
    monkeypatch.setattr(GraphLowering, "_update_scheduler", update)
    torch.testing.assert_close(outputs, fn(*inputs), **TOLERANCE)
    return code, peak.peak_increase_bytes, list(probe.peaks), asked, checked, used, counts


@pytest.mark.inductor
@pytest.mark.parametrize("fits", [True, False], ids=["inductors_fusions_fit", "over_the_budget"])
def test_the_guard_schedules_only_where_inductors_fusions_do_not_fit(monkeypatch, fits):
    """One lowering: Inductor's own fusions are scheduled first (the fusion the guard would refuse counted); where
    they fit they generate the code (one kernel, the higher peak, nothing refused), else the guard's schedule of
    the same lowering does (two kernels, one buffer lower). `check` sees only the reading that generates code."""
    inputs = [torch.randn(N, N) for _ in range(4)]
    code, peak, readings, asked, checked, used, counts = guarded_if_over(monkeypatch, silu_backward_like, inputs, fits)
    assert counts["lowerings"] == 1 and counts["schedulings"] == (1 if fits else 2), counts
    assert len(asked) == (1 if fits else 2) and len(used) == 1 and readings == checked and len(checked) == 1, (
        asked, readings, checked)
    if fits:
        assert checked[0] is asked[0] and used[0].refused == 0 and used[0].would_refuse_horizontal >= 1
        FileCheck().check("sigmoid_silu").check("extern_kernels.mm").check("extern_kernels.mm").run(code)
    else:
        assert checked[0] is not asked[0] and used[0].refused >= 1
        assert asked[0].increase_bytes - checked[0].increase_bytes == pytest.approx(BUFFER, abs=4096)
        FileCheck().check("cpp_fused_mul_silu").check("extern_kernels.mm").check("cpp_fused").check("sigmoid").check(
            "extern_kernels.mm").run(code)
    _, _, guarded_code, guarded_peak, _ = compile_and_measure(guarded=True)
    _, _, plain_code, plain_peak, _ = compile_and_measure(guarded=False)
    assert peak == (plain_peak if fits else guarded_peak), (peak, plain_peak, guarded_peak)


@pytest.mark.inductor
def test_where_neither_fits_and_the_guard_is_not_measurably_lower_inductors_fusions_generate_the_code(monkeypatch):
    """Both schedules over the budget, the guard's not lower by more than a measurement tells (`lower` says no):
    the guard's kernels buy nothing, and Inductor's fusions, scheduled first from the same lowering, generate
    the code (one kernel, Inductor's own peak, nothing refused); `check` sees their reading, the only one left."""
    inputs = [torch.randn(N, N) for _ in range(4)]
    code, peak, readings, asked, checked, used, counts = guarded_if_over(
        monkeypatch, silu_backward_like, inputs, fits=False, lower=False)
    assert counts == {"lowerings": 1, "schedulings": 2}, counts
    assert len(asked) == 2 and readings == checked == [asked[0]], (asked, readings, checked)
    assert asked[0].increase_bytes - asked[1].increase_bytes == pytest.approx(BUFFER, abs=4096)
    assert len(used) == 1 and used[0].refused == 0 and used[0].would_refuse_horizontal >= 1
    FileCheck().check("sigmoid_silu").check("extern_kernels.mm").check("extern_kernels.mm").run(code)
    _, _, _, plain_peak, _ = compile_and_measure(guarded=False)
    assert peak == plain_peak, (peak, plain_peak)


@pytest.mark.inductor
def test_where_no_schedule_could_do_better_the_guard_is_not_scheduled(monkeypatch):
    """Over the budget, but no schedule of the graph could fit or lower the step's peak measurably (`may_improve`
    says no: the graph's own peak is not the step's): Inductor's fusions generate the code, scheduled once."""
    inputs = [torch.randn(N, N) for _ in range(4)]
    code, _, readings, asked, checked, used, counts = guarded_if_over(
        monkeypatch, silu_backward_like, inputs, fits=False, may_improve=False)
    assert counts == {"lowerings": 1, "schedulings": 1}, counts
    assert readings == checked == asked and len(checked) == 1, (asked, readings, checked)
    assert len(used) == 1 and used[0].refused == 0 and used[0].would_refuse_horizontal >= 1
    FileCheck().check("sigmoid_silu").check("extern_kernels.mm").check("extern_kernels.mm").run(code)


@pytest.mark.inductor
def test_a_graph_the_guard_changes_nothing_in_is_scheduled_once_without_asking(monkeypatch):
    def neighbours(a, b):
        return (a.sin() * b).sum(dim=0), (a.cos() + b).sum(dim=0)

    inputs = [torch.randn(N, N) for _ in range(2)]
    _, _, readings, asked, checked, used, counts = guarded_if_over(monkeypatch, neighbours, inputs, fits=False)
    assert counts == {"lowerings": 1, "schedulings": 1} and asked == [] and readings == checked and len(checked) == 1
    assert used[0].would_refuse_horizontal == 0 and used[0].refused == 0


@pytest.mark.inductor
def test_under_max_autotune_the_guard_schedules_from_the_start(monkeypatch):
    """Max-autotune rewrites the lowered graph while it schedules it: no second scheduler can be made from it, so
    the guard schedules it, as it did before this rule."""
    inputs = [torch.randn(N, N) for _ in range(4)]
    _, _, readings, asked, checked, used, counts = guarded_if_over(
        monkeypatch, silu_backward_like, inputs, fits=True, max_autotune_gemm=True, max_autotune_gemm_backends="ATEN")
    assert counts["schedulings"] == 1 and asked == [] and readings == checked and len(checked) == 1
    assert used[0].refused >= 1
