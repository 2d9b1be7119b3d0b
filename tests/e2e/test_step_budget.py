"""One budget for a whole training step of several graphs (issue 14), end to end on CPU, measured with the
profiler: a model with two graph breaks (a data-dependent branch and a `print`) gives three graphs per step.

- at three budgets between the lowest reachable step peak and the step's peak without a budget, the
  measured peak of the whole step stays within the budget, and gradients match eager;
- each graph planned alone against the whole budget (budget_scope="graph", what dpcs did before) goes over
  at least one of them: what step planning fixes;
- a step no plan fits raises, naming the smallest step peak and the graph that holds the most;
- both sides of the data-dependent branch hold the budget when steps alternate between them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dpcs_testing import allowing_best_plan, dpcs_compile
from dpcs_compiler import clear_compile_records, compile_records
from dpcs_compiler.cost.budget import WORKSPACE_FRACTION
from dpcs_compiler.measure import measure_peak_memory, measure_training_step, resident_bytes
from dpcs_compiler.models import workload
from dpcs_compiler.report import predicted_step_peak, step_records
from dpcs_compiler.stages.job import BudgetInfeasibleError, job_of
from dpcs_compiler.stages.memory_plan import TORCH_SOLVER

BATCH = 1024


def breaks_workload():
    return workload("breaks", BATCH)


def run(w, graphs=3, **options):
    """Compile afresh, run until the step plan is in place, measure one step: (measured peak, step records)."""
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(w.model, **{"compiler": "eager", **options})
    with allowing_best_plan():  # any other dpcs warning fails the test
        result = measure_training_step(w.model, compiled, w.inputs, loss_fn=w.loss_fn, warmup=3, repeats=1)
    assert result.graphs >= graphs
    return result.measured_peak_bytes, step_records(), compiled


def eager_gradients(w):
    w.model.zero_grad(set_to_none=True)
    w.loss_fn(w.model(*w.inputs)).backward()
    return {n: p.grad.clone() for n, p in w.model.named_parameters()}


def compiled_gradients(w, compiled):
    w.model.zero_grad(set_to_none=True)
    w.loss_fn(compiled(*w.inputs)).backward()
    return {n: p.grad.clone() for n, p in w.model.named_parameters()}


@pytest.fixture(scope="module")
def step_range():
    """(lowest step peak dpcs reaches, measured peak without a budget) of the workload, and its gradients."""
    torch.manual_seed(0)
    w = breaks_workload()
    unplanned, _, _ = run(w)
    _, records, _ = run(w, memory_budget=1, on_infeasible="best")
    lowest = records[-1].predicted_peak_bytes
    return w, lowest, unplanned, eager_gradients(w)


def test_graph_breaks_hold_the_step_budget_where_per_graph_plans_do_not(step_range):
    w, lowest, unplanned, expected = step_range
    floor = math.ceil(lowest / (1 - WORKSPACE_FRACTION)) + 1
    assert floor < unplanned
    budgets = [int(floor + f * (unplanned - floor)) for f in (0.05, 0.5, 0.9)]
    exceeded = []
    for budget in budgets:
        per_graph, _, _ = run(w, memory_budget=budget, budget_scope="graph")
        measured, records, compiled = run(w, memory_budget=budget)
        (record,) = records
        print(f"budget {budget} B: step plan measured {measured} B (predicted {record.predicted_peak_bytes} B), "
              f"per-graph plans measured {per_graph} B")
        assert record.feasible and len(record.calls) == 3
        assert measured <= budget
        # The step's prediction is an upper bound within 5% of the measured peak.
        assert measured <= record.predicted_peak_bytes <= 1.05 * measured
        torch.testing.assert_close(compiled_gradients(w, compiled), expected)
        exceeded.append(per_graph > budget)
    assert any(exceeded), "each graph planned alone fits all three budgets: the test shows nothing"


def test_the_first_step_holds_the_budget_before_the_steps_order_is_known(step_range):
    """The first step runs before dpcs knows the step's graphs: each graph that ends at a graph break holds as
    little as it can (more graphs follow while it holds what it saved), and each graph compiled in the middle
    of the step counts what the earlier ones hold. Before, the first graph was planned alone against the
    whole budget and the first step went over it (21.8 MB at an 18.5 MB budget); once the order is known,
    the graphs are planned again for the step."""
    w, lowest, unplanned, _ = step_range
    budget = int(math.ceil(lowest / (1 - WORKSPACE_FRACTION)) + 1 + 0.05 * (unplanned - lowest))
    # The first step measured compiles the graphs too. The gradients of the tests before are dropped before it,
    # not inside it: freed inside, they came off its peak, which the baseline (parameters and inputs) does not
    # count, and hid the first step's 7% over this budget in all but one order of tests.
    peaks, _ = measured_steps(w.model, lambda compiled: w.loss_fn(compiled(*w.inputs)).backward(),
                              resident_bytes([*w.model.parameters(), *w.inputs]), 4, memory_budget=budget)
    training = [r for r in compile_records() if r.mode == "training"]
    first, later = training[:3], training[3:]
    print(f"budget {budget} B: steps measured {peaks}")
    assert [bool(r.step_context and r.step_context["hold_least"]) for r in first] == [True, True, False]
    assert first[0].recomputed_values > 0
    assert max(peaks) <= budget
    assert later and not any(r.step_context["hold_least"] for r in later)  # planned again for the known step


def test_the_step_record_names_the_peak_and_each_graphs_context(step_range):
    w, lowest, unplanned, _ = step_range
    budget = (lowest + unplanned) // 2
    _, (record,), _ = run(w, memory_budget=budget)
    training = [r.graph for r in compile_records() if r.mode == "training"]
    assert record.calls == training[:3] and record.peak_graph in record.calls and record.peak_node
    assert record.peak_phase in ("forward", "backward") and record.budget_bytes == budget
    # The variants compiled for the step carry their contexts: the last graph runs while the first two hold theirs.
    replanned = [r for r in compile_records() if r.mode == "training"][3:]
    assert [r.step_context for r in replanned] == [record.contexts[g] for g in record.calls]
    assert replanned[-1].step_context["forward_bytes"] > replanned[0].step_context["forward_bytes"]


def test_no_step_plan_fits_names_the_smallest_step_peak_and_the_graph_that_holds_most(step_range):
    w, lowest, _, _ = step_range
    torch._dynamo.reset()
    clear_compile_records()
    budget = int(lowest * 0.97)
    # Each graph alone fits this budget; the step does not.
    compiled = dpcs_compile(w.model, memory_budget=budget)
    with allowing_best_plan():  # any other dpcs warning fails the test
        w.loss_fn(compiled(*w.inputs)).backward()
    with pytest.raises(BudgetInfeasibleError, match=r"training step of 3 graph calls.*smallest step peak.*holds the most"):
        compiled(*w.inputs)


def test_a_dynamic_shape_step_no_plan_fits_is_refused_at_its_sizes(step_range):
    """The same step compiled with dynamic shapes: the refusal names the sizes its step was planned for, as a
    graph's own refusal does (issue 58, item 4)."""
    w, _, _, _ = step_range
    (x,) = w.inputs

    def compiled_at(budget, **options):
        torch._dynamo.reset()
        clear_compile_records()
        return torch.compile(w.model, backend="dpcs", dynamic=True,
                             options={"compiler": "eager", "memory_budget": budget, **options})

    best = compiled_at(1, on_infeasible="best")
    with allowing_best_plan():
        for _ in range(3):
            w.loss_fn(best(x)).backward()
    lowest = step_records()[-1].predicted_peak_bytes
    compiled = compiled_at(int(lowest * 0.97))
    with pytest.raises(BudgetInfeasibleError, match=r"training step of 3 graph calls \(.*\) at sizes \w+=1024"):
        for _ in range(4):
            w.loss_fn(compiled(x)).backward()


