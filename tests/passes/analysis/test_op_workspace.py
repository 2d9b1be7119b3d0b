"""op_workspace: which kernels are measured, what a measurement finds, and how a schedule counts it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.measure import CpuMemoryProfile
from dpcs_compiler.passes.analysis import Schedule, memory_timeline
from dpcs_compiler.passes.analysis import op_workspace
from dpcs_compiler.passes.analysis.op_workspace import (
    OpSignature,
    TensorSpec,
    WorkspaceTable,
    matmul_copies,
    measure_workspaces,
    op_signature,
)
from dpcs_compiler.passes.analysis.planning import _closure_peak
from dpcs_compiler.passes.analysis.liveness import liveness


@pytest.fixture(autouse=True)
def fresh_measurements(monkeypatch):
    monkeypatch.setattr(op_workspace, "_MEASURED", {})


def softmax_of_transpose(x):  # x: f32[32, 64]; its transpose is not contiguous: the kernel copies it (8 KiB)
    return (torch.softmax(x.t(), dim=-1),)


def nodes_by_target(gm):
    return {n.target: n for n in gm.graph.nodes if n.op == "call_function"}


def test_views_pointwise_random_and_matmul_nodes_are_not_measured():
    def fn(x, w):
        y = torch.mm(x, w).view(8, 8).sin()
        return (F.dropout(y, 0.5) + torch.softmax(y, -1),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    measured = {n.target for n in gm.graph.nodes if n.op == "call_function" and op_signature(n) is not None}
    assert measured == {torch.ops.aten._softmax.default}, measured


def test_a_kernel_that_copies_a_non_contiguous_input_has_the_copy_as_workspace():
    gm = make_fx(softmax_of_transpose, tracing_mode="fake")(torch.randn(32, 64))
    softmax = nodes_by_target(gm)[torch.ops.aten._softmax.default]
    signature = op_signature(softmax)
    assert signature.args[0] == TensorSpec((64, 32), (1, 64), torch.float32, 0)
    contiguous = OpSignature(signature.op, (TensorSpec((64, 32), (32, 1), torch.float32, 0), -1, False), (), "cpu")
    assert measure_workspaces([signature, contiguous]) == {signature: 32 * 64 * 4, contiguous: 0}


def test_a_kernel_the_probe_cannot_run_is_counted_as_a_copy_of_its_inputs_not_as_nothing(monkeypatch, caplog):
    """Issue 58: an unmeasured kernel counted 0 B of workspace, said at INFO; the budget keeps a bound for it."""
    gm = make_fx(softmax_of_transpose, tracing_mode="fake")(torch.randn(32, 64))
    signature = op_signature(nodes_by_target(gm)[torch.ops.aten._softmax.default])

    def refuse(signature):
        raise RuntimeError("no kernel for these arguments here")

    monkeypatch.setattr(op_workspace, "_measure_one", refuse)
    with caplog.at_level("WARNING", logger="dpcs.passes"):
        assert measure_workspaces([signature]) == {signature: 64 * 32 * 4}
    assert "counted as its inputs' bytes" in caplog.text


def test_measuring_leaves_the_users_random_numbers_alone():
    gm = make_fx(softmax_of_transpose, tracing_mode="fake")(torch.randn(32, 64))
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    measure_workspaces([op_signature(nodes_by_target(gm)[torch.ops.aten._softmax.default])])
    torch.testing.assert_close(torch.rand(4), expected)


def test_a_matrix_product_copies_only_operands_blas_cannot_read_in_place():
    def fn(x, w):
        return (torch.mm(x, w.t()), torch.mm(x[:, ::2], w[::2]))  # a transpose is read in place; a strided slice is not

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(16, 32), torch.randn(32, 32))
    direct, sliced = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert matmul_copies(direct) == 0
    assert matmul_copies(sliced) == 16 * 16 * 4  # x[:, ::2]; w[::2] has unit-strided rows
    assert WorkspaceTable().bytes_of(gm.graph.nodes) == {sliced: 16 * 16 * 4}


def test_the_timeline_counts_a_nodes_workspace_while_it_runs_only():
    gm = make_fx(softmax_of_transpose, tracing_mode="fake")(torch.randn(32, 64))
    schedule = Schedule.of_graph(gm)
    softmax = nodes_by_target(gm)[torch.ops.aten._softmax.default]
    plain, counted = memory_timeline(schedule), memory_timeline(schedule.with_workspace({softmax: 8192}))
    for before, after in zip(plain.steps, counted.steps):
        extra = 8192 if after.node == softmax.name else 0
        assert (after.during, after.after, after.by_category["workspace"]) == (before.during + extra, before.after, extra)
    assert counted.peak_bytes == plain.peak_bytes + 8192


def test_a_recomputations_peak_counts_the_workspace_of_the_nodes_it_runs():
    gm = make_fx(softmax_of_transpose, tracing_mode="fake")(torch.randn(32, 64))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    softmax = nodes_by_target(gm)[torch.ops.aten._softmax.default]
    (buffer,) = liveness(Schedule.of_graph(gm)).allocations[softmax]
    plain = _closure_peak(nodes, buffer, liveness(Schedule.of_graph(gm)))
    counted = _closure_peak(nodes, buffer, liveness(Schedule.of_graph(gm).with_workspace({softmax: 8192})))
    assert counted == plain + 8192


def test_under_inductor_only_its_aten_kernels_count_and_convolutions_are_channels_last():
    def fn(x, w):
        return (F.avg_pool2d(F.conv2d(x, w, padding=1), 2),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(2, 4, 8, 8), torch.randn(4, 4, 3, 3))
    by_target = nodes_by_target(gm)
    conv, pool = by_target[torch.ops.aten.convolution.default], by_target[torch.ops.aten.avg_pool2d.default]
    assert op_signature(pool) is not None
    assert op_signature(pool, inductor=True) is None  # Inductor generates its code: no ATen kernel runs
    x_spec = op_signature(conv, inductor=True, channels_last=True).args[0]
    assert x_spec.stride == (256, 1, 32, 4)  # channels-last strides of (2, 4, 8, 8)
    assert op_signature(conv, inductor=True).args[0].stride == (256, 64, 8, 1)


def test_a_view_that_is_not_dense_reaches_a_channels_last_convolution_as_itself_and_its_copy_is_measured():
    """ViT's patch embedding: the backward's grad_output is the patch tokens, a slice past the class token,
    transposed into (N, C, H, W). Inductor hands the kernel that view of its buffer (batch stride 17 x 64, not
    16 x 64), and oneDNN copies it before it runs. Given channels-last strides, the probe missed the copy and the
    step measured 0.45% over its prediction."""

    def fn(tokens, x, w):  # tokens: the layer's gradient at (batch, 1 + 16 patches, 64)
        grad = tokens[:, 1:, :].transpose(1, 2).reshape(2, 64, 4, 4)
        return torch.ops.aten.convolution_backward.default(grad, x, w, [64], (8, 8), (0, 0), (1, 1), False, (0, 0), 1,
                                                           [False, True, True])[1:]

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(2, 17, 64), torch.randn(2, 3, 32, 32), torch.randn(64, 3, 8, 8))
    backward = nodes_by_target(gm)[torch.ops.aten.convolution_backward.default]
    signature = op_signature(backward, inductor=True, channels_last=True)
    grad, x, w = signature.args[:3]
    assert (grad.stride, grad.offset) == ((1088, 1, 256, 64), 64)  # the view, as traced
    assert x.stride == (3072, 1, 96, 3) and w.stride == (192, 1, 24, 3)  # dense ones: channels-last
    dense = dataclasses.replace(signature, args=(dataclasses.replace(grad, stride=(1024, 1, 256, 64), offset=0),
                                                 *signature.args[1:]))
    measured = measure_workspaces([signature, dense])
    assert measured[signature] - measured[dense] == 2 * 64 * 4 * 4 * 4  # oneDNN's copy of the view: 8 KiB


def test_every_rank_plans_with_the_most_any_rank_measured(monkeypatch):
    gm = make_fx(softmax_of_transpose, tracing_mode="fake")(torch.randn(32, 64))
    softmax = nodes_by_target(gm)[torch.ops.aten._softmax.default]
    signature = op_signature(softmax)
    gathered = []

    def every_rank(value):
        gathered.append(value)
        return [value, {signature: 10**6}]

    monkeypatch.setattr(rank_agreement, "every_rank", every_rank)
    table = WorkspaceTable()
    table.agree_on(gm.graph.nodes)
    assert gathered == [{signature: 8192}]  # this rank's own measurement, exchanged
    assert table.bytes_of(gm.graph.nodes) == {softmax: 10**6}
    table.agree_on(gm.graph.nodes)  # measured before: the collective still happens (every rank takes part)
    assert len(gathered) == 2


def test_a_profiler_in_the_compiling_thread_neither_blocks_the_probes_nor_sees_them():
    gm = make_fx(softmax_of_transpose, tracing_mode="fake")(torch.randn(32, 64))
    signature = op_signature(nodes_by_target(gm)[torch.ops.aten._softmax.default])
    profile = CpuMemoryProfile().start()
    measured = measure_workspaces([signature])
    profile.stop()
    assert measured == {signature: 32 * 64 * 4}
    assert profile.peak_increase_bytes() == 0  # the probes' inputs, outputs and copies are not this profile's
