"""The memory budget's guarantees, end to end on CPU (issue 3, item 5), each measured with the profiler.

- numerics: loss and gradients equal the same step compiled without a plan, dropout included;
- a feasible plan's measured peak is within the budget; the predicted peak is within 5% of the measured;
- monotonic: a lower budget never gives a higher measured peak;
- no plan fits: the error names the smallest reachable peak; on_infeasible="best" compiles that plan.
"""

from __future__ import annotations

import dataclasses
import re
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_testing import (
    COMPILERS,
    allowing_best_plan,
    assert_gradients_match_eager,
    backward_lowerings,
    dpcs_compile,
    lowerings_expected,
    measured_step,
    reachable_range,
)
from dpcs_compiler import clear_compile_records, compile_records
from dpcs_compiler.cost.budget import WORKSPACE_FRACTION, measurement_tolerance, planning_target
from dpcs_compiler.stages.job import BudgetInfeasibleError
from dpcs_compiler.models import (
    BlockMLP, ConvNet, GPTConfig, MiniGPT, ResConvNet, ResidualMLPBlock, Workload, bench_workload, workload,
)

LADDER_STEPS = 5


def gpt_workload(dropout: float = 0.0, batch: int = 4, layers: int = 2):
    w = workload("gpt", batch, layers=layers)
    if dropout:
        torch.manual_seed(0)
        model = MiniGPT(dataclasses.replace(GPTConfig(layers=layers), dropout=dropout))
        w = dataclasses.replace(w, model=model)
    return w


def conv_workload(model=None):
    """A conv net with batch norm: on CPU its kernels allocate inside themselves about as much as their
    outputs (oneDNN's layout reorders), which the plan must count (`passes/analysis/op_workspace.py`)."""
    generator = torch.Generator().manual_seed(0)
    model = ConvNet(16) if model is None else model
    x = torch.randn(8, 3, 32, 32, generator=generator)
    return Workload("convnet", model, (x,), lambda out: F.cross_entropy(out, torch.zeros(8, dtype=torch.long)))


def lowest_budget(lowest_peak: int) -> int:
    """The smallest budget the lowest plan fits: plans are held to the budget less a workspace allowance."""
    return math.ceil(lowest_peak / (1 - WORKSPACE_FRACTION)) + 1


def budget_ladder(low: int, high: int) -> list[int]:
    return [int(b) for b in np.linspace(high, lowest_budget(low), LADDER_STEPS)]


def step_gradients(model, compiled, inputs, loss_fn):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the same dropout masks in both runs
    loss = loss_fn(compiled(*inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.inductor])])