def test_both_sides_of_a_data_dependent_branch_hold_the_budget(step_range):
    w, lowest, unplanned, _ = step_range
    budget = int(lowest + 0.3 * (unplanned - lowest))
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(w.model, memory_budget=budget)
    (x,) = w.inputs
    sides = [x + 10, x - 10]  # the first stack's output sums to > 0, then < 0: both sides of the branch
    with torch.no_grad():
        assert [bool(w.model.first(s).sum() > 0) for s in sides] == [True, False]
    baseline = resident_bytes([*w.model.parameters(), x])

    def step(inp):
        w.model.zero_grad(set_to_none=True)
        w.loss_fn(compiled(inp)).backward()

    with allowing_best_plan():  # any other dpcs warning fails the test
        for _ in range(3):
            for inp in sides:
                step(inp)
        peaks = []
        for inp in sides:
            w.model.zero_grad(set_to_none=True)
            _, peak = measure_peak_memory(step, inp)
            peaks.append(peak.absolute(baseline))
    records = step_records()
    assert records[-1].shapes == 2, "both branches' steps were planned together"
    assert all(r.feasible for r in records)
    assert max(peaks) <= budget, (peaks, budget)


DYNAMIC_LENGTHS = (64, 128, 256)


def _dynamic_batch(length):
    idx = torch.randint(0, 512, (8, length), generator=torch.Generator().manual_seed(length))
    return idx, torch.roll(idx, -1, 1)


def _dynamic_peaks(**options):
    """MiniGPT compiled at length 64 with dynamic shapes, two steps at each of 64, 128 and 256, then one step at
    each measured: ({length: measured peak}, the model, the compiled model)."""
    from dpcs_compiler.models import GPTConfig, MiniGPT

    torch._dynamo.reset()
    clear_compile_records()
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(block_size=256, layers=2))
    compiled = torch.compile(model, backend="dpcs", dynamic=True, options=options)

    def step(idx, targets):
        model.zero_grad(set_to_none=True)
        compiled(idx, targets).backward()

    for length in DYNAMIC_LENGTHS:
        for _ in range(2):
            step(*_dynamic_batch(length))
    peaks = {}
    for length in DYNAMIC_LENGTHS:
        idx, targets = _dynamic_batch(length)
        model.zero_grad(set_to_none=True)
        _, peak = measure_peak_memory(step, idx, targets)
        peaks[length] = peak.absolute(resident_bytes([*model.parameters(), idx, targets]))
    return peaks, model, compiled


def _assert_gradients_equal_eager(model, compiled, *inputs):
    """A step of `compiled` (a model returning its loss) on `inputs` leaves eager's gradients."""
    model.zero_grad(set_to_none=True)
    compiled(*inputs).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(*inputs).backward()
    torch.testing.assert_close(got, {n: p.grad for n, p in model.named_parameters()}, atol=1e-5, rtol=1e-4)


def test_dynamic_sequence_lengths_each_hold_the_budget():
    """Compiled at length 64 with dynamic shapes, trained at 64, 128 and 256: each length runs a plan made
    for its size bucket (the plan traced at 64 keeps everything, 50.8 MB at 256, over this budget)."""
    budget = 35_000_000
    peaks, model, compiled = _dynamic_peaks(compiler="eager", strict=True, memory_budget=budget)
    print(f"budget {budget} B: measured {peaks}")
    assert all(p <= budget for p in peaks.values()), peaks
    training = [r for r in compile_records() if r.mode == "training"]
    assert all(r.symbolic_shapes for r in training)
    assert len(training) == 3  # one variant per size bucket (64 as traced, 128, 256)
    # At 64 nothing presses: torch's own partition; at 256 dpcs recomputes.
    assert training[0].solver == TORCH_SOLVER and training[-1].solver != TORCH_SOLVER
    assert training[-1].recomputed_values > 0
    _assert_gradients_equal_eager(model, compiled, *_dynamic_batch(256))


