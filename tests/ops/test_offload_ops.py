"""The dpcs offload ops: CPU round trips, fake impls, schemas, opcheck; stream behaviour on CUDA only."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcs_compiler.ops import offload_ops
from dpcs_compiler.ops.offload_ops import pending_events, release_offload_state

ops = torch.ops.dpcs
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SAMPLES = {
    "contiguous": lambda: torch.randn(3, 5),
    "transposed": lambda: torch.randn(5, 3).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
    "offset_view": lambda: torch.randn(6, 4)[2:],
    "bf16": lambda: torch.randn(4, 4).to(torch.bfloat16),
    "int64": lambda: torch.arange(12).view(3, 4),
    "scalar": lambda: torch.tensor(2.5),
    "empty": lambda: torch.empty(0, 3),
}


@pytest.fixture(autouse=True)
def clean_offload_state():
    yield
    release_offload_state()


@pytest.mark.parametrize("sample", SAMPLES)
def test_cpu_round_trip_copies_and_keeps_layout(sample):
    x = SAMPLES[sample]()
    host = ops.offload(x)
    assert host.device.type == "cpu" and host.dtype == x.dtype
    assert host.shape == x.shape and host.stride() == x.stride()
    assert host.numel() == 0 or host.data_ptr() != x.data_ptr()  # a new tensor, not x itself
    ops.wait_offload(host, x)
    back = ops.reload(host, torch.device("cpu"))
    ops.wait_tensor(back)
    assert back.stride() == x.stride()
    assert back.numel() == 0 or back.data_ptr() != host.data_ptr()
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    assert pending_events() == 0


def test_cpu_copies_are_independent_of_the_source():
    x = torch.randn(4, 4)
    expected = x.clone()
    host = ops.offload(x)
    x.zero_()
    back = ops.reload(host, torch.device("cpu"))
    host.zero_()
    torch.testing.assert_close(back, expected, rtol=0, atol=0)


def test_fake_impls_give_host_and_device_metadata():
    with FakeTensorMode():
        x = torch.empty(8, 6, device="cuda", dtype=torch.float16).t()
        host = ops.offload(x)
        assert (host.device.type, host.shape, host.stride(), host.dtype) == ("cpu", x.shape, x.stride(), x.dtype)
        back = ops.reload(host, x.device)
        assert (back.device, back.shape, back.stride(), back.dtype) == (x.device, x.shape, x.stride(), x.dtype)
        assert ops.wait_offload(host, x) is None
        assert ops.wait_tensor(back) is None


def test_fake_impls_follow_symbolic_shapes():
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    x = mode.from_tensor(torch.empty(5, 7), symbolic_context=dynamic)
    with mode:
        host = ops.offload(x)
        back = ops.reload(host, torch.device("cpu"))
    assert all(isinstance(d, torch.SymInt) for d in host.shape)
    assert str(host.shape) == str(back.shape) == str(x.shape)
    assert str(host.stride()) == str(x.stride())


def test_schemas_declare_what_the_compiler_relies_on():
    assert str(ops.offload.default._schema) == "dpcs::offload(Tensor x) -> Tensor"
    assert str(ops.reload.default._schema) == "dpcs::reload(Tensor host, Device device) -> Tensor"
    wait = ops.wait_tensor.default._schema
    assert wait.returns == [] and wait.arguments[0].alias_info.is_write
    release = ops.wait_offload.default._schema
    assert release.returns == [] and release.arguments[1].alias_info.is_write
    assert not release.arguments[0].alias_info  # the host copy is only read
    for op in (ops.offload.default, ops.reload.default):
        assert not op._schema.is_mutable


def test_waits_survive_dead_code_elimination():
    graph = fx.Graph()
    x = graph.placeholder("x")
    host = graph.call_function(ops.offload.default, (x,))
    graph.call_function(ops.wait_offload.default, (host, x))
    back = graph.call_function(ops.reload.default, (host, torch.device("cpu")))
    graph.call_function(ops.wait_tensor.default, (back,))
    graph.output(back)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == list(offload_ops.OFFLOAD_OPS)
    gm.recompile()
    x = torch.randn(3, 3)
    torch.testing.assert_close(gm(x), x)


@pytest.mark.parametrize(
    "op, args",
    [
        (ops.offload.default, lambda: (torch.randn(3, 4),)),
        (ops.offload.default, lambda: (torch.randn(4, 3).t(),)),
        (ops.reload.default, lambda: (torch.randn(3, 4), torch.device("cpu"))),
        (ops.wait_offload.default, lambda: (torch.randn(3, 4), torch.randn(3, 4))),
        (ops.wait_tensor.default, lambda: (torch.randn(3, 4),)),
    ],
    ids=["offload", "offload_transposed", "reload", "wait_offload", "wait_tensor"],
)
def test_opcheck(op, args):
    torch.library.opcheck(op, args())


def test_release_without_cuda_is_a_no_op():
    release_offload_state()
    release_offload_state()
    assert pending_events() == 0


# --- CUDA only: streams, pinned memory, overlap, memory ---------------------------------------------------

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: long enough that the copy order shows


@pytest.mark.parametrize("sample", ["contiguous", "transposed", "bf16"])
@pytest.mark.cuda
@needs_cuda
def test_cuda_round_trip_uses_pinned_memory(sample):
    x = SAMPLES[sample]().cuda()
    host = ops.offload(x)
    assert host.is_pinned() and host.stride() == x.stride()
    ops.wait_offload(host, x)
    back = ops.reload(host, x.device)
    ops.wait_tensor(back)
    assert back.device == x.device and back.stride() == x.stride()
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    assert pending_events() == 0


@pytest.mark.cuda
@needs_cuda
def test_cuda_offload_waits_for_the_producer():
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    x.add_(1)  # queued behind the sleep on the compute stream
    host = ops.offload(x)
    ops.wait_offload(host, x)
    torch.cuda.synchronize()
    assert bool((host == 1).all())


@pytest.mark.cuda
@needs_cuda
def test_cuda_offload_overlaps_later_compute():
    x = torch.randn(1 << 22, device="cuda")
    torch.cuda.synchronize()
    host = ops.offload(x)
    torch.cuda._sleep(SLEEP_CYCLES * 10)  # later compute work on the compute stream
    offload_ops._d2h_events[host.data_ptr()].synchronize()
    assert not torch.cuda.current_stream().query(), "the copy waited for compute queued after it"
    torch.testing.assert_close(host, x.cpu(), rtol=0, atol=0)
    torch.cuda.synchronize()


@pytest.mark.cuda
@needs_cuda
def test_cuda_freed_source_is_not_reused_before_the_copy():
    x = torch.randn(1 << 22, device="cuda")
    expected = x.cpu()
    side = offload_ops._side_stream(x.device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy is queued behind this
    host = ops.offload(x)
    del x  # record_stream: the allocator must not hand this block out before the copy ran
    y = torch.empty(1 << 22, device="cuda").fill_(7.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(host, expected, rtol=0, atol=0)
    del y


@pytest.mark.cuda
@needs_cuda
def test_cuda_wait_tensor_orders_readers_after_the_reload():
    host = torch.randn(1 << 22).pin_memory()
    side = offload_ops._side_stream(torch.device("cuda"))
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the reload is queued behind this
    back = ops.reload(host, torch.device("cuda"))
    ops.wait_tensor(back)
    total = back.double().sum()  # on the compute stream, after the wait
    torch.testing.assert_close(total.cpu(), host.double().sum(), rtol=1e-9, atol=1e-6)
    assert pending_events() == 0


@pytest.mark.cuda
@needs_cuda
def test_cuda_wait_without_reload_fails_loudly():
    with pytest.raises(RuntimeError, match="no pending dpcs.reload"):
        ops.wait_tensor(torch.zeros(4, device="cuda"))


@pytest.mark.cuda
@needs_cuda
def test_cuda_release_drops_streams_and_events():
    x = torch.randn(1024, device="cuda")
    host = ops.offload(x)
    assert offload_ops._side_streams and pending_events() == 1
    release_offload_state()
    assert not offload_ops._side_streams and pending_events() == 0
    torch.testing.assert_close(host, x.cpu(), rtol=0, atol=0)  # release finished the copy first


def test_the_ops_host_time_is_timed_as_a_step_issues_them():
    """The loop the CUDA profile times (`offload_ops_s`), on the ops' CPU path (synchronous copies): a round of
    the four ops takes host time and leaves no copy event pending."""
    seconds = offload_ops.host_seconds_per_value(torch.device("cpu"), lambda: None, rounds=5, repeats=3)
    assert 0 < seconds < 0.1
    assert pending_events() == 0


@pytest.mark.parametrize("op", offload_ops.OFFLOAD_OPS, ids=lambda op: op.__name__)
def test_the_ops_have_one_kernel_and_no_python_autograd_layer(op):
    """A step calls these ops in line with its kernels, four per offloaded value: each is defined with one kernel
    for every device and a fake impl, not as a `custom_op`, whose Python autograd layer runs on every call (and
    made a value's four ops cost about 3x the host time on CPU)."""
    name = op.name()
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutogradCPU")


@needs_cuda
def test_cuda_the_profile_times_the_offload_ops_on_the_host():
    """What `measure_hardware_profile` puts in `offload_ops_s` on CUDA: the host time of one value's four ops,
    above a kernel launch's and under a millisecond, with no copy event left pending."""
    from dpcs_compiler.cost.hardware import measure_hardware_profile

    device = torch.device("cuda", torch.cuda.current_device())
    seconds = offload_ops.host_seconds_per_value(device, lambda: torch.cuda.synchronize(device))
    print(f"offload ops on {torch.cuda.get_device_name(device)}: {seconds * 1e6:.1f} us per value")
    assert 1e-6 < seconds < 1e-3
    assert pending_events() == 0
    assert measure_hardware_profile(device).offload_ops_s is not None
