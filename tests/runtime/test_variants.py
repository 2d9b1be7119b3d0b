"""Variants of one Dynamo graph switched between steps without Dynamo: compiled once each, correct each."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from dpcs_compiler import Runtime
from dpcs_compiler.runtime.decisions import Decisions
from dpcs_compiler.runtime.variants import UNBOUND, GraphDispatcher, live_dispatchers
from dpcs_testing import COMPILERS, dpcs_compile


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    )


@pytest.fixture(autouse=True)
def fresh_counters():
    counters.clear()


@pytest.fixture
def counted_calls(monkeypatch):
    """How often dpcs's dispatcher ran a compiled variant (an eager fallback would not go through it)."""
    calls = []
    original = GraphDispatcher.__call__

    def counting(self, *args):
        calls.append(self.current_key)
        return original(self, *args)

    monkeypatch.setattr(GraphDispatcher, "__call__", counting)
    return calls


def eager_step(model, x):
    out = model(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("compiler", COMPILERS)
def test_twenty_flips_compile_each_variant_once_without_dynamo(compiler, counted_calls):
    model, reference = mlp(), mlp()
    compiled = dpcs_compile(model, compiler)
    runtime = Runtime(model, policies=[], max_compiles=10)
    x = torch.randn(256, 32)
    flips = 20 if compiler == "eager" else 6  # Inductor: seconds per variant; 4 variants either way
    loose_peak = None
    for i in range(flips):
        precision = "bf16" if i % 2 else "fp32"
        tight = (i // 2) % 2 == 1
        runtime.force_precision(precision)
        if tight:
            runtime.force_budget(int(0.9 * loose_peak))
        else:
            runtime.clear_overrides()
            runtime.force_precision(precision)
        out = compiled(x)
        out.square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        expected, expected_grads = eager_step(reference, x)
        assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        tolerance = {"atol": 3e-2, "rtol": 3e-2} if precision == "bf16" else {}
        torch.testing.assert_close(out.float(), expected, **tolerance)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g.float(), e, **tolerance)
        model.zero_grad(set_to_none=True)
        runtime.step()
        if i == 0:
            [graph] = runtime.graphs
            loose_peak = graph.records[graph.current_key][0].predicted_peak_bytes
        assert counters["stats"]["unique_graphs"] == 1  # Dynamo compiled once, never again
    [graph] = runtime.graphs
    assert len(counted_calls) == flips  # every step ran a dpcs variant
    assert graph.compiles == len(graph.variants) == 4  # each variant compiled exactly once
    events = runtime.compile_events
    assert len(events) == 4 and len({e.variant for e in events}) == 4
    assert {e.decisions.split(";")[0] for e in events} >= {"bf16"}


def test_switching_back_compiles_nothing_and_the_tight_variant_plans_lower():
    model = mlp()
    compiled = dpcs_compile(model)
    runtime = Runtime(model, policies=[])
    x = torch.randn(256, 32)
    compiled(x).sum().backward()
    [graph] = runtime.graphs
    loose_key = graph.current_key
    loose = graph.records[loose_key][0]
    runtime.force_budget(int(0.9 * loose.predicted_peak_bytes))
    compiled(x).sum().backward()
    tight = graph.records[graph.current_key][0]
    assert tight.predicted_peak_bytes < loose.predicted_peak_bytes and tight.recomputed_values > 0
    runtime.clear_overrides()
    compiled(x).sum().backward()
    assert graph.compiles == 2 and graph.current_key == loose_key


def test_without_a_runtime_the_graph_runs_its_compile_options():
    model = mlp()
    compiled = dpcs_compile(model, precision="bf16")
    for _ in range(3):
        assert compiled(torch.randn(4, 32)).dtype == torch.bfloat16
    ids = {id(p) for p in model.parameters()}
    [graph] = [d for d in live_dispatchers() if d.parameter_ids & ids]
    assert graph.control is UNBOUND
    assert graph.compiles == 1 and graph.control.version == 0


def test_a_runtime_made_before_compiling_binds_at_compile_and_close_releases():
    model = mlp()
    runtime = Runtime(model, policies=[])
    runtime.force_precision("bf16")
    compiled = dpcs_compile(model)
    assert compiled(torch.randn(4, 32)).dtype == torch.bfloat16
    [graph] = runtime.graphs
    assert graph.compiles == 1  # the runtime's variant first, not the compile options' and then it
    runtime.close()
    assert graph.control is UNBOUND
    assert compiled(torch.randn(4, 32)).dtype == torch.float32


def test_the_thrash_guard_holds_and_says_so(caplog):
    model = mlp()
    compiled = dpcs_compile(model)
    runtime = Runtime(model, policies=[], max_compiles=2, compile_window=50)
    x = torch.randn(8, 32)
    with caplog.at_level(logging.WARNING, logger="dpcs.runtime"):
        for mode in ("bf16", "fp16", "fp8"):
            runtime.force_precision(mode)
            compiled(x).float().sum().backward()
            runtime.step()
    assert runtime.decisions.precision == "fp16"  # fp8 held: 2 new variants within the window already
    assert any("thrash guard" in r.message and "max_compiles=2" in r.message for r in caplog.records)
    runtime.force_precision("fp32")  # seen (the compile options): no compile, allowed
    assert runtime.decisions.precision == "fp32"


def test_variants_of_a_dynamic_shape_graph_follow_the_shapes():
    model, reference = mlp(), mlp()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": True}, dynamic=True)
    runtime = Runtime(model, policies=[])
    for i, batch in enumerate([4, 5, 6, 7, 9, 3]):
        runtime.force_precision("bf16" if i % 2 else "fp32")
        x = torch.randn(batch, 32)
        out = compiled(x)
        out.float().square().mean().backward()
        expected, _ = eager_step(reference, x)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
        model.zero_grad(set_to_none=True)
    [graph] = runtime.graphs
    assert graph.compiles == 2 and counters["stats"]["unique_graphs"] == 1


def test_a_variant_that_fails_to_compile_keeps_the_current_one(monkeypatch):
    model = mlp()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager"})  # not strict
    runtime = Runtime(model, policies=[])
    x = torch.randn(4, 32)
    compiled(x)
    [graph] = runtime.graphs

    def broken(*args, **kwargs):
        raise RuntimeError("no such variant")

    monkeypatch.setattr(graph, "compile_fn", broken)
    runtime.force_precision("bf16")
    with pytest.warns(UserWarning, match="keeps running its current variant"):
        assert compiled(x).dtype == torch.float32
    assert graph.control.events[-1].error == "RuntimeError: no such variant"
    runtime.step()
    assert runtime.compile_events[-1].error == "RuntimeError: no such variant"


def test_under_a_budget_a_variant_that_fails_to_compile_is_an_error_not_the_current_one_kept(monkeypatch):
    """Issue 58: the current variant was planned for another step or budget; kept, the budget could be dropped
    with only a warning. With a budget it raises (on_failure='fallback' keeps the current one, warned)."""
    from dpcs_compiler.stages.job import PlanningError

    for on_failure, expect in ((None, PlanningError), ("fallback", None)):
        torch._dynamo.reset()
        model = mlp()
        options = {"compiler": "eager", "memory_budget": 10**9, **({"on_failure": on_failure} if on_failure else {})}
        compiled = torch.compile(model, backend="dpcs", options=options)
        runtime = Runtime(model, policies=[])
        x = torch.randn(4, 32)
        compiled(x)
        [graph] = runtime.graphs
        monkeypatch.setattr(graph, "compile_fn", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("no")))
        runtime.force_precision("bf16")
        if expect is None:
            with pytest.warns(UserWarning, match="keeps running its current variant"):
                compiled(x)
        else:
            with pytest.raises(PlanningError, match=r"could not compile .* under memory_budget=1000000000: RuntimeError: no"):
                compiled(x)