@pytest.mark.slow
@pytest.mark.inductor
def test_dynamic_sequence_lengths_hold_a_budget_under_inductor():
    """Issue 58, case 1: the same under Inductor with dpcs's default options, at 0.8x the step's peak at 256
    without a budget (measured 9% over before: Inductor's kernels for the 256 bucket held more than planned)."""
    with allowing_best_plan():  # any other dpcs warning fails the test
        unplanned, _, _ = _dynamic_peaks(compiler="inductor")
        budget = int(0.8 * unplanned[256])
        peaks, model, compiled = _dynamic_peaks(compiler="inductor", memory_budget=budget)
    training = [r for r in compile_records() if r.mode == "training"]
    assert len(training) == 3  # one variant per size bucket, in the order the lengths ran
    predicted = {n: r.predicted_peak_bytes for n, r in zip(DYNAMIC_LENGTHS, training)}
    print(f"without a budget {unplanned}; budget {budget} B: measured {peaks}, predicted {predicted}")
    assert all(p <= budget for p in peaks.values()), peaks
    # Issue 58, item 2: each length's prediction within 2% of its measured step (measured at 64 tokens 2.0%
    # under before the wrapper's buffer reuses were counted: `inductor_schedule.with_reuses`).
    for n in DYNAMIC_LENGTHS:
        assert abs(predicted[n] - peaks[n]) <= 0.02 * peaks[n], (n, predicted[n], peaks[n])
    assert any(r.recomputed_values for r in compile_records() if r.mode == "training" and r.compiler == "inductor")
    _assert_gradients_equal_eager(model, compiled, *_dynamic_batch(256))


@pytest.mark.inductor
def test_graph_breaks_hold_the_step_budget_under_inductor(step_range):
    w, lowest, unplanned, expected = step_range
    budget = (lowest + unplanned) // 2
    measured, (record,), compiled = run(w, compiler="inductor", memory_budget=budget)
    print(f"inductor, budget {budget} B: measured {measured} B, predicted {record.predicted_peak_bytes} B")
    assert record.feasible and measured <= budget
    torch.testing.assert_close(compiled_gradients(w, compiled), expected, atol=1e-5, rtol=1e-4)
    # The first plans of the graphs that end at a graph break (they hold least until the step is known) ran
    # uncompiled; Inductor compiled each Dynamo graph once per plan that stays, not for the first plans too.
    training = [r for r in compile_records() if r.mode == "training"]
    first = {r.graph: r for r in training if r.variant_of is None}
    held_least = [r for r in first.values() if r.step_context and r.step_context.get("hold_least")]
    assert held_least and all(r.compiler == "eager" for r in held_least)
    inductor = [r for r in training if r.compiler == "inductor"]
    assert inductor and all((r.variant_of or r.graph) in first for r in inductor)
    assert not any(r.compiler == "inductor" and r.step_context and r.step_context.get("hold_least") for r in training)
    # The step was planned with each stand-in as Inductor compiles it: its step view is the problem of the
    # Inductor variant compiled for the step (Inductor's joint-graph passes and fusions), not its own.
    for graph in held_least:
        stand_in = job_of(graph.graph)
        compiled_job = job_of([r for r in inductor if r.variant_of == graph.graph][-1].graph)
        view, compiled_problem = stand_in.step_view, compiled_job.problem
        assert view is not None and view.node_names == compiled_job.schedule_node_names
        assert view.problem.candidates == compiled_problem.candidates
        np.testing.assert_array_equal(view.problem.base_bytes, compiled_problem.base_bytes)
        assert view.sharing == compiled_job.sharing


