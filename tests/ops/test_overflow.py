"""dpcs.note_nonfinite and the overflow flag: semantics per dtype, the read API, tracing, DCE, Inductor, no sync."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.fx as fx
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerActivity, profile
from torch.testing import FileCheck

from dpcs_compiler.ops import overflow
from dpcs_compiler.ops.overflow import (
    NOTE_NONFINITE,
    overflow_flag,
    overflowed,
    reset_overflow,
    take_overflow,
)

note_nonfinite = torch.ops.dpcs.note_nonfinite
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
INF, NAN = float("inf"), float("nan")
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def clear_flags():
    reset_overflow()
    yield
    reset_overflow()


def with_value_at(value: float, dtype: torch.dtype, index: int = 517) -> torch.Tensor:
    """A 33x31 tensor of ordinary values with `value` at one position (past any vector-width boundary)."""
    grad = torch.randn(33, 31).to(dtype)
    grad.view(-1)[index] = value
    return grad


# --- semantics ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("value", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
def test_non_finite_element_sets_the_flag(value, dtype):
    note_nonfinite([with_value_at(value, dtype)])
    assert overflowed("cpu")


@pytest.mark.parametrize(
    "dtype, value",
    [
        (torch.float16, 60000.0),
        (torch.float16, -65504.0),  # fp16 max: a sum of such values overflows, their amax does not
        (torch.bfloat16, 3.0e38),
        (torch.float32, 3.4e38),
        (torch.float64, 1.0e308),
    ],
    ids=str,
)
def test_large_finite_values_do_not_set_the_flag(dtype, value):
    grad = torch.full((64, 64), value, dtype=dtype)
    assert not torch.isfinite(grad.sum())  # what a sum-based check would have seen
    note_nonfinite([grad])
    assert not overflowed("cpu")


def test_one_bad_tensor_among_many_of_mixed_dtypes_and_layouts():
    finite = [
        torch.randn(7, 5),
        torch.randn(5, 7).t(),  # not contiguous
        torch.randn(3, 300).half()[:, ::3],
        torch.randn(4).bfloat16(),
        torch.tensor(2.0),  # 0-dim
        torch.full((3,), 1.0e308, dtype=torch.float64),  # reduced in float64, not narrowed to an fp32 inf
        torch.empty(0, 3),  # empty: no identity for a max, must be skipped
        torch.arange(6),  # integer: cannot be non-finite, ignored
    ]
    note_nonfinite(finite)
    assert not overflowed("cpu")
    note_nonfinite([*finite, with_value_at(NAN, torch.bfloat16), torch.randn(3)])
    assert overflowed("cpu")


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fn"])
def test_float8_grads_are_checked(dtype):
    dtype = getattr(torch, dtype)
    note_nonfinite([torch.tensor([1.0, 448.0]).to(dtype)])
    assert not overflowed("cpu")
    note_nonfinite([torch.tensor([1.0, NAN]).to(dtype)])
    assert overflowed("cpu")


def test_flag_accumulates_until_reset():
    note_nonfinite([torch.tensor([INF])])
    note_nonfinite([torch.randn(8)])
    assert overflowed("cpu")
    reset_overflow("cpu")
    note_nonfinite([torch.randn(8)])
    assert not overflowed("cpu")


def test_empty_list_is_a_no_op():
    flag = overflow_flag("cpu")
    note_nonfinite([])
    note_nonfinite([torch.empty(0)])
    assert not flag and overflow_flag("cpu") is flag


def test_schema_returns_nothing_and_mutates_nothing():
    assert str(NOTE_NONFINITE._schema) == "dpcs::note_nonfinite(Tensor[] grads) -> ()"
    assert not NOTE_NONFINITE._schema.is_mutable


def test_opcheck():
    torch.library.opcheck(NOTE_NONFINITE, ([torch.randn(3, 4), torch.randn(4, 3).t().half(), torch.randn(2)],))


# --- the read API ------------------------------------------------------------------------------------------


def test_flag_is_a_0_dim_bool_tensor_created_false_once_per_device():
    flag = overflow_flag("cpu")
    assert (flag.shape, flag.dtype, flag.device.type, bool(flag)) == ((), torch.bool, "cpu", False)
    assert overflow_flag(torch.device("cpu")) is flag
    assert overflow_flag("cpu:0") is flag  # CPU tensors carry no index
    note_nonfinite([torch.tensor([INF])])
    assert bool(flag)  # the live flag, not a copy


def test_default_device_is_the_current_accelerator_else_cpu():
    accelerator = torch.accelerator.current_accelerator()
    expected = "cpu" if accelerator is None else accelerator.type
    assert overflow_flag().device.type == expected
    assert overflow_flag(None) is overflow_flag(expected)


def test_take_returns_the_value_and_resets():
    note_nonfinite([torch.tensor([NAN])])
    taken = take_overflow("cpu")
    assert bool(taken) and not overflowed("cpu")
    assert taken.data_ptr() != overflow_flag("cpu").data_ptr()  # a copy: later steps do not change it
    note_nonfinite([torch.randn(4)])
    assert bool(taken)
    assert not bool(take_overflow("cpu"))


def test_reset_without_a_device_clears_every_flag(monkeypatch):
    other = torch.ones((), dtype=torch.bool)
    monkeypatch.setattr(overflow, "_flags", {torch.device("cuda", 7): other})  # as if a second device had one
    flag = overflow_flag("cpu")
    flag.fill_(True)
    reset_overflow("cpu")
    assert not bool(flag) and bool(other)
    flag.fill_(True)
    reset_overflow()
    assert not bool(flag) and not bool(other)


def test_concurrent_first_use_creates_one_flag(monkeypatch):
    monkeypatch.setattr(overflow, "_flags", {})
    start = threading.Barrier(8)
    seen: list[torch.Tensor] = []

    def first_use():
        start.wait()
        seen.append(overflow_flag("cpu"))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and all(flag is seen[0] for flag in seen)


def test_only_overflowed_reads_the_flag_on_the_host():
    """`_local_scalar_dense` is what `.item()` / `bool(tensor)` run: the device->host read that syncs."""
    grads = [torch.randn(16), torch.randn(4, 4).half(), torch.randn(3).bfloat16()]
    overflow_flag("cpu")

    def op_names(step) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        return [event.name for event in prof.events()]

    for step in (lambda: note_nonfinite(grads), lambda: take_overflow("cpu"), lambda: reset_overflow()):
        assert "aten::_local_scalar_dense" not in op_names(step)
    assert "aten::_local_scalar_dense" in op_names(lambda: overflowed("cpu"))


def test_work_per_call_does_not_grow_with_the_number_of_grads():
    """One foreach reduction over all grads, then a constant number of 0-dim ops (views aside)."""
    overflow_flag("cpu")

    def op_count(grads) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            note_nonfinite(grads)
        skip = {"aten::linalg_vector_norm", "aten::as_strided", "aten::unsqueeze"}  # per-tensor parts, views
        return sum(event.name not in skip for event in prof.events())

    assert op_count([torch.randn(8) for _ in range(2)]) == op_count([torch.randn(8) for _ in range(20)])


# --- tracing and compilation -------------------------------------------------------------------------------


def check_intermediates(x: torch.Tensor) -> torch.Tensor:
    """The checked values are read by nothing else: only the op's side effect keeps them (and it) alive."""
    note_nonfinite([x * 2, (x + 1).half()])
    return x.sum()