def test_regions_pin_only_in_graphs_that_hold_them():
    from dpcs_compiler.options import DpcsOptions
    from dpcs_compiler.runtime.variants import variant_options

    base = DpcsOptions(compiler="eager", keep_fp32=("head",))
    modules = frozenset({"0", "0.fc", "1", "head"})
    opts = variant_options(base, Decisions("bf16", ("0", "1", "blocks.3")), modules, None)
    assert opts.precision == "bf16" and opts.keep_fp32 == ("head", "0", "0.*", "1")  # "1" has no children
    fp8 = variant_options(base, Decisions("fp8"), frozenset(), None)
    assert fp8.precision == "bf16" and fp8.fp8 is not None
    scaled = variant_options(base, Decisions("fp32", budget_scale=0.5), frozenset(), 1000)
    assert scaled.memory_budget == 500 and scaled.on_infeasible == "best"
    assert variant_options(base, None, frozenset(), None) is base


def test_inputs_that_cannot_be_faked_keep_the_first_variant_and_say_so(monkeypatch):
    """A graph input fake tensors cannot stand for (some tensor subclasses): the graph compiles and runs as
    without a runtime; a switch warns and keeps the variant it has."""
    from dpcs_compiler.runtime import variants

    def refuse(fake_mode, example_inputs):
        raise NotImplementedError("no fake for this tensor")

    monkeypatch.setattr(variants, "fake_inputs", refuse)
    model = mlp()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager"})  # not strict
    runtime = Runtime(model, policies=[])
    x = torch.randn(4, 32)
    assert compiled(x).dtype == torch.float32
    monkeypatch.undo()
    runtime.force_precision("bf16")
    with pytest.warns(UserWarning, match="inputs cannot be kept as fake tensors"):
        assert compiled(x).dtype == torch.float32