@pytest.mark.inductor
def test_every_step_from_the_first_holds_a_budget_only_inductors_kernels_reach(step_range):
    """Under Inductor, a first plan that holds least runs uncompiled (a stand-in) until the step is known. At a
    budget below the lowest step peak the eager compiler reaches, no stand-in plan of the first graph holds
    it (its backward runs last, after the later graphs' gradients are made); the graph is compiled by
    Inductor at once instead, where Inductor's graph has a plan within it. The first step measured 1.20x its
    budget (15.49 MB for 12.95 MB) when the stand-in ran."""
    w, lowest, _, expected = step_range  # `lowest`: the eager compiler's
    budget = int(0.93 * lowest)
    peaks, compiled = measured_steps(w.model, lambda compiled: w.loss_fn(compiled(*w.inputs)).backward(),
                                     resident_bytes([*w.model.parameters(), *w.inputs]), 4, compiler="inductor",
                                     memory_budget=budget)
    print(f"inductor, budget {budget} B: steps measured {peaks}")
    assert max(peaks) <= budget
    training = [r for r in compile_records() if r.mode == "training"]
    over = [i for i, r in enumerate(training) if r.compiler == "eager" and r.plan_feasible is False]
    assert over, "every stand-in held the budget: the test shows nothing"
    for i in over:  # compiled by Inductor right after, in the same step context
        assert i + 1 < len(training), "a stand-in over its target was not compiled by Inductor"
        after = training[i + 1]
        assert after.compiler == "inductor" and after.step_context["hold_least"] and after.plan_feasible
    torch.testing.assert_close(compiled_gradients(w, compiled), expected, atol=1e-5, rtol=1e-4)
    # Where Inductor's graph cannot hold the target either, the stand-in stays: a compile more buys nothing.
    measured_steps(w.model, lambda compiled: w.loss_fn(compiled(*w.inputs)).backward(), 0, 1, compiler="inductor",
                   memory_budget=lowest // 2, on_infeasible="best")
    first = [r for r in compile_records() if r.mode == "training"][:3]
    assert [(r.compiler, r.plan_feasible) for r in first[:2]] == [("eager", False)] * 2


@pytest.mark.inductor
def test_a_step_is_planned_again_knowing_a_plan_its_compile_read_over_its_budget(step_range):
    """Issue 58, item 2: at 0.7x the step's own peak under Inductor, the step plan gives the middle graph a plan
    whose backward Inductor schedules 1.5 MiB over the model. Its compile reads that and plans again, counting
    the 1.5 MiB for every plan: it recomputes more than the step needs, and the step measured 0.892 of its
    budget. The step is then planned again knowing what that plan held (`StepContext.known_excess`): the plans
    compiled for it hold the budget within 2% (measured 0.992)."""
    w, _, _, expected = step_range
    unplanned, _, _ = run(w, compiler="inductor")
    budget = int(0.7 * unplanned)
    measured, records, compiled = run(w, compiler="inductor", memory_budget=budget)
    print(f"inductor, budget {budget} B: measured {measured} B ({measured / budget:.3f}), "
          f"predicted {records[-1].predicted_peak_bytes} B")
    assert records[-1].feasible and 0.98 * budget <= measured <= budget
    assert measured == pytest.approx(records[-1].predicted_peak_bytes, rel=0.02)
    assert records[-1].compiled_peak_bytes == pytest.approx(measured, rel=0.02)  # checked before the watch stopped
    training = [r for r in compile_records() if r.mode == "training" and r.compiler == "inductor"]
    read_over = [r for r in training if r.replans]
    assert read_over, "no compile read its plan over: the case this test is about did not arise"
    last = step_variants(training)
    assert any(r.step_context and r.step_context.get("known_excess") for r in last)
    assert not any(r.replans for r in last)  # known beforehand: no plan of the step compiled to be refused
    torch.testing.assert_close(compiled_gradients(w, compiled), expected, atol=1e-5, rtol=1e-4)


def step_variants(records):
    """The training compile records of the step's plan: each graph's last variant, in call order."""
    training = [r for r in records if r.mode == "training"]
    last = {}
    for r in training:
        last[r.variant_of or r.graph] = r
    return list(last.values())


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_budget_at_the_steps_own_peak_keeps_torchs_partitions(step_range, compiler):
    """No cost at no pressure in a step of several graphs: at the peak the step measures with torch's own
    partitions (dpcs without a budget), every graph keeps its own partition, nothing is recomputed, the step
    holds the budget and the gradients are eager's. Before, a step of several graphs never kept torch's
    partitions, and at this budget recomputed one value per graph (issue 18: 1.04-1.10x the step time).
    Under Inductor the step's plans saving everything model 4-5% over the budget: each graph's compile
    reads Inductor's schedule of torch's partition in its context, and that decides."""
    w, _, _, expected = step_range
    unplanned, _, _ = run(w, compiler=compiler)  # no budget: torch's own partitions (min-cut), nothing planned
    measured, records, compiled = run(w, compiler=compiler, memory_budget=unplanned)
    print(f"{compiler}, budget {unplanned} B (the step's own peak): measured {measured} B, "
          f"predicted {records[-1].predicted_peak_bytes} B, compiled {records[-1].compiled_peak_bytes} B")
    assert records[-1].torch_plans and records[-1].feasible
    planned = step_variants(compile_records())
    assert len(planned) == 3 and all(r.compiler == compiler for r in planned)
    kept = [r.solver == TORCH_SOLVER for r in planned]
    if compiler == "eager":  # the FX order runs: the model of torch's partitions is what runs, all three fit
        assert all(kept) and not any(r.recomputed_values for r in planned), planned
    else:  # Inductor's schedule of each in its context decides; one it refuses is planned by dpcs there
        assert any(kept) and all(k or r.replans >= 1 for k, r in zip(kept, planned)), planned
    assert measured <= unplanned
    # Kept: one plan of the step, not planned again after a measured step or the compiled variants' prediction.
    assert len(step_records()) == 1, step_records()
    torch.testing.assert_close(compiled_gradients(w, compiled), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.inductor
def test_a_budget_at_the_steps_own_peak_keeps_torchs_partitions_that_recompute():
    """No cost at no pressure where torch's min-cut recomputes: HF GPT-2 is two graphs (its body; its loss,
    after a graph break). Its plans saving everything model the step far over its own peak, so no offer was
    made and dpcs recomputed at that budget (issue 18: 1.01x compile's step on the bench's GPT-2). Each graph's
    own partition, made from its step view, is offered now: both graphs compile torch's min-cut, once each,
    the step holds the budget (what it holds beyond the model is counted, not planned again) and the
    gradients are eager's."""
    from dpcs_compiler.cost.memory_model import RECOMPUTE
    from dpcs_compiler.cost.step_model import GraphLevels
    from dpcs_compiler.models import HFGPT2LM, Workload

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    w = Workload("hf_gpt2_small", HFGPT2LM(2, 128, 2, 1024, 64), (torch.randint(0, 1024, (4, 64)),), lambda y: y)
    expected = eager_gradients(w)
    unplanned, _, _ = run(w, compiler="inductor", graphs=2)
    measured, records, compiled = run(w, compiler="inductor", graphs=2, memory_budget=unplanned)
    print(f"budget {unplanned} B (the step's own peak): measured {measured} B, predicted "
          f"{records[-1].predicted_peak_bytes} B, compiled {records[-1].compiled_peak_bytes} B")
    assert records and all(r.torch_plans and r.feasible for r in records), records
    stand_ins = [r for r in compile_records() if r.mode == "training" and r.compiler == "eager"]
    assert len(stand_ins) == 2
    for r in stand_ins:  # torch's own partition recomputes: it keeps less than saving everything
        # Made while the step was planned: plans saving everything did not fit, so the offer is its own.
        assert "plan/step_view_torch_partition" in r.pass_seconds, r.pass_seconds
        view = job_of(r.graph).step_view
        own = view.torch_partition()
        assert RECOMPUTE in own.decisions
        assert own.levels.boundary < GraphLevels.of(view.problem, view.problem.all_saved()).boundary
    variants = [r for r in compile_records() if r.variant_of is not None]
    assert sorted(r.variant_of for r in variants) == sorted(r.graph for r in stand_ins), variants  # once each
    assert all(r.solver == TORCH_SOLVER and r.compiler == "inductor" for r in variants), variants
    assert measured <= unplanned
    torch.testing.assert_close(compiled_gradients(w, compiled), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.inductor
def test_an_input_only_a_first_plans_recomputation_kept_alive_is_not_counted_for_torchs_partitions():
    """The bench's graph-break net takes `middle(-h)`: the middle graph's first plan recomputes `neg` from its
    input `h`, so `h` stayed alive through the later backwards, and the step counted it as memory the other
    calls leave alive, for every later plan: torch's partitions, which save `neg` and free `h`, modelled 2 MiB
    over their own peak and were never offered (1.05-1.09x compile's step at that peak, issue 18). Counted as
    the middle graph's, with the plans that recompute from it, the step at its own peak keeps torch's
    partitions: planned once, each graph compiled once, within the budget."""
    from dpcs_compiler.models import bench_workload

    torch.manual_seed(0)
    w = bench_workload("breaks")
    unplanned, _, _ = run(w, compiler="inductor")
    measured, records, compiled = run(w, compiler="inductor", memory_budget=unplanned)
    print(f"budget {unplanned} B (the step's own peak): measured {measured} B, predicted "
          f"{records[-1].predicted_peak_bytes} B, compiled {records[-1].compiled_peak_bytes} B")
    assert len(records) == 1 and records[0].torch_plans and records[0].feasible, records
    variants = [r for r in compile_records() if r.variant_of is not None]
    assert len({r.variant_of for r in variants}) == len(variants) == len(records[0].calls) == 3, variants  # once each
    assert all(r.solver == TORCH_SOLVER for r in variants), variants
    assert measured <= unplanned


class _DropoutHalves(torch.nn.Module):
    """Two MLPs with dropout, a graph break between them: Inductor's joint-graph passes rewrite the random
    ops (with the graph's fake mode), which a stand-in's step view must run as Inductor does."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.halves = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(4 * d, d)) for _ in range(2))

    def forward(self, x):
        h = self.halves[0](x)
        torch._dynamo.graph_break()
        return self.halves[1](h)


@pytest.mark.inductor
def test_a_stand_in_with_random_ops_is_planned_as_inductor_runs_it():
    torch.manual_seed(0)
    model, x = _DropoutHalves(), torch.randn(256, 64)
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(model, compiler="inductor", memory_budget=10**9)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()
    training = [r for r in compile_records() if r.mode == "training"]
    stand_ins = [r for r in training if r.compiler == "eager"]  # the graph that ends at the break
    assert len(stand_ins) == 1
    for record in stand_ins:
        view = job_of(record.graph).step_view
        compiled_job = job_of([r for r in training if r.variant_of == record.graph][-1].graph)
        assert view is not None and view.node_names == compiled_job.schedule_node_names
        assert view.problem.candidates == compiled_job.problem.candidates


@pytest.mark.inductor
def test_a_stand_in_whose_view_cannot_be_built_says_so_and_its_step_holds_the_budget(monkeypatch):
    """Not strict: if the graph as Inductor will run it cannot be built, a warning names the graph and the step
    is planned with the stand-in's own (eager) graph, which holds more: the budget still holds."""
    import dpcs_compiler.stages.memory_plan as memory_plan

    def refuse(joint, compiler, device, fake_mode=None):
        raise RuntimeError("no joint passes here")

    monkeypatch.setattr(memory_plan, "_as_compiler_traces", refuse)
    torch.manual_seed(0)
    model, x = _DropoutHalves(), torch.randn(256, 64)
    torch._dynamo.reset()
    clear_compile_records()
    budget = 1_900_000  # below the step's unplanned peak (1,968,648 B here), above its lowest (1,839,360 B)
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "inductor", "memory_budget": budget})

    def step():
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            step()
    messages = [str(w.message) for w in caught]
    assert any("could not build" in m and "as inductor will run it (RuntimeError: no joint passes here)" in m
               for m in messages), messages
    stand_ins = [r for r in compile_records() if r.mode == "training" and r.compiler == "eager"]
    assert stand_ins and all(job_of(r.graph).step_view is None for r in stand_ins)
    model.zero_grad(set_to_none=True)
    resident = resident_bytes([*model.parameters(), x])
    _, peak = measure_peak_memory(step)
    print(f"budget {budget} B: measured {resident + peak.peak_increase_bytes} B with the eager graphs planned")
    assert resident + peak.peak_increase_bytes <= budget


class Backbone(torch.nn.Module):
    """Residual MLP blocks: the part of a contrastive model that is compiled."""

    def __init__(self, d: int = 128, hidden: int = 512, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d)) for _ in range(blocks)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def contrastive_loss(z: torch.Tensor) -> torch.Tensor:
    """A loss in eager code, as users write it after a compiled model: every row against every other (N x N
    logits, their log-softmax and gradient), no parameters."""
    return torch.nn.functional.cross_entropy(z @ z.T, torch.arange(z.shape[0]))


