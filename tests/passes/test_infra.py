"""Pass infrastructure: the analysis cache and its invalidation, run_rewrites, instruments."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from dpcs_compiler.passes.analysis import Schedule, liveness, op_cost, tensor_bytes
from dpcs_compiler.passes.infra import AnalysisCache, PassContext, PassTimer, Rewrite, run_rewrites

aten = torch.ops.aten


def sin_cos(x):
    return (x.sin().cos(),)


def sin_cos_graph() -> fx.GraphModule:
    return make_fx(sin_cos, tracing_mode="fake")(torch.randn(4))


class CloneAfterSin(Rewrite):
    """Toy rewrite: every sin's readers read a clone of it instead."""

    name = "clone_after_sin"
    preserves = frozenset({op_cost})

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        sins = list(gm.graph.find_nodes(op="call_function", target=aten.sin.default))
        for sin in sins:
            with gm.graph.inserting_after(sin):
                clone = gm.graph.call_function(aten.clone.default, (sin,))
            sin.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
        return bool(sins)


class LookOnly(Rewrite):
    name = "look_only"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        return False


class Explode(Rewrite):
    name = "explode"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        raise ValueError("boom")


class UseBeforeDefinition(Rewrite):
    """Makes a graph lint rejects: a node that reads a value computed after it."""

    name = "use_before_definition"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        sin, cos = (n for n in gm.graph.nodes if n.op == "call_function")
        with gm.graph.inserting_before(sin):
            gm.graph.call_function(aten.neg.default, (cos,))
        return True