def test_planned_steps_match_unplanned_numerics_with_dropout(compiler):
    w = gpt_workload(dropout=0.1)
    # Under Inductor the lowest plan only (the most recomputed dropout, at a budget no plan meets; Inductor's
    # compile is the cost here, so no compiles to find the reachable range first).
    budgets = (1,)
    if compiler == "eager":
        low, high = reachable_range(w, compiler)
        budgets = (high, (low + high) // 2, low)
    torch._dynamo.reset()
    expected = step_gradients(w.model, dpcs_compile(w.model, compiler), w.inputs, w.loss_fn)
    for budget in budgets:
        torch._dynamo.reset()
        clear_compile_records()
        compiled = dpcs_compile(w.model, compiler, memory_budget=budget, on_infeasible="best")
        with allowing_best_plan():  # the lowest of them is below what the step reaches
            loss, grads = step_gradients(w.model, compiled, w.inputs, w.loss_fn)
        (record,) = compile_records()
        torch.testing.assert_close(loss, expected[0], msg=f"loss at budget {budget}")
        torch.testing.assert_close(grads, expected[1], msg=f"gradients at budget {budget}")
    assert record.recomputed_values > 0  # the last one really recomputed


@pytest.mark.parametrize("name", ["gpt", "mlp", "convnet"])
def test_feasible_plans_stay_within_budget_monotonically_and_predict_the_peak(name):
    w = {"gpt": gpt_workload, "mlp": lambda: workload("mlp", 512), "convnet": conv_workload}[name]()
    low, high = reachable_range(w, "eager")
    rows = []
    for budget in budget_ladder(low, high):
        result, record = measured_step(w, "eager", memory_budget=budget)
        rows.append((budget, record.predicted_peak_bytes, result.measured_peak_bytes, record.recomputed_values))
    report = "\n".join(f"budget {b} predicted {p} measured {m} recomputed {r}" for b, p, m, r in rows)
    for budget, predicted, measured, _ in rows:
        assert measured <= budget, report
        assert abs(predicted - measured) <= 0.05 * measured, report
    measured_peaks = [m for _, _, m, _ in rows]
    assert all(later <= earlier for earlier, later in zip(measured_peaks, measured_peaks[1:])), report
    assert measured_peaks[-1] < measured_peaks[0], report  # the budget really bought memory


def test_infeasible_budget_error_names_the_smallest_reachable_peak():
    w = gpt_workload()
    low, _ = reachable_range(w, "eager")
    torch._dynamo.reset()
    compiled = dpcs_compile(w.model, "eager", memory_budget=low - 1)
    with pytest.raises(Exception, match=rf"smallest peak dpcs can reach is .* \({low} B\)") as error:
        w.loss_fn(compiled(*w.inputs))
    assert "on_infeasible='best'" in str(error.value)


def test_a_budget_at_the_reported_lowest_peak_is_met_and_one_byte_under_is_refused_naming_it():
    """The lowest peak `memory_budget=1` reports is the compiled plan's. On this conv net its partitioned
    graphs hold 2,304 B less than the plan model, which refused a budget at that peak (AMD EPYC, AVX2, torch
    2.13): a lowest plan barely over by the model is compiled and judged by its graphs (`within_reach`). One
    byte under, the budget is refused by the step (the graph returns its logits, which the loop could drop)."""
    torch.manual_seed(0)
    w = conv_workload(ResConvNet(32, 4))
    low, _ = reachable_range(w, "eager")
    result, record = measured_step(w, "eager", memory_budget=lowest_budget(low))
    assert record.plan_feasible and record.predicted_peak_bytes == low, record
    assert result.measured_peak_bytes <= lowest_budget(low), (result, record)
    under = lowest_budget(low)
    while planning_target(under) >= low:  # the largest budget whose plans are held below that peak
        under -= 1
    torch._dynamo.reset()
    compiled = dpcs_compile(w.model, "eager", memory_budget=under)
    # The net returns its logits, which the loop may drop before the backward (the loss is eager code): the
    # graph's compile leaves the verdict to the step, which refuses the budget at the second step, naming the
    # step's smallest peak (its model counts the runtime allowances of the step too).
    with pytest.raises(BudgetInfeasibleError, match=r"smallest step peak dpcs can reach is .* \((\d+) B\)") as error:
        for _ in range(2):
            w.model.zero_grad(set_to_none=True)
            w.loss_fn(compiled(*w.inputs)).backward()
    named = int(re.search(r"can reach is [^(]*\((\d+) B\)", str(error.value)).group(1))
    assert low <= named <= low + 4096 and planning_target(under) < named, (named, low)
    assert "on_infeasible='best'" in str(error.value)


def test_infeasible_budget_best_compiles_the_lowest_plan_with_a_warning():
    w = gpt_workload()
    torch._dynamo.reset()
    compiled = dpcs_compile(w.model, "eager", memory_budget=1, on_infeasible="best")
    with pytest.warns(UserWarning, match="smallest peak dpcs can reach"):
        w.loss_fn(compiled(*w.inputs)).backward()
    (record,) = compile_records()
    assert record.plan_feasible is False and record.budget_bytes == 1


@pytest.mark.inductor
def test_inductor_plan_within_budget_and_prediction():
    w = gpt_workload()
    # (eager's range: within a few percent of Inductor's, and no Inductor compile; the mid budget is between
    # Inductor's lowest and highest plans too, which the recomputation asserted below shows)
    low, high = reachable_range(w, "eager")
    budget = (low + high) // 2
    result, record = measured_step(w, "inductor", memory_budget=budget)
    assert record.plan_feasible and record.recomputed_values > 0
    assert result.measured_peak_bytes <= budget, (result, record)
    assert abs(result.relative_error) <= 0.05, (result, record)


@pytest.mark.inductor
def test_inductor_conv_net_plan_counts_its_kernels_workspace():
    """Under Inductor a conv net's convolutions run as ATen kernels on channels-last tensors; their own
    workspace is counted in the plan and in Inductor's schedule (`op_workspace`, `inductor_schedule`)."""
    torch.manual_seed(0)
    w = conv_workload(ResConvNet(32, 4))
    unbudgeted, _ = measured_step(w, "inductor", memory_budget="1TiB")
    budget = int(unbudgeted.measured_peak_bytes * 0.85)
    result, record = measured_step(w, "inductor", memory_budget=budget)
    assert record.plan_feasible and record.recomputed_values > 0, (result, record)
    assert result.measured_peak_bytes <= budget, (result, record)
    # Left out, the convolutions' workspace made the prediction 0.44% low (73 KB of 16.6 MB; AMD EPYC, AVX2, torch 2.13).
    assert abs(record.predicted_peak_bytes - result.measured_peak_bytes) <= 0.002 * result.measured_peak_bytes, (result, record)


@pytest.mark.inductor
def test_inductor_remade_activation_over_its_pre_activation_is_counted_once():
    """Inductor remakes a recomputed tanh in the buffer of its remade pre-activation, which dies there: the
    remake holds one hidden-sized buffer, not two. Counted as two, this budget was refused as unreachable
    (lowest plan predicted and measured at the unbudgeted peak, 9,705,216 B); counted as one, one tanh is
    recomputed and the step measures 7,609,864 B against 7,610,112 predicted (AMD EPYC, AVX2, torch 2.13)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(ResidualMLPBlock(128), ResidualMLPBlock(128))
    w = Workload("tanh_mlp", model, (torch.randn(1024, 128),), lambda out: out.square().mean())
    _, unbudgeted = measured_step(w, "inductor", memory_budget="1TiB", keep_torch_plan=False)
    budget = int(unbudgeted.predicted_peak_bytes * 0.84)
    result, record = measured_step(w, "inductor", memory_budget=budget)
    assert record.plan_feasible and record.recomputed_values >= 1 and record.replans == 0, (result, record)
    assert result.measured_peak_bytes <= budget, (result, record)
    assert abs(record.predicted_peak_bytes - result.measured_peak_bytes) <= 0.001 * result.measured_peak_bytes, (
        result, record)
    # The plan model's backward and Inductor's schedule of it agree (on the bench's graph-break net the remake
    # counted twice put the model 7 MiB over both).
    assert abs(record.backward_schedule_excess_bytes) <= 4096, record


@pytest.mark.inductor
def test_inductor_llama_plans_stay_within_budget_and_predict_the_peak():
    """A Llama-style block: Inductor's fused schedule of a planned backward (a recomputed SwiGLU product
    next to its silu backward) is what the plan is held to (`PartCompiler.check_schedule`)."""
    w = bench_workload("llama", quick=True)
    low, high = reachable_range(w, "inductor")
    rows = []
    for fraction in (0.15, 0.5):  # (each an Inductor compile: the budget tests near no pressure are eager's)
        budget = int(low + fraction * (high - low))
        result, record = measured_step(w, "inductor", memory_budget=budget)
        rows.append((budget, record.predicted_peak_bytes, result.measured_peak_bytes, record.plan_feasible,
                     record.replans, record.backward_schedule_excess_bytes))
    report = "\n".join(
        f"budget {b} predicted {p} measured {m} feasible {f} replans {r} backward excess {e}" for b, p, m, f, r, e in rows
    )
    for budget, predicted, measured, feasible, _, _ in rows:
        assert feasible, report
        assert measured <= budget, report
        assert abs(predicted - measured) <= 0.05 * measured, report


@pytest.mark.inductor
def test_inductor_lowest_plan_compiles_the_backward_inductor_schedules_lowest(monkeypatch):
    """Over its budget, a plan's backward is scheduled with Inductor's producer/consumer fusions and with the
    fusion guard keeping producers apart, from one lowering, and the lower is compiled
    (`PartCompiler.lowest_scheduled_backward`): on the bench Llama the rule lowered the lowest plan by
    0.96 MB, on Hugging Face GPT-2 it would raise it."""
    w = bench_workload("llama", quick=True)
    with backward_lowerings(monkeypatch) as lowerings:
        result, record = measured_step(w, "inductor", memory_budget=1, on_infeasible="best")
    scheduled = record.backward_order_scheduled
    assert list(scheduled) == ["autograd", "autograd, producers apart"], scheduled  # Inductor's fusions first
    chosen = record.backward_order + (", producers apart" if record.backward_fusion == "producers apart" else "")
    assert scheduled[chosen] == min(scheduled.values()), (chosen, scheduled)
    # Both rules are scheduled from one lowering, and the lower compiled from it: no lowering for the compile.
    assert lowerings[0] == lowerings_expected(record) == 1, (lowerings, record)
    assert record.pass_seconds["backward/order_by_schedule"] > 0
    assert abs(record.predicted_peak_bytes - result.measured_peak_bytes) <= 0.01 * result.measured_peak_bytes, (
        result, record)


@pytest.mark.inductor
def test_a_forward_whose_peak_is_not_the_steps_is_scheduled_once_and_compiles_as_if_the_guard_were_tried(
        monkeypatch):
    """The bench GPT's lowest plan: its backward holds the step's peak, so no schedule of its forward could fit
    or lower the step measurably (`PartCompiler.may_improve`), and the fusion guard's schedule of it is not
    made: one scheduling less than when it is made and then turned down, and the same code, refusals and
    measured peak."""
    from torch._inductor.graph import GraphLowering

    from dpcs_compiler.stages.compile_parts import PartCompiler

    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")  # the plan asserted on: not this CPU's speeds
    w = bench_workload("gpt", quick=True)
    real_improve, real_update = PartCompiler.may_improve, GraphLowering._update_scheduler
    asked, schedulings = [], [0]

    def counted(graph):
        schedulings[0] += 1
        return real_update(graph)

    def run(improve):
        schedulings[0] = 0
        monkeypatch.setattr(PartCompiler, "may_improve", improve)
        monkeypatch.setattr(GraphLowering, "_update_scheduler", counted)
        try:
            return (*measured_step(w, "inductor", memory_budget=1, on_infeasible="best"), schedulings[0])
        finally:
            monkeypatch.setattr(GraphLowering, "_update_scheduler", real_update)

    def answered(self, kind, peak):
        asked.append((kind, real_improve(self, kind, peak)))
        return asked[-1][1]

    skipped, record, skipped_schedulings = run(answered)
    assert asked == [("forward", False)], asked
    tried, tried_record, tried_schedulings = run(lambda self, kind, peak: True)
    assert skipped_schedulings == tried_schedulings - 1, (skipped_schedulings, tried_schedulings)
    assert record.fusions_refused == tried_record.fusions_refused
    assert skipped.measured_peak_bytes == tried.measured_peak_bytes, (skipped, tried)
    assert record.predicted_peak_bytes == tried_record.predicted_peak_bytes
    # Within what the runtime takes for noise (it measured 7.9 KB over the prediction both ways).
    assert abs(record.predicted_peak_bytes - skipped.measured_peak_bytes) <= measurement_tolerance(record.budget_bytes)


@pytest.mark.inductor
def test_inductor_lowest_plan_whose_fusion_rule_changes_nothing_lowers_its_backward_once(monkeypatch):
    """The MLP's lowest plan: its backward has no producer/consumer fusion the guard's rule would refuse, so one
    candidate is scheduled (autograd's order, Inductor's fusions) and, the lowest, compiled as it was: one
    lowering of the backward, where scheduling it apart and compiling it after took two. Its gradients are
    eager's and its measured peak is the prediction."""
    w = workload("mlp", 8)
    with backward_lowerings(monkeypatch) as lowerings:
        result, record = measured_step(w, "inductor", memory_budget=1, on_infeasible="best")
    assert record.plan_feasible is False and list(record.backward_order_scheduled) == ["autograd"], record
    assert lowerings[0] == lowerings_expected(record) == 1, (lowerings, record.backward_order_scheduled)
    assert abs(record.predicted_peak_bytes - result.measured_peak_bytes) <= 0.01 * result.measured_peak_bytes, (
        result, record)
    assert_gradients_match_eager(w, compiler="inductor", memory_budget=1, on_infeasible="best")


