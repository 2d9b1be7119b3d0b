"""Every budget kept or clearly refused (issue 58, item 3), whatever it is: for each shape of step, budgets
drawn at random (seeded; the seed and the draws are printed) between the lowest step peak dpcs reaches and
the step's peak without a budget, plus one below the lowest. Each measured step stays within its budget, or
the compile raises `BudgetInfeasibleError` naming the smallest peak; nothing in between. The first step,
which compiles the graphs before the step's order is known, is measured too (issue 57, item 2).

Shapes: one graph (MiniGPT), graph breaks (`BranchingNet`: three graphs a step), dynamic shapes (MiniGPT
compiled with `dynamic=True`, trained at 64, 128 and 256 tokens; the budget is of the step at 256), and on two
gloo ranks DDP with 2 MB buckets and FSDP2 per block (`LayerNormStack`, `tests/runtime/step_rank_worker.py`,
each budget in a job of its own: every budget must be kept or refused on both ranks alike). Where a budget is
kept, the step's prediction is checked against its measurement too (not the dynamic step's, whose measurement
is the largest of three lengths, each planned apart), and on the graph-break net the step's plans are checked
against every combination of its graphs' plans: none that fits the step adds less time (`_no_faster_step_fits`;
a plan well under its budget is then one where no plan closer to it is as fast).

FSDP2's prediction is not held within 2% of its step: on gloo the ranks' timing decides whether the
collectives' buffers gloo's worker threads drop late (a block's reduce-scatter copy, one per thread: 2) are
alive at a block's peak (docs/memory_budget.md, limits), and the prediction counts that many blocks. It is held
within 3% above the step that holds them; it is not asserted to bound the step. Drawn at seeds 58, 1, 2 and 3
on 2026-12-06 (2cc7844, one late block counted; each budget in a job of its own, 3 budgets per seed and
compiler and one below the lowest): every budget was kept or refused on both ranks, and one step measured 0.52
MB over its prediction (seed 3, eager, 50.1 MB budget: 47.78 MB measured, 47.26 MB predicted, the other rank
45.67 MB); CI then measured a step two blocks over its lowest (the ranks test), so both threads' blocks are
counted since. Plans sit 0.81-0.95 of their budgets: a graph called for five blocks takes one plan for all five.

The default tier draws one budget for the first two shapes under the eager compiler; the slow tier one for the
dynamic shape, and four per shape under both compilers (three for DDP and FSDP2). DPCS_PROPERTY_SEED sets the seed
(default 58)."""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import warnings
from collections.abc import Callable

import pytest
import torch

from dpcs_compiler import clear_compile_records, compile_records
from dpcs_compiler.measure import measure_peak_memory, measure_training_step, resident_bytes
from dpcs_compiler.models import GPTConfig, MiniGPT, workload
from dpcs_compiler.report import predicted_step_peak, step_records
from dpcs_testing import allowing_best_plan, budget_refusal, dpcs_compile, run_step_ranks

SEED = int(os.environ.get("DPCS_PROPERTY_SEED", "58"))
PREDICTED = 0.02  # the prediction's largest error, of the measured step peak
FSDP_PREDICTED = 0.03  # FSDP2 on gloo: above the step that holds the late collectives' blocks, at most
WARMUP = 4  # steps before the measured one (at each length): first plans, the step plan, a correction, steady


def _workload_step(name: str, batch: int) -> Callable[..., tuple[int, int]]:
    def run(compiler: str, **options) -> tuple[int, int]:
        """(the step measured after the warm-up, the most measured of it and the first step, which compiles)."""
        torch._dynamo.reset()
        clear_compile_records()
        w = workload(name, batch)
        compiled = dpcs_compile(w.model, compiler, **options)
        first = _first_step(w.model, lambda: w.loss_fn(compiled(*w.inputs)).backward(), w.inputs)
        steady = measure_training_step(w.model, compiled, w.inputs, loss_fn=w.loss_fn, warmup=WARMUP - 1,
                                       repeats=1).measured_peak_bytes
        return steady, max(first, steady)
    return run


def _first_step(model: torch.nn.Module, step: Callable[[], None], inputs) -> int:
    """The measured peak of the step's first run, which compiles its graphs: no step may go over its budget,
    the first included (issue 57, item 2). (The steps after it run unmeasured, as a user's do: the step
    recorder measures some of them itself, which a profiler already on would stop.)"""
    model.zero_grad(set_to_none=True)
    _, peak = measure_peak_memory(step)
    return peak.absolute(resident_bytes([*model.parameters(), *model.buffers(), *inputs]))


def _predicted() -> int | None:
    """The step's prediction as its variants compiled (a step plan's), or its one graph's own."""
    record = predicted_step_peak()
    return None if record is None else record.compiled_peak_bytes or record.predicted_peak_bytes