def test_fake_impl_does_nothing():
    flag = overflow_flag("cpu")
    with FakeTensorMode():
        assert note_nonfinite([torch.full((4,), INF), torch.empty(2, device="cuda")]) is None
    assert not bool(flag)


def test_make_fx_records_the_op_and_dce_keeps_it():
    gm = make_fx(check_intermediates, tracing_mode="fake")(torch.randn(8))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    FileCheck().check("aten.mul").check("aten._to_copy").check_count(
        "torch.ops.dpcs.note_nonfinite.default(", 1, exactly=True
    ).run(gm.code)
    gm(torch.full((8,), NAN))
    assert overflowed("cpu")


def test_dce_keeps_it_because_of_the_side_effect_registration(monkeypatch):
    graph = fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.call_function(NOTE_NONFINITE, ([doubled],))
    graph.output(x)
    assert not graph.eliminate_dead_code()
    registered = torch.fx.node._side_effectful_functions
    monkeypatch.setattr(torch.fx.node, "_side_effectful_functions", registered - {NOTE_NONFINITE})
    assert graph.eliminate_dead_code() and len(graph.nodes) == 2  # without it, FX drops the op


def test_aot_eager_compiled_function_raises_the_flag():
    compiled = torch.compile(check_intermediates, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(8))
    assert not overflowed("cpu")
    x = torch.randn(8)
    x[5] = -INF
    torch.testing.assert_close(compiled(x), x.sum())
    assert overflowed("cpu")


@pytest.mark.inductor
def test_survives_inductor_and_runs_in_the_compiled_code():
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(check_intermediates, backend="inductor", fullgraph=True, dynamic=False)
        _, (code,) = run_and_get_code(compiled, torch.randn(8))
    FileCheck().check_count("torch.ops.dpcs.note_nonfinite.default(", 1, exactly=True).run(code)
    assert not overflowed("cpu")
    x = torch.randn(8)
    x[3] = 70000.0  # finite in fp32, inf once the compiled code casts x + 1 to fp16
    compiled(x)
    assert overflowed("cpu")


# --- CUDA --------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_op_and_read_api_do_not_sync(dtype):
    grads = [torch.randn(1 << 20, device="cuda").to(dtype), with_value_at(INF, dtype).cuda()]
    overflow_flag("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        note_nonfinite(grads)
        taken = take_overflow("cuda")
        reset_overflow()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(taken) and not overflowed("cuda")


@pytest.mark.cuda
@needs_cuda
def test_cuda_flags_are_per_device():
    note_nonfinite([torch.randn(4, device="cuda"), torch.tensor([NAN])])
    assert overflowed("cpu") and not overflowed("cuda")
    assert overflow_flag("cuda") is overflow_flag(torch.device("cuda", torch.cuda.current_device()))
    note_nonfinite([torch.tensor([INF], device="cuda").half()])
    reset_overflow("cpu")
    assert overflowed("cuda") and not overflowed("cpu")
