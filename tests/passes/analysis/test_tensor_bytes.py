"""tensor_bytes: exact bytes per value; views allocate nothing and point into their base's buffer."""

from __future__ import annotations

import operator

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.passes.analysis import tensor_bytes
from dpcs_compiler.passes.analysis.tensor_bytes import hint_int

aten = torch.ops.aten


def only_output(gm):
    (value,) = gm.graph.output_node().args[0]
    return value


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes"),
    [(torch.float32, (8, 16), 512), (torch.float16, (8, 16), 256), (torch.int64, (3,), 24), (torch.bool, (5, 7), 35)],
)
def test_a_fresh_tensor_allocates_numel_times_element_size(dtype, shape, nbytes):
    gm = make_fx(lambda x: (x.clone(),), tracing_mode="fake")(torch.zeros(shape, dtype=dtype))
    x, clone = (n for n in gm.graph.nodes if n.op != "output")
    sizes = tensor_bytes(gm)
    for node in (x, clone):
        (buffer,) = sizes.allocations[node]
        assert (buffer.producer, buffer.index, buffer.size) == (node, None, nbytes)
        assert sizes.references[node] == sizes.allocations[node]
        assert sizes.nbytes(node) == nbytes
        assert sizes.nbytes_hint(node) == nbytes


@pytest.mark.parametrize(
    "make_view",
    [
        lambda x: x.view(16, 8),
        lambda x: x.t(),
        lambda x: x.permute(1, 0),
        lambda x: x[0:1].expand(4, 16),
        lambda x: aten._unsafe_view(x, [16, 8]),
        lambda x: torch.split(x, 4)[1],
        lambda x: x.detach(),
    ],
    ids=["view", "t", "permute", "slice-expand", "_unsafe_view", "split-getitem", "detach"],
)
def test_a_view_allocates_nothing_and_references_its_base(make_view):
    gm = make_fx(lambda x: (make_view(x),), tracing_mode="fake")(torch.randn(8, 16))
    x = next(iter(gm.graph.nodes))
    sizes = tensor_bytes(gm)
    assert sizes.nbytes(x) == 512
    for node in gm.graph.nodes:
        if node.op == "call_function":  # the view and any view it is built from (slice, split)
            assert sizes.allocations[node] == ()
            assert sizes.nbytes(node) == 0
            assert sizes.references[node] == sizes.allocations[x]
    assert only_output(gm).op == "call_function"


def test_the_result_of_copy_into_a_buffer_is_that_buffer():
    gm = make_fx(lambda x: (torch.zeros(8, 16).copy_(x),), tracing_mode="fake")(torch.randn(8, 16))
    x, zeros, copy = (n for n in gm.graph.nodes if n.op != "output")
    assert copy.target is aten.copy_.default
    sizes = tensor_bytes(gm)
    assert sizes.nbytes(zeros) == 512
    assert sizes.allocations[copy] == ()
    assert sizes.references[copy] == sizes.allocations[zeros]


@pytest.mark.parametrize(
    ("fn", "target", "output_bytes"),
    [
        (lambda x: (F.layer_norm(x, (16,)),), aten.native_layer_norm.default, (512, 32, 32)),  # out, mean, rstd
        (lambda x: x.max(dim=1), aten.max.dim, (32, 64)),  # float values, int64 indices
        (lambda x: torch.var_mean(x, dim=1), aten.var_mean.correction, (32, 32)),
    ],
    ids=["native_layer_norm", "max.dim", "var_mean"],
)
def test_a_multi_output_op_allocates_one_buffer_per_output_and_getitem_picks_one(fn, target, output_bytes):
    gm = make_fx(lambda x: tuple(fn(x)), tracing_mode="fake")(torch.randn(8, 16))
    (op,) = (n for n in gm.graph.nodes if n.target is target)
    sizes = tensor_bytes(gm)
    buffers = sizes.allocations[op]
    assert [(b.producer, b.index, b.size) for b in buffers] == [(op, i, n) for i, n in enumerate(output_bytes)]
    assert sizes.nbytes(op) == sum(output_bytes)
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert sorted(n.args[1] for n in getitems) == list(range(len(output_bytes)))
    for getitem in getitems:
        assert sizes.allocations[getitem] == ()
        assert sizes.references[getitem] == (buffers[getitem.args[1]],)


@pytest.mark.parametrize(
    ("size", "stride", "nbytes"),
    [
        ((4, 4), (8, 1), (3 * 8 + 3 * 1 + 1) * 4),  # rows padded to 8 elements: the last row needs only 4
        ((2, 3), (1, 4), (1 * 1 + 2 * 4 + 1) * 4),  # column-major with a padded column
        ((4, 4), (4, 1), 64),  # contiguous
    ],
)
def test_a_strided_allocation_takes_its_required_storage_length(size, stride, nbytes):
    gm = make_fx(lambda: (torch.empty_strided(size, stride),), tracing_mode="fake")()
    assert tensor_bytes(gm).nbytes(only_output(gm)) == nbytes


def test_symbolic_sizes_are_expressions_in_the_shape_symbols_and_hint_evaluates_them():
    def fn(x, w):
        return (torch.mm(x, w).sin(), x.view(x.shape[0] * 16))

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(8, 16), torch.randn(16, 4))
    nodes = {n.name: n for n in gm.graph.nodes}
    rows, inner = (d.node.expr for d in nodes["x_1"].meta["val"].shape)
    columns = nodes["w_1"].meta["val"].shape[1].node.expr
    sizes = tensor_bytes(gm)
    expected = {"x_1": 4 * rows * inner, "w_1": 4 * inner * columns, "mm": 4 * rows * columns, "sin": 4 * rows * columns}
    for name, expression in expected.items():
        assert sympy.expand(sizes.nbytes(nodes[name]) - expression) == 0
    assert {name: sizes.nbytes_hint(nodes[name]) for name in expected} == {"x_1": 512, "w_1": 256, "mm": 128, "sin": 128}
    assert sizes.hint(rows * columns + 3) == 35
    symbolic_scalars = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.SymInt)]
    assert symbolic_scalars and all(sizes.allocations[n] == () for n in symbolic_scalars)
    assert sizes.nbytes(nodes["view"]) == 0


def test_a_symbolic_size_without_a_shape_environment_cannot_be_hinted():
    with pytest.raises(ValueError, match="symbolic"):
        hint_int(4 * sympy.Symbol("s0"), None)
    assert hint_int(sympy.Integer(12), None) == 12