def _dynamic_step(compiler: str, **options) -> tuple[int, int]:
    """(The most any of the three lengths measured after its warm-up, a step of each; the most measured of
    those and each length's first step, which compiles its size bucket's graphs.)"""
    torch._dynamo.reset()
    clear_compile_records()
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(block_size=256, layers=2))
    compiled = torch.compile(model, backend="dpcs", dynamic=True, options={"compiler": compiler, "strict": True,
                                                                          **options})
    batches = {n: torch.randint(0, 512, (8, n), generator=torch.Generator().manual_seed(n)) for n in (64, 128, 256)}

    def step(idx):
        model.zero_grad(set_to_none=True)
        compiled(idx, torch.roll(idx, -1, 1)).backward()

    firsts = []
    for idx in batches.values():
        firsts.append(_first_step(model, lambda: compiled(idx, torch.roll(idx, -1, 1)).backward(), [idx]))
        for _ in range(WARMUP - 1):
            step(idx)
    peaks = []
    for idx in batches.values():
        model.zero_grad(set_to_none=True)
        _, peak = measure_peak_memory(step, idx)
        peaks.append(peak.absolute(resident_bytes([*model.parameters(), idx])))
    return max(peaks), max(*firsts, *peaks)


SHAPES = {"one_graph": _workload_step("gpt", 4), "graph_breaks": _workload_step("breaks", 1024),
          "dynamic": _dynamic_step}


