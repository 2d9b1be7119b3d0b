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