@pytest.mark.parametrize("fraction", [0.1, pytest.param(0.5, marks=pytest.mark.slow)])
def test_a_loss_in_eager_code_is_measured_and_counted_at_the_steps_turn(fraction):
    """The graph's own plan fits the budget but the step does not: the eager loss allocates 48 MB between the
    forward and the backward, which no graph shows. The recorder measures a step (the profiler on CPU),
    counts what eager code holds at the step's turn, and re-plans: the step then holds the budget."""
    torch.manual_seed(0)
    model, x = Backbone(), torch.randn(2048, 128)
    resident = resident_bytes([*model.parameters(), x])

    def measured(**options):
        torch._dynamo.reset()
        clear_compile_records()
        compiled = dpcs_compile(model, **options)

        def step():
            model.zero_grad(set_to_none=True)
            contrastive_loss(compiled(x)).backward()

        with allowing_best_plan():  # any other dpcs warning fails the test
            for _ in range(5):
                step()
            model.zero_grad(set_to_none=True)
            _, peak = measure_peak_memory(step)
        return peak.absolute(resident), compiled

    unplanned, _ = measured()
    _, _ = measured(memory_budget=1, on_infeasible="best")
    lowest = step_records()[-1].predicted_peak_bytes
    assert step_records()[-1].peak_phase == "turn"  # the eager loss is what limits the step
    budget = int(lowest / (1 - WORKSPACE_FRACTION) + fraction * (unplanned - lowest))
    (own,) = [r for r in compile_records() if r.mode == "training"][:1]
    assert own.predicted_peak_bytes < budget < unplanned  # the graph alone fits; the step without dpcs does not

    alone, _ = measured(memory_budget=budget, budget_scope="graph")  # no step planning: nothing measured
    step_peak, compiled = measured(memory_budget=budget)
    record = step_records()[-1]
    print(f"budget {budget} B: measured {step_peak} B, predicted {record.predicted_peak_bytes} B "
          f"({record.turn_bytes} B counted at the turn); graph planned alone {alone} B, no budget {unplanned} B")
    assert alone > budget
    assert step_peak <= budget
    assert record.feasible and record.replanned and record.turn_bytes > 30_000_000
    assert record.solves > 0 and record.planning_seconds > 0  # the planner's own work is on the record
    assert step_peak <= record.predicted_peak_bytes <= 1.01 * step_peak
    model.zero_grad(set_to_none=True)
    contrastive_loss(compiled(x)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    contrastive_loss(model(x)).backward()
    torch.testing.assert_close(got, {n: p.grad for n, p in model.named_parameters()}, atol=1e-5, rtol=1e-4)


class LossAfterBreak(torch.nn.Module):
    """A model whose loss runs after a graph break, as Hugging Face's causal LMs compute theirs: the logits pass
    from one graph to the next, and the step drops them before the backward (the loss's log-softmax keeps its
    own output, not its input)."""

    def __init__(self, d: int = 128, vocab: int = 2048, blocks: int = 3) -> None:
        super().__init__()
        self.body = Backbone(d, 4 * d, blocks)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x, y):
        logits = self.head(self.body(x))
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits, y)