def _check_ranks(tmp_path, shape: str, compiler: str, draws: int) -> None:
    """As `_check`, for a step of two ranks: each rank job compiles the step afresh per budget, in turn."""
    scenario = f"property:{shape}:{compiler}"
    # No budget, then the lowest (on_infeasible="best"), each in a job of its own: with the unbudgeted model alive
    # in the job, the lowest's measured step was corrected 1 MB higher once (FSDP2, Inductor, seed 1), and a
    # budget below the lowest other jobs reach was drawn and kept.
    (tmp_path / "free").mkdir()
    (tmp_path / "lowest").mkdir()
    unplanned = max(rank[0]["measured_peak"] for rank in run_step_ranks(tmp_path / "free", scenario, "0"))
    zero, one = run_step_ranks(tmp_path / "lowest", scenario, "1")
    lowest = zero[0]["planned"]
    assert one[0]["planned"] == lowest, (zero[0], one[0])  # one plan on every rank
    rng = random.Random(f"{SEED}:{shape}:{compiler}")
    budgets = sorted({rng.randint(lowest, unplanned) for _ in range(draws)}) if lowest < unplanned else []
    below = lowest - max(1, lowest // 50)
    print(f"{shape}, {compiler}: seed {SEED}; lowest {lowest} B, without a budget {unplanned} B; budgets {budgets}")
    # Each budget in a job of its own: a rank that kept the last budget's model alive while the next compiled
    # measured FSDP2's steps a block higher (45.7 MB alone, 47.8 MB third in a job, the same plan), and collecting
    # it first made DDP's draws time out in a gloo collective twice in eight runs under -n 2.
    ran = []
    for i, budget in enumerate([*budgets, below]):
        (tmp_path / f"budget{i}").mkdir()
        ran.append(run_step_ranks(tmp_path / f"budget{i}", scenario, str(budget)))
    for a, b in ((zero[0], one[0]) for zero, one in ran):
        budget = a["budget"]
        assert (a["raised_at"] is None) == (b["raised_at"] is None), (a, b)  # every rank alike
        if budget == below:
            assert a["raised_at"] is not None, f"{shape}, {compiler}: a budget below the lowest peak was not refused: {a}"
            assert re.search(r"the smallest step peak dpcs can reach is", a["message"]), a["message"]
            assert a["message"].split("; of it")[0] == b["message"].split("; of it")[0]
            print(f"  budget {below} B: refused ({a['message'][:160]}...)")
            continue
        assert a["raised_at"] is None, f"{shape}, {compiler}: a budget of {budget} B was refused: {a['message']}"
        for rank in (a, b):
            measured, predicted = rank["measured_peak"], rank["predicted"]
            print(f"  budget {budget} B: measured {measured} B ({measured / budget:.3f}), predicted {predicted} B")
            assert measured <= budget, f"{shape}, {compiler}: {measured} B measured for a budget of {budget} B"
            if shape == "fsdp":  # (the module docstring says why)
                held_copy = measured + rank["late_collectives"] * rank["block_bytes"]
                assert predicted <= (1 + FSDP_PREDICTED) * held_copy, (shape, compiler, predicted, measured)
            else:
                assert abs(predicted - measured) <= PREDICTED * measured, (shape, compiler, predicted, measured)


def _lowest(run, compiler: str) -> int:
    """The smallest step peak dpcs reaches (its verdict at a budget of 1 byte, asked for the best plan)."""
    with allowing_best_plan():
        run(compiler, memory_budget=1, on_infeasible="best")
    steps = step_records()
    if steps:
        return steps[-1].predicted_peak_bytes
    (record,) = [r for r in compile_records() if r.mode == "training"][-1:]
    return record.predicted_peak_bytes


def _no_faster_step_fits() -> tuple[float, float]:
    """(seconds the step's compiled plans add, the fewest any combination of its graphs' plans adds that fits
    the step's target by the step model): every combination of saving or recomputing each candidate of each
    graph, each predicted with what its compiled graphs held where a compile read it (`GraphStep.levels`).
    Issue 58, item 2: no plan well under the budget where one closer to it, and no slower, fits."""
    from dpcs_compiler.cost.memory_model import RECOMPUTE, SAVE, plan_seconds
    from dpcs_compiler.cost.step_model import step_peak
    from dpcs_compiler.step.recorder import STEPS

    shapes, dispatchers = [], {}
    for shape, refs in STEPS.shapes.values():
        shapes.append(shape)
        dispatchers.update({d.name: d for d in (r() for r in refs)})
    graphs, current = {}, {}
    for name, d in dispatchers.items():
        graphs[name], current[name] = d.step_graph()
    choices = {}
    for name, g in graphs.items():
        options = [()]
        for c in g.problem.candidates:
            options = [o + (d,) for o in options for d in ((SAVE, RECOMPUTE) if c.can_recompute else (SAVE,))]
        choices[name] = options
    assert math.prod(len(o) for o in choices.values()) <= 4096, "too many plans to enumerate"
    target = min(g.target for g in graphs.values())

    def seconds(decisions):
        return sum(plan_seconds(graphs[k].problem, decisions[k]) for k in graphs)

    fewest = math.inf
    for combo in itertools.product(*choices.values()):
        decisions = dict(zip(choices, combo))
        if step_peak(shapes, graphs, {k: graphs[k].levels(decisions[k]) for k in graphs}).bytes <= target:
            fewest = min(fewest, seconds(decisions))
    return seconds(current), fewest


def _check(shape: str, compiler: str, draws: int) -> None:
    run = SHAPES[shape]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")  # torch's own notices only
        unplanned, _ = run(compiler)
        lowest = _lowest(run, compiler)
        rng = random.Random(f"{SEED}:{shape}:{compiler}")
        budgets = sorted({rng.randint(lowest, unplanned) for _ in range(draws)}) if lowest < unplanned else []
        print(f"{shape}, {compiler}: seed {SEED}; lowest {lowest} B, without a budget {unplanned} B; budgets {budgets}")
        for budget in budgets:
            measured, most = run(compiler, memory_budget=budget)
            predicted = _predicted()
            print(f"  budget {budget} B: measured {measured} B ({measured / budget:.3f}), predicted {predicted} B; "
                  f"with the first step, at most {most} B ({most / budget:.3f})")
            assert most <= budget, f"{shape}, {compiler}: {most} B measured for a budget of {budget} B"
            if shape != "dynamic":  # (its measurement is the largest of three lengths, each a prediction of its own)
                # The step model follows the order the compiled graphs run (issue 58, item 2).
                assert abs(predicted - measured) <= PREDICTED * measured, (shape, compiler, predicted, measured)
            if shape == "graph_breaks":
                added, fewest = _no_faster_step_fits()
                print(f"    its plans add {added * 1e3:.3f} ms; the fewest of any that fits the step: {fewest * 1e3:.3f} ms")
                assert added <= fewest * (1 + 1e-9), (shape, compiler, budget, added, fewest)
        below = lowest - max(1, lowest // 50)
        with pytest.raises(Exception) as raised:  # from a compile, Dynamo's BackendCompilerFailed around it
            run(compiler, memory_budget=below)
        refusal = budget_refusal(raised.value)
        assert refusal is not None, f"{shape}, {compiler}: a budget below the lowest peak raised {raised.value!r}"
        assert re.search(r"the smallest (step )?peak dpcs can reach is", str(refusal)), refusal
        if shape == "dynamic":  # the sizes it was refused at (issue 58, item 4)
            assert re.search(r" at sizes \w+=\d+", str(refusal)), refusal
        print(f"  budget {below} B: refused ({str(refusal)[:160]}...)")


@pytest.mark.parametrize("shape", ["one_graph", "graph_breaks", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_a_random_budget_is_kept_or_refused(shape):
    _check(shape, "eager", draws=1)


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_random_budgets_are_kept_or_refused_on_every_shape(shape, compiler):
    _check(shape, compiler, draws=4)


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("shape", ["ddp", "fsdp"])
def test_random_budgets_are_kept_or_refused_on_every_rank(shape, compiler, tmp_path):
    _check_ranks(tmp_path, shape, compiler, draws=3)
