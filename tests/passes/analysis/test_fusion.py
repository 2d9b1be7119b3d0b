"""inductor_fusion: which pointwise values Inductor computes inside their readers' kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.passes.analysis.fusion import inductor_fusion


def fused_names(fn, *inputs):
    return sorted(n.name for n in inductor_fusion(make_fx(fn, tracing_mode="fake")(*inputs)))


def sin_and_its_cos(x, w):
    a = x.sin()
    return (a, a.cos())


@pytest.mark.parametrize(
    ("fn", "fused"),
    [
        (lambda x, w: (x.sin().cos(),), ["sin"]),  # pointwise into pointwise; cos is an output
        (lambda x, w: (x.sin().sum(),), ["sin"]),  # into a reduction
        (lambda x, w: (x.sin().t().cos(),), ["sin"]),  # read through a view
        (lambda x, w: (torch.mm(x.sin(), w),), []),  # into a matmul (an extern kernel)
        (lambda x, w: (torch.mm(x.sin().t(), w.t()),), []),  # into a matmul through a view
        (sin_and_its_cos, []),  # sin is read by cos but also leaves the graph
        (lambda x, w: (x.sin().exp().cos(),), ["exp", "sin"]),
        (lambda x, w: (torch.mm(x, w).relu(),), []),  # the matmul is not pointwise, relu is an output
    ],
    ids=["into-pointwise", "into-reduction", "through-view", "into-mm", "through-view-into-mm", "output",
         "chain", "mm-producer"],
)
def test_pointwise_values_read_only_by_pointwise_kernels_are_fused(fn, fused):
    assert fused_names(fn, torch.randn(8, 8), torch.randn(8, 8)) == fused


@pytest.mark.parametrize("extra_readers", [0, 1])
def test_more_readers_than_realize_reads_threshold_materialize_the_value(extra_readers):
    readers = torch._inductor.config.realize_reads_threshold + extra_readers

    def fn(x):
        a = x.sin()
        return (sum(a * (i + 2) for i in range(readers)),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8))
    sin = next(n for n in gm.graph.nodes if n.name == "sin")
    assert len(sin.users) == readers
    assert (sin in inductor_fusion(gm)) == (extra_readers == 0)


def test_realize_reads_threshold_is_read_from_the_inductor_config():
    def fn(x):
        a = x.sin()
        return (a * 2 + a * 3,)

    with torch._inductor.config.patch(realize_reads_threshold=1):
        assert fused_names(fn, torch.randn(8)) == ["mul", "mul_1"]
    assert fused_names(fn, torch.randn(8)) == ["mul", "mul_1", "sin"]


@pytest.mark.parametrize(
    ("fn", "fused"),
    [
        (lambda w, idx: (F.embedding(idx, w.sin()).cos(),), ["embedding", "sin"]),
        (lambda w, idx: (torch.gather(w.exp(), 1, idx).neg(),), ["exp", "gather"]),
        (lambda w, idx: (torch.mm(F.embedding(idx[0], w), w),), []),
    ],
    ids=["embedding", "gather", "embedding-into-mm"],
)
def test_gather_and_embedding_fuse_as_indexed_loads(fn, fused):
    assert fused_names(fn, torch.randn(8, 8), torch.randint(0, 8, (8, 8))) == fused


def test_fills_and_slice_scatters_are_lowered_as_pointwise():
    """The backward of slicing (zeros, then a scatter into a slice) runs as one pointwise kernel."""

    def slice_backward(grad, w):
        zeros = torch.ops.aten.full.default([8, 8], 0.0, dtype=torch.float32, layout=torch.strided, device="cpu")
        return (torch.ops.aten.slice_scatter.default(zeros, grad[:, :4], 1, 0, 4).exp(),)

    assert fused_names(slice_backward, torch.randn(8, 8), torch.randn(8, 8)) == ["full", "slice_scatter"]