def test_logits_freed_between_two_graphs_are_not_counted_in_their_backwards():
    """Each graph's own problem counts its inputs and outputs alive to its step's end: the body's logits output
    and the loss graph's logits input. The recorder sees (by weak references to their storages) that the step
    freed them before each backward, and the step plan counts them freed there: it keeps the loss's log-softmax
    saved (recomputing it would keep the logits alive) and predicts the measured peak within 1%. Before, the
    prediction was one logits buffer (4 MiB) over in each backward and the plan recomputed to make room."""
    torch.manual_seed(0)
    model = LossAfterBreak()
    x, y = torch.randn(512, 128), torch.randint(0, 2048, (512,))
    logits_bytes = 512 * 2048 * 4

    def run_at(**options):
        torch._dynamo.reset()
        clear_compile_records()
        compiled = dpcs_compile(model, **options)
        with allowing_best_plan():  # any other dpcs warning fails the test
            result = measure_training_step(model, compiled, (x, y), warmup=4, repeats=1)
        return result.measured_peak_bytes, compiled

    unplanned, _ = run_at()
    lowest, _ = run_at(memory_budget=1, on_infeasible="best")
    for fraction in (0.3, 0.8):
        budget = int(lowest + fraction * (unplanned - lowest))
        measured, compiled = run_at(memory_budget=budget)
        record = step_records()[-1]
        print(f"budget {budget} B: measured {measured} B, predicted {record.predicted_peak_bytes} B")
        assert record.feasible and measured <= budget
        assert measured <= record.predicted_peak_bytes <= 1.01 * measured
        body, loss = (record.contexts[g] for g in record.calls)
        assert body["backward_freed"] >= logits_bytes and loss["backward_freed"] >= logits_bytes
        assert loss["keep_saved"]  # the log-softmax output, whose recomputation reads the logits
    _assert_gradients_equal_eager(model, compiled, x, y)


def measured_steps(model, step, baseline, n, **options):
    """`n` steps `step(compiled)` of a fresh dpcs compile of `model` with `options`, and each one's measured peak
    (the last step's gradients freed before, not inside, the step measured)."""
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(model, **options)

    def measured():
        model.zero_grad(set_to_none=True)
        return measure_peak_memory(lambda: step(compiled))[1].absolute(baseline)

    with allowing_best_plan():  # any other dpcs warning fails the test
        return [measured() for _ in range(n)], compiled


def unplanned_and_lowest(model, step, baseline):
    """The unbudgeted step's measured peak, and the lowest peak a plan of its graph is predicted to reach."""
    (unplanned,), _ = measured_steps(model, step, baseline, 1)
    measured_steps(model, step, baseline, 1, memory_budget=1, on_infeasible="best")
    return unplanned, min(r.predicted_peak_bytes for r in compile_records() if r.mode == "training")


def assert_gradients_match_eager(model, compiled, *inputs):
    model.zero_grad(set_to_none=True)
    compiled(*inputs)[0].backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(*inputs)[0].backward()
    torch.testing.assert_close(got, {n: p.grad for n, p in model.named_parameters()}, atol=1e-5, rtol=1e-4)


class LossAndLogits(LossAfterBreak):
    """One graph that returns its loss and its logits, as a Hugging Face causal LM called with labels does
    (`model(**batch).loss.backward()` keeps the loss only)."""

    def forward(self, x, y):
        logits = self.head(self.body(x))
        return torch.nn.functional.cross_entropy(logits, y), logits


def loss_and_logits(keep_logits):
    """`LossAndLogits` (seeded), its inputs, its logits' bytes, the resident baseline, and a step that drops the
    logits before the backward unless `keep_logits`."""
    torch.manual_seed(0)
    model = LossAndLogits()
    x, y = torch.randn(512, 128), torch.randint(0, 2048, (512,))
    baseline = resident_bytes([*model.parameters(), x, y])

    def step(compiled):
        loss, logits = compiled(x, y)
        if not keep_logits:
            del logits
        loss.backward()

    return model, x, y, 512 * 2048 * 4, baseline, step


@pytest.mark.parametrize("keep_logits", [False, True])
def test_logits_a_single_graph_returns_and_the_loop_drops_are_not_counted_in_its_backward(keep_logits):
    """The graph's own plan counts its logits output alive through its backward (its caller may keep it), so
    at a budget it fits a plan that recomputes more than the step needs. A step of that one graph that frees
    the logits before its backward is planned again with them freed: it recomputes less, measures within the
    budget and within 1% of its prediction, and its gradients are eager's. A loop that keeps the logits
    through the backward keeps the graph's own plan."""
    model, x, y, logits_bytes, baseline, step = loss_and_logits(keep_logits)

    unplanned, lowest = unplanned_and_lowest(model, step, baseline)
    budget = int(lowest + 0.5 * (unplanned - lowest))
    peaks, compiled = measured_steps(model, step, baseline, 6, memory_budget=budget)
    training = [r for r in compile_records() if r.mode == "training"]
    own, last = training[0], training[-1]
    print(f"budget {budget} B (lowest {lowest}, unplanned {unplanned}): peaks {peaks}; own plan {own.recomputed_values} recomputed, predicted "
          f"{own.predicted_peak_bytes} B; last {last.graph} {last.recomputed_values} recomputed")
    assert max(peaks[1:]) <= budget
    if keep_logits:
        assert step_records() == [] and len(training) == 1
        assert peaks[-1] <= own.predicted_peak_bytes <= 1.01 * peaks[-1]
    else:
        (record,) = step_records()
        assert record.feasible and record.replanned and record.calls == [own.graph]
        assert record.contexts[own.graph]["backward_freed"] >= logits_bytes
        assert last.variant_of == own.graph and last.recomputed_values < own.recomputed_values
        assert peaks[-1] <= record.predicted_peak_bytes <= 1.01 * peaks[-1]
        # The first step ran the graph's own plan: its model counted the logits alive through the backward.
        assert own.predicted_peak_bytes - peaks[0] >= logits_bytes // 2
    assert_gradients_match_eager(model, compiled, x, y)