def inflate(monkeypatch, kind: str, extra: int) -> None:
    """Make the compiled graphs of `kind` hold `extra` bytes more than planned, as Inductor's schedule
    (Inductor) or the partitioned graphs (eager) would report them."""
    from dpcs_compiler.stages.compile_parts import PartCompiler
    from dpcs_compiler.stages.job import PhaseLevels

    check = PartCompiler.check_schedule

    def inflated_check(self, phase, scheduled):
        if phase == kind:
            scheduled = dataclasses.replace(scheduled, peak_bytes=scheduled.peak_bytes + extra)
        return check(self, phase, scheduled)

    monkeypatch.setattr(PartCompiler, "check_schedule", inflated_check)
    levels = PhaseLevels.of

    def inflated_levels(timeline):
        found = levels(timeline)
        field = "forward_peak" if kind == "forward" else "backward_peak"
        return dataclasses.replace(found, **{field: getattr(found, field) + extra})

    monkeypatch.setattr(PhaseLevels, "of", staticmethod(inflated_levels))


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.inductor])])
def test_compiled_graphs_over_the_plan_are_planned_again(monkeypatch, compiler):
    w = gpt_workload()
    low, high = reachable_range(w, compiler)
    budget, extra = (low + high) // 2, (high - low) // 4
    _, plain = measured_step(w, compiler, memory_budget=budget)
    inflate(monkeypatch, "backward", extra)
    _, record = measured_step(w, compiler, memory_budget=budget)
    # The first plan, held to its compiled graphs, is over; the second plans with that much less room.
    assert plain.replans == 0 and record.replans >= 1
    assert record.plan_feasible and record.predicted_peak_bytes <= budget
    assert record.partition_peak_bytes < plain.partition_peak_bytes  # a plan that holds less