class Recorder:
    """An instrument that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def before_pass(self, stage, name, gm):
        self.calls.append(("before", stage, name, gm))

    def after_pass(self, stage, name, gm, seconds, modified):
        assert isinstance(seconds, float) and seconds >= 0
        self.calls.append(("after", stage, name, gm, modified))


def test_the_cache_computes_an_analysis_once_per_subject():
    calls = []

    def count_nodes(gm, analyses=None):
        calls.append(gm)
        return [len(gm.graph.nodes)]

    first, second = sin_cos_graph(), sin_cos_graph()
    cache = AnalysisCache()
    result = cache.get(count_nodes, first)
    assert result == [4]
    assert cache.get(count_nodes, first) is result
    assert cache.get(count_nodes, second) is not result
    assert calls == [first, second]
    assert cache.computed == ["count_nodes", "count_nodes"]


def test_an_analysis_asks_the_cache_for_the_analyses_it_needs():
    gm = sin_cos_graph()
    cache = AnalysisCache()
    schedule = Schedule.of_graph(gm)
    live = cache.get(liveness, schedule)
    assert cache.computed == ["tensor_bytes", "liveness"]
    assert cache.get(tensor_bytes, gm) is live.sizes[gm]
    assert cache.get(liveness, schedule) is live
    assert cache.computed == ["tensor_bytes", "liveness"]


def test_invalidate_drops_every_result_over_the_graph_but_the_preserved():
    forward, backward = sin_cos_graph(), sin_cos_graph()
    schedule = Schedule.of_partition(forward, backward, num_user_outputs=1)  # a step over both graphs
    cache = AnalysisCache()
    kept_cost, kept_sizes = cache.get(op_cost, forward), cache.get(tensor_bytes, backward)
    cache.get(liveness, schedule)
    assert cache.computed == ["tensor_bytes", "op_cost", "tensor_bytes", "liveness"]  # forward, forward, backward, step

    cache.invalidate(forward, frozenset({op_cost}))
    assert cache.get(op_cost, forward) is kept_cost  # preserved
    assert cache.get(tensor_bytes, backward) is kept_sizes  # another graph
    assert cache.computed == ["tensor_bytes", "op_cost", "tensor_bytes", "liveness"]
    cache.get(liveness, schedule)  # a schedule containing the forward graph: recomputed, with the forward sizes
    assert cache.computed[4:] == ["tensor_bytes", "liveness"]


def test_run_rewrites_stamps_new_nodes_lints_recompiles_and_times_the_pass():
    gm = sin_cos_graph()
    timer = PassTimer()
    ctx = PassContext(plan=None, analyses=AnalysisCache(), instruments=[timer])
    old_nodes = list(gm.graph.nodes)
    assert run_rewrites("forward", gm, [CloneAfterSin()], ctx) is gm
    checks = FileCheck().check("aten.sin.default(x_1)").check("aten.clone.default(sin)")
    checks.check("aten.cos.default(clone_default)").run(gm.code)
    (clone,) = (n for n in gm.graph.nodes if n not in old_nodes)
    assert clone.meta["dpcs"] == {"pass": "clone_after_sin"}
    assert all("dpcs" not in n.meta for n in old_nodes)
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), sin_cos(x))
    assert list(timer.seconds) == ["forward/clone_after_sin"] and timer.seconds["forward/clone_after_sin"] > 0

    first = timer.seconds["forward/clone_after_sin"]
    run_rewrites("forward", gm, [CloneAfterSin()], ctx)  # the same pass again: its time adds up
    assert list(timer.seconds) == ["forward/clone_after_sin"] and timer.seconds["forward/clone_after_sin"] > first


@pytest.mark.parametrize(("rewrite", "recomputed"), [(CloneAfterSin(), ["tensor_bytes"]), (LookOnly(), [])])
def test_a_rewrite_that_changes_the_graph_invalidates_what_it_does_not_preserve(rewrite, recomputed):
    gm = sin_cos_graph()
    cache = AnalysisCache()
    ctx = PassContext(plan=None, analyses=cache)
    cost, sizes = cache.get(op_cost, gm), cache.get(tensor_bytes, gm)
    assert cache.computed == ["tensor_bytes", "op_cost"]
    run_rewrites("forward", gm, [rewrite], ctx)
    assert cache.get(op_cost, gm) is cost
    assert (cache.get(tensor_bytes, gm) is sizes) == (recomputed == [])
    assert cache.computed[2:] == recomputed


@pytest.mark.parametrize("check", [True, False])
def test_lint_runs_after_a_rewrite_only_when_checking(check):
    gm = sin_cos_graph()
    ctx = PassContext(plan=None, analyses=AnalysisCache(), check=check)
    if check:
        with pytest.raises(RuntimeError, match="used before it has been defined"):
            run_rewrites("forward", gm, [UseBeforeDefinition()], ctx)
    else:
        run_rewrites("forward", gm, [UseBeforeDefinition()], ctx)
        assert "aten.neg.default(cos)" in gm.code  # recompiled without complaint


def test_a_failing_rewrite_is_named_in_the_error():
    ctx = PassContext(plan=None, analyses=AnalysisCache())
    with pytest.raises(RuntimeError, match=r"^dpcs rewrite backward/explode failed: boom$") as failure:
        run_rewrites("backward", sin_cos_graph(), [CloneAfterSin(), Explode()], ctx)
    assert isinstance(failure.value.__cause__, ValueError)


def test_instruments_are_called_before_and_after_every_pass_in_order():
    gm = sin_cos_graph()
    first, second = Recorder(), Recorder()
    ctx = PassContext(plan=None, analyses=AnalysisCache(), instruments=[first, second])
    run_rewrites("inference", gm, [CloneAfterSin(), LookOnly()], ctx)
    with ctx.instrumented("step", "analyses") as modified:
        modified[0] = True
    expected = [
        ("before", "inference", "clone_after_sin", gm),
        ("after", "inference", "clone_after_sin", gm, True),
        ("before", "inference", "look_only", gm),
        ("after", "inference", "look_only", gm, False),
        ("before", "step", "analyses", None),
        ("after", "step", "analyses", None, True),
    ]
    assert first.calls == second.calls == expected


def test_a_copied_graph_module_generates_its_code_only_when_run_or_read_and_runs_as_the_original():
    """`copy_graph_module` (and `lazy_copy`): a new graph (rewrites of the copy leave the original as it is),
    whose Python code is generated when it is run or its code read, not when it is made (most copies are only
    partitioned or analysed), and which then runs as the original does."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from dpcs_compiler.passes.infra import copy_graph_module

    original = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    copied = copy_graph_module(original)
    assert isinstance(copied, _LazyGraphModule) and copied._needs_recompile()
    assert copied.graph is not original.graph
    x = torch.randn(2, 4)
    torch.testing.assert_close(copied(x), original(x))
    assert not copied._needs_recompile()
    relu = next(n for n in copied.graph.nodes if n.op == "call_module" and n.target == "1")
    with copied.graph.inserting_after(relu):
        doubled = copied.graph.call_function(torch.mul, (relu, 2.0))
    relu.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)
    copied.recompile()
    assert "mul" in copied.code and "mul" not in original.code
    torch.testing.assert_close(copied(x), 2 * original(x))