@pytest.mark.parametrize("keep_logits", [False, True])
def test_the_lowest_plan_of_a_graph_whose_remakes_would_read_its_logits_is_predicted_as_it_runs(keep_logits):
    """At the lowest budget a graph's own plan recomputed its loss's log-softmax from the logits it returns (an
    output counts alive to the step's end, so reading it looked free). The backward then held the logits, so
    the step recorder could not see the loop drop them, and they were counted alive through the whole
    backward: GPT-J, Mixtral and OLMo were predicted 5-10% over what they measured, OLMo infeasible at a budget
    it met. A graph planned alone now keeps what would read its outputs saved where a plan fits so, the step
    sees the drop and is predicted within 1%; a loop that keeps the logits gets a plan that reads them."""
    model, x, y, logits_bytes, baseline, step = loss_and_logits(keep_logits)

    peaks, compiled = measured_steps(model, step, baseline, 5, memory_budget=1, on_infeasible="best")
    own = [r for r in compile_records() if r.mode == "training"][0]
    predicted = step_records()[-1].predicted_peak_bytes if step_records() else own.predicted_peak_bytes
    print(f"peaks {peaks}, own plan predicted {own.predicted_peak_bytes} B, step predicted {predicted} B")
    assert peaks[-1] <= predicted <= 1.01 * peaks[-1]
    if not keep_logits:  # the drop is seen: the step's lowest is the graph's own lowest less the logits
        assert own.predicted_peak_bytes - predicted >= logits_bytes // 2
    assert_gradients_match_eager(model, compiled, x, y)


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


class _HookedBlocks(torch.nn.Module):
    """Blocks in a loop, the first two with a forward hook that breaks the graph: Dynamo compiles the hooked
    blocks' frames whole (their `compile_subgraph_reason` is no graph break) and runs the loop around them
    eagerly, as in Hugging Face models that break inside a layer."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(3))
        for block in self.blocks[:2]:
            block.register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_the_first_step_holds_the_budget_when_the_graph_breaks_in_a_nested_call():
    """The sweep of Hugging Face models found the first step 10-20% over the budget where the break sits in a
    layer: the graphs before it end normally, so they were planned alone against the whole budget. A graph
    called from code of the compiled callable that goes on after it (`runtime.variants.more_of_frame_follows`)
    now holds least in the first step, as one ending at a graph break does."""
    torch.manual_seed(0)
    model = _HookedBlocks()
    x = torch.randn(1024, 128, generator=torch.Generator().manual_seed(1))
    baseline = resident_bytes([*model.parameters(), x])

    def steps(n, **options):
        return measured_steps(model, lambda compiled: compiled(x).backward(), baseline, n, **options)[0]

    unplanned = steps(2)[-1]
    steps(2, memory_budget=1, on_infeasible="best")
    lowest = step_records()[-1].predicted_peak_bytes
    budget = int(lowest + 0.1 * (unplanned - lowest))
    peaks = steps(3, memory_budget=budget)
    first = [r for r in compile_records() if r.mode == "training"][:3]
    print(f"budget {budget} B (lowest {lowest}, unplanned {unplanned}): steps measured {peaks}")
    assert [bool(r.step_context and r.step_context["hold_least"]) for r in first] == [True, True, False]
    assert max(peaks) <= budget


def test_graphs_in_nested_calls_of_a_compiled_function_hold_least_in_the_first_step():
    """As above with torch.compile of a plain function: the function's own frame, which goes on after each
    block, counts (a compiled module's top frame is torch's `_wrapped_call_impl`; a function's is its own)."""
    torch.manual_seed(0)
    model = _HookedBlocks(32)

    def blocks_then_loss(x):
        for block in model.blocks:
            x = block(x)
        return x.square().mean()

    compiled = torch.compile(blocks_then_loss, backend="dpcs",
                             options={"compiler": "eager", "strict": True, "memory_budget": 1, "on_infeasible": "best"})
    with allowing_best_plan():  # any other dpcs warning fails the test
        compiled(torch.randn(64, 32)).backward()
    training = [r for r in compile_records() if r.mode == "training"]
    assert training and all(r.step_context and r.step_context["hold_least"] for r in training), \
        [(r.graph, r.step_context) for r in training]


class _EagerEmbedding(torch.nn.Module):
    """An embedding only eager code reads (as a graph break in a layer leaves a Hugging Face model's), then
    graphs: no graph takes the embedding's 2 MB weight."""

    def __init__(self, vocab: int = 8000, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(2))
        self.head = torch.nn.Linear(width, 512)

    @torch.compiler.disable
    def embed_eagerly(self, ids):
        return self.embed(ids)

    def forward(self, ids, labels):
        x = self.embed_eagerly(ids)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_parameters_only_eager_code_reads_count_for_the_step():
    """The step counted the parameters its graphs take: an embedding read by eager code alone was left out,
    and the step went over its budget by about its bytes (1.15 MB over, 2.05 MB above the prediction). The
    compiled module's other parameters now count as memory alive through the step
    (`step.holdings._count_unseen_parameters`)."""
    torch.manual_seed(0)
    model = _EagerEmbedding()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 8000, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g))

    def measured(**options):
        torch._dynamo.reset()
        clear_compile_records()
        compiled = dpcs_compile(model, **{"compiler": "eager", **options})
        with allowing_best_plan():  # any other dpcs warning fails the test
            return measure_training_step(model, compiled, inputs, warmup=4, repeats=1).measured_peak_bytes

    unplanned = measured()
    measured(memory_budget=1, on_infeasible="best")
    lowest = predicted_step_peak().predicted_peak_bytes
    budget = (unplanned + lowest) // 2
    peak = measured(memory_budget=budget)
    predicted = predicted_step_peak().predicted_peak_bytes
    print(f"budget {budget} B: measured {peak} B, predicted {predicted} B")
    assert peak <= budget
    assert abs(predicted - peak) <= 0.02 * peak
    assert step_records()[-1].outside_bytes >= model.embed.weight.numel() * 4


