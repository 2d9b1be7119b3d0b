"""The final stage's compile of planned graphs (`stages/compile_parts.py`): what it skips of Inductor's
compile and what it keeps."""

from __future__ import annotations

import torch
import torch._inductor.compile_fx as compile_fx

from dpcs_testing import assert_gradients_match_eager, backward_lowerings, measured_step
from dpcs_compiler.models import workload
from dpcs_compiler.stages.compile_parts import _preferred, saved_views_not_donated, without_unused_repro_copy


def test_the_minifiers_copy_is_skipped_only_where_it_would_not_be_read():
    real = compile_fx.wrap_compiler_debug

    def fn(gm, example_inputs, **kwargs):
        return gm

    with without_unused_repro_copy() as skipped:
        assert skipped and compile_fx.wrap_compiler_debug(fn, compiler_name="inductor") is fn
    assert compile_fx.wrap_compiler_debug is real
    with torch._dynamo.config.patch(repro_after="aot"), without_unused_repro_copy() as skipped:
        # The minifier writes its repro from that copy: the wrapper stays.
        assert not skipped and compile_fx.wrap_compiler_debug is real
        assert compile_fx.wrap_compiler_debug(fn, compiler_name="inductor") is not fn
    assert compile_fx.wrap_compiler_debug is real


def test_planned_inductor_compiles_skip_the_minifiers_copy_and_match_eager(monkeypatch):
    """The MLP's lowest plan under Inductor: its forward and its backward (and the candidate backwards
    scheduled) compile without the minifier's wrapper, which deep-copies each graph; with
    repro_after="aot" every one of them goes through it. The gradients are eager's either way."""
    calls = []
    real = compile_fx.wrap_compiler_debug

    def counted(compiler_fn, compiler_name):
        calls.append(compiler_name)
        return real(compiler_fn, compiler_name)

    monkeypatch.setattr(compile_fx, "wrap_compiler_debug", counted)
    w = workload("mlp", 8)
    with backward_lowerings(monkeypatch) as lowerings:
        _, record = measured_step(w, "inductor", memory_budget=1, on_infeasible="best")
    assert record.plan_feasible is False and lowerings[0] >= 1, record  # its backward was planned and lowered
    assert calls == [], calls
    with torch._dynamo.config.patch(repro_after="aot"), backward_lowerings(monkeypatch) as lowerings:
        measured_step(w, "inductor", memory_budget=1, on_infeasible="best")
    assert len(calls) == lowerings[0] + 1, (calls, lowerings)  # every backward lowered, and the forward

    assert_gradients_match_eager(w, compiler="inductor", memory_budget=1, on_infeasible="best")


def test_the_backward_compiled_is_the_lowest_the_guards_rule_only_if_measurably_lower():
    """Candidates in order of precedence: the lowest is compiled, except that the guard's rule (producers apart)
    must be lower than every candidate with Inductor's fusions by more than the tolerance; ties go to
    Inductor's fusions, then to the first."""
    peaks = {("autograd", False): 1_000_000, ("autograd", True): 996_000, ("sunk", False): 998_500, ("sunk", True): 990_000}
    assert _preferred(peaks, 0) == ("sunk", True)
    assert _preferred(peaks, 8_000) == ("sunk", True)  # 8,500 B below Inductor's lowest: more than the tolerance
    assert _preferred(peaks, 8_500) == ("sunk", False)  # exactly the tolerance below: a tie, Inductor's fusions
    assert _preferred(peaks, 20_000) == ("sunk", False)  # an order lower by any amount is taken
    assert _preferred({("autograd", False): 5, ("sunk", False): 5}, 0) == ("autograd", False)  # a tie: the first
    assert _preferred({("autograd", False): 5, ("autograd", True): 5}, 0) == ("autograd", False)


def test_saved_views_of_one_storage_are_not_donated_to_the_backward():
    """Two saved slices of one buffer: AOTAutograd donates both, and Inductor can write over one while the other is
    still read (HF Mamba's gradients 43% off under Inductor). Under dpcs's compiles neither is donated; a saved
    tensor alone in its storage still is, and one aliasing a user output is not, as before."""
    from torch._functorch._aot_autograd import graph_compile
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        base, alone, output = torch.empty(4, 4), torch.empty(4), torch.empty(3)
        saved = [base[0], base[1], alone, output.view(3)]
    collect = lambda: graph_compile.collect_fw_donated_buffer_idxs([], [output], [], saved)  # noqa: E731
    assert collect() == [0, 1, 2]  # torch's own: the two slices donated
    with saved_views_not_donated() as guarded:
        assert guarded and collect() == [2]
    assert collect() == [0, 1, 2]


def test_saved_views_are_found_through_the_forward_graph_when_their_fake_values_do_not_share_a_storage():
    """DeBERTa-v2's forward saved a softmax and a `view` of it whose fake value had a storage of its own: both
    were donated, and Inductor wrote the softmax's gradient over the softmax in place. The forward graph's view
    ops (`view`, `split`'s items) tie them to one storage: neither is donated; a value of its own still is."""
    import operator
    import types

    from torch._functorch._aot_autograd import graph_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(x):
        soft = x.softmax(-1)
        halves = torch.ops.aten.split.Tensor(x.cos(), 2)
        alone = x.sin()
        return (x.sum(), soft, soft.view(16), halves[0], halves[1], alone)

    fw = make_fx(forward, tracing_mode="fake")(torch.randn(4, 4))
    by_target = {n.target: n for n in fw.graph.nodes if n.op == "call_function"}
    view = by_target[torch.ops.aten.view.default]
    view.meta["val"] = torch.empty_like(view.meta["val"])  # as DeBERTa's: a storage of its own
    getitems = [n for n in fw.graph.nodes if n.target is operator.getitem]
    assert len(getitems) == 2
    for item in getitems:  # found by the graph alone
        item.meta["val"] = torch.empty_like(item.meta["val"])
    bw = make_fx(lambda g: (g,), tracing_mode="fake")(torch.randn(4, 4))
    meta = types.SimpleNamespace(num_forward=1, tensors_saved_for_backwards_slice=slice(1, 6), num_symints_saved_for_bw=0)
    collect = lambda: graph_compile.collect_bw_donated_buffer_idxs(fw, bw, meta)  # noqa: E731
    assert collect() == [0, 1, 2, 3, 4]  # torch's own: every saved value (none aliases an input or an output)
    with saved_views_not_donated() as guarded:
        assert guarded and collect() == [4]
    assert collect() == [0, 1, 2, 3, 4]