@pytest.mark.inductor
def test_compiled_graphs_over_the_plan_after_the_last_replan_error_or_warn(monkeypatch):
    import dpcs_compiler.stages.job as job

    w = gpt_workload()
    # (eager's range: within a few percent of Inductor's, and no Inductor compile; the mid budget is met either way)
    low, high = reachable_range(w, "eager")
    budget = (low + high) // 2
    inflate(monkeypatch, "backward", (high - low) // 4)
    monkeypatch.setattr(job, "MAX_SCHEDULE_REPLANS", 0)
    torch._dynamo.reset()
    compiled = dpcs_compile(w.model, "inductor", memory_budget=budget)
    with pytest.raises(Exception, match=r"Inductor's schedule of its backward graph holds more .* after 0 re-plans"):
        w.loss_fn(compiled(*w.inputs))
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(w.model, "inductor", memory_budget=budget, on_infeasible="best")
    with pytest.warns(UserWarning, match=r"Inductor's schedule of its backward graph holds more"):
        w.loss_fn(compiled(*w.inputs)).backward()
    (record,) = compile_records()
    assert record.plan_feasible and record.predicted_peak_bytes > budget


def test_a_graph_whose_backward_computes_nothing_compiles_under_a_budget():
    """Gradients that are just the tangents (x + y): no candidates, nothing to decide, no failure."""
    x, y = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    compiled = dpcs_compile(lambda a, b: a + b, "eager", memory_budget="1GiB")
    compiled(x, y).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(8))
    (record,) = compile_records()
    assert record.plan_feasible and record.recomputed_values == 0