class CachingBlocks(torch.nn.Module):
    """Blocks that return what each computes on, as attention layers return their keys and values in a cache;
    the loop keeps the loss only (Hugging Face's Phi and BLOOM called with labels)."""

    def __init__(self, d: int = 128, blocks: int = 3) -> None:
        super().__init__()
        self.keys = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))
        self.mixes = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))

    def forward(self, x, y):
        caches = []
        for key, mix in zip(self.keys, self.mixes):
            k = torch.tanh(key(x))
            caches.append(k)
            x = x + mix(k * k)
        return torch.nn.functional.mse_loss(x, y), caches


def test_a_plan_that_remakes_from_a_returned_cache_is_predicted_as_it_runs():
    """Each block's k is returned and read on. A remake of what reads k reads the returned k (the model counts
    it alive to the step's end), so the backward holds it whether or not the loop drops the cache, and the
    step measures within 1% of its prediction at a budget that makes the plan recompute. Before, the remake re-ran
    k's matmul and tanh: the forward's k went unread by the backward and the loop's drop freed it, a peak lower
    than predicted by up to the caches' bytes, and the lowest plan was predicted over the unplanned step."""
    torch.manual_seed(0)
    model = CachingBlocks()
    x, y = torch.randn(2048, 128), torch.randn(2048, 128)
    baseline = resident_bytes([*model.parameters(), x, y])

    def step(compiled):
        compiled(x, y)[0].backward()  # the caches dropped

    unplanned, lowest = unplanned_and_lowest(model, step, baseline)
    # Remakes that read the caches are cheap in memory: the lowest plan is near two activations (1 MiB each) under the
    # unplanned step. Re-running k's matmul and tanh made the lowest plan's prediction higher than no plan's.
    assert lowest <= unplanned - 3 * (2048 * 128 * 4) // 2
    budget = int(lowest + 0.5 * (unplanned - lowest))
    peaks, compiled = measured_steps(model, step, baseline, 5, memory_budget=budget)
    training = [r for r in compile_records() if r.mode == "training"]
    last = training[-1]
    predicted = step_records()[-1].predicted_peak_bytes if step_records() else last.predicted_peak_bytes
    print(f"budget {budget} B (lowest {lowest}, unplanned {unplanned}): peaks {peaks}, predicted {predicted} B, "
          f"{last.recomputed_values} recomputed")
    assert last.recomputed_values > 0
    assert max(peaks[1:]) <= budget
    assert peaks[-1] <= predicted <= 1.01 * peaks[-1]
    assert_gradients_match_eager(model, compiled, x, y)


@pytest.mark.parametrize("keep_logits", [False, True])
def test_a_budget_only_a_step_that_drops_the_logits_meets_is_decided_by_the_step(keep_logits):
    """A graph planned alone counts the logits it returns alive through its backward, so at a budget between
    the step's lowest (the loop drops them) and the graph's own lowest, no plan of the graph fits. With the
    default on_infeasible="error" its compile raised (Cohere in the Hugging Face sweep, at 0.75x its unplanned
    peak) before the step was seen, and with "best" it warned that the budget cannot be met, then met it. The
    verdict now waits for the step: a loop that drops the logits fits the budget (no error, no warning); one
    that keeps them gets the error at its second step, where the step is planned."""
    model, x, y, logits_bytes, baseline, step = loss_and_logits(keep_logits)
    budget = 21_800_000  # the graph's own lowest is predicted 23.9 MB, the step's 19.7 MB (above)
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(model, memory_budget=budget)  # on_infeasible="error", the default

    def measured():
        model.zero_grad(set_to_none=True)
        return measure_peak_memory(lambda: step(compiled))[1].absolute(baseline)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = measured()  # compiles: the verdict waits for the step
        own = [r for r in compile_records() if r.mode == "training"][0]
        assert own.plan_feasible is False and own.predicted_peak_bytes > budget
        if keep_logits:
            with pytest.raises(BudgetInfeasibleError, match="cannot be met for graph_"):
                measured()
            return
        peaks = [measured() for _ in range(4)]
    assert not [w for w in caught if "cannot be met" in str(w.message)], [str(w.message) for w in caught]
    assert step_records() and step_records()[-1].feasible
    assert peaks[-1] <= budget, (first, peaks)
    assert_gradients_match_eager(model, compiled, x, y)


@pytest.mark.parametrize("steps", [1, 2])
def test_a_verdict_left_to_a_second_step_that_never_runs_is_warned_at_exit(steps, tmp_path):
    """The graph's own plan misses the budget unless the loop drops its logits, so its compile leaves the verdict
    to the step planner at the second step. A script that runs one step and exits never got it: it now gets a
    warning at exit, naming the budget. One that runs two gets the step's error then, and nothing at exit."""
    script = tmp_path / "one_step.py"
    script.write_text(
        "import sys, warnings\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]\n"
        "from test_step_budget import loss_and_logits\n"
        "from dpcs_testing import dpcs_compile\n"
        "from dpcs_compiler.stages.job import BudgetInfeasibleError\n"
        "model, x, y, _, _, step = loss_and_logits(True)\n"
        "compiled = dpcs_compile(model, memory_budget=21_800_000)\n"
        "step(compiled)\n"
        f"if {steps} > 1:\n"
        "    try:\n"
        "        step(compiled)\n"
        "    except BudgetInfeasibleError as e:\n"
        "        print('raised:', e)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    at_exit = "the verdict waited for the step's plan at the second step, which never ran"
    if steps == 1:
        assert at_exit in done.stderr and "cannot be met for graph_" in done.stderr, done.stderr[-3000:]
        assert "raised:" not in done.stdout
    else:
        assert "raised:" in done.stdout and "cannot be met for graph_" in done.stdout, done.stdout[-3000:]
        assert at_exit not in done.stderr, done.stderr[-3000:]