@pytest.mark.inductor
def test_inference_under_a_budget_keeps_inductors_buffer_pool(monkeypatch):
    """The budget plans training graphs; an inference graph compiles as without it."""
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    real = compile_fx_module.compile_fx_inner

    def spy(gm, example_inputs, *args, **kwargs):
        seen.append((bool(kwargs.get("is_inference")), torch._inductor.config.allow_buffer_reuse))
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", spy)
    model = torch.nn.Linear(4, 4)
    compiled = dpcs_compile(model, "inductor", memory_budget="1GiB")
    with torch.no_grad():
        compiled(torch.randn(2, 4))
    assert seen == [(True, True)]


@pytest.mark.inductor
def test_an_unreadable_inductor_schedule_falls_back_to_the_partitioned_graphs(monkeypatch):
    import dpcs_compiler.passes.analysis.inductor_schedule as module

    def broken(*args, **kwargs):
        raise KeyError("moved")

    monkeypatch.setattr(module, "scheduled_peak", broken)
    w = gpt_workload()
    compiled = dpcs_compile(w.model, "inductor", memory_budget="1GiB", strict=False)
    with pytest.warns(DpcsWarning, match="could not read Inductor's schedule of the (forward|backward) graph"):
        w.loss_fn(compiled(*w.inputs)).backward()
    (record,) = compile_records()
    assert record.plan_feasible and record.forward_schedule_excess_bytes is None
    torch._dynamo.reset()
    strict = dpcs_compile(w.model, "inductor", memory_budget="1GiB")  # the suite compiles strict
    with pytest.raises(Exception, match="could not read Inductor's schedule"):
        w.loss_fn(strict(*w.inputs))


def backward_matmuls(monkeypatch, w, compiler: str, **options):
    """Compile `w` with these options; the number of matmuls in its backward graph, the measurement, the record."""
    import dpcs_compiler.stages.partition as partition_stage

    seen = []
    real = partition_stage.partition_by_plan

    def spy(*args, **kwargs):
        forward, backward = real(*args, **kwargs)
        seen.append(sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in backward.graph.nodes))
        return forward, backward

    monkeypatch.setattr(partition_stage, "partition_by_plan", spy)
    result, record = measured_step(w, compiler, **options)
    monkeypatch.undo()
    return seen[-1], result, record


class MeanSquareLoss(torch.nn.Module):
    """The loss inside the compiled module: eager code outside the graph is memory no plan can see."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).pow(2).mean()


@pytest.mark.inductor
def test_gelu_outputs_are_recomputed_before_any_matmul(monkeypatch):
    """Linear + GELU blocks: saving the pre-activations and recomputing GELU (one fused kernel) frees half
    the activations for almost nothing. GELU's pointwise steps were each costed as a pass over memory, so
    the planner recomputed matmuls instead; a value Inductor fuses into its reader now moves no bytes. Planned with
    the suite's pinned reference-cpu profile: with the profile measured in the process, the plan depended on
    the CPU (12 backward matmuls instead of 9 on an AVX512-BF16 EPYC)."""
    torch.manual_seed(0)
    w = workload("mlp", 1024)
    w = dataclasses.replace(w, model=MeanSquareLoss(BlockMLP(256, 256, 10, layers=5)), loss_fn=lambda loss: loss)
    # The range of autograd's order: the lowest plan's sunk order (Inductor schedules it lower) reaches lower
    # still, where a matmul has to be recomputed as well.
    low, high = reachable_range(w, "inductor", backward_order="autograd")
    all_saved, _, _ = backward_matmuls(monkeypatch, w, "inductor", memory_budget="1TiB", keep_torch_plan=False)
    for fraction in (0.5, 0.7):
        budget = int(low + fraction * (high - low))
        matmuls, result, record = backward_matmuls(monkeypatch, w, "inductor", memory_budget=budget)
        assert record.plan_feasible and record.recomputed_values > 0
        assert matmuls == all_saved, record  # no matmul recomputed
        assert result.measured_peak_bytes <= budget


@pytest.mark.inductor
def test_a_re_plan_the_solver_finds_over_is_judged_by_its_own_compiled_graphs(monkeypatch):
    """The first plan's graphs hold so much more that no plan fits with that much less room: the lowest
    plan is compiled anyway and, holding no more than its model by its own graphs, fits (no error)."""
    from dpcs_compiler.report import compiles_raised
    from dpcs_compiler.stages.compile_parts import PartCompiler

    w = gpt_workload()
    low, high = reachable_range(w, "inductor")
    budget = (low + high) // 2
    check = PartCompiler.check_schedule

    def first_plan_over(self, phase, scheduled):
        if phase == "backward" and self.job.record.replans == 0:
            scheduled = dataclasses.replace(scheduled, peak_bytes=scheduled.peak_bytes + (high - low))
        return check(self, phase, scheduled)

    monkeypatch.setattr(PartCompiler, "check_schedule", first_plan_over)
    raised = compiles_raised()
    result, record = measured_step(w, "inductor", memory_budget=budget)  # on_infeasible="error"
    assert record.replans == 1 and record.plan_feasible
    assert compiles_raised() == raised + 1  # the step recorder collects garbage after it (`step/`)
    assert result.measured_peak_bytes <= record.predicted_peak_bytes * 1.05 and result.measured_peak_bytes <= budget


def test_a_graph_that_returns_an_activation_plans_where_its_backward_ops_run():
    """x + gelu(linear(x)) returned (a piece of a model, as DDP's graph splitting compiles): GELU's derivative
    needs no tangent but runs in the backward. The plan used to count it as a forward value to save, and the
    partition, which computes it in the backward, refused the plan."""
    block = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
    compiled = dpcs_compile(lambda x: x + block(x), "eager", memory_budget="1GiB")
    x = torch.randn(64, 256)
    out = compiled(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    (x + block(x)).square().sum().backward()
    for got, expected in zip(grads, (p.grad for p in block.parameters())):
        torch.testing.assert_close(got, expected)
    (record,) = compile_records()
    assert record.plan_feasible and record.saved_values >= 1


def final_graphs(dump_dir) -> dict[str, str]:
    """The forward and backward graphs a compile ran, from its dump folder (the last of each, after re-plans)."""
    graphs = {}
    for path in sorted(dump_dir.glob("*/*_*.final.txt")):
        graphs[path.name.split("_", 1)[1]] = path.read_text()
    return graphs


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_budget_at_or_above_the_unbudgeted_peak_compiles_torchs_plan(tmp_path, compiler):
    """No cost at no pressure (issue 18): at the measured peak of the step compiled without a budget, and
    above it, dpcs compiles torch's own partition: the very forward and backward graphs, the same peak.
    Under Inductor the FX-order model puts torch's partition over that budget (Inductor's order holds less):
    it is tried, and its schedule decides. Below it, dpcs plans."""
    from dpcs_compiler.stages.memory_plan import TORCH_SOLVER

    w = gpt_workload()
    plain, plain_record = measured_step(w, compiler, dump_dir=tmp_path / "plain")
    for budget in (plain.measured_peak_bytes, 2 * plain.measured_peak_bytes):
        result, record = measured_step(w, compiler, memory_budget=budget, dump_dir=tmp_path / str(budget))
        assert record.solver == TORCH_SOLVER and record.plan_feasible and record.replans == 0, record
        assert final_graphs(tmp_path / str(budget)) == final_graphs(tmp_path / "plain")
        assert (record.saved_values, record.saved_bytes) == (plain_record.saved_values, plain_record.saved_bytes)
        assert result.measured_peak_bytes <= plain.measured_peak_bytes
    below = int(plain.measured_peak_bytes * 0.95)
    result, record = measured_step(w, compiler, memory_budget=below)
    assert record.solver != TORCH_SOLVER and record.recomputed_values > 0
    assert result.measured_peak_bytes <= below


@pytest.mark.inductor
def test_torchs_plan_tried_over_the_budget_by_its_schedule_gives_way_to_a_dpcs_plan(monkeypatch):
    """Torch's partition tried (its FX-order peak within the try margin) but over the budget by Inductor's
    schedule: the compile stops at the schedule, before code is generated, and dpcs plans instead."""
    from dpcs_compiler.stages import memory_plan

    monkeypatch.setattr(memory_plan, "TORCH_PLAN_TRY_FRACTION", 1.0)
    w = gpt_workload()
    plain, _ = measured_step(w, "inductor")
    budget = int(plain.measured_peak_bytes * 0.97)
    generated = []
    from torch._inductor.graph import GraphLowering

    codegen = GraphLowering.codegen

    def counted(self, *args, **kwargs):  # (Inductor's scheduler runs inside codegen: counted once done)
        out = codegen(self, *args, **kwargs)
        generated.append(self)
        return out

    monkeypatch.setattr(GraphLowering, "codegen", counted)
    result, record = measured_step(w, "inductor", memory_budget=budget)
    assert record.replans >= 1 and record.solver != memory_plan.TORCH_SOLVER and record.recomputed_values > 0
    assert result.measured_peak_bytes <= budget
    # The graph whose schedule went over generated no code (two of each compile's would have).
    assert len(generated) < 2 * (record.replans + 1), (len(generated), record.replans)
