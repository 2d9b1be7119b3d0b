"""op_cost: exact FLOPs and bytes read and written per node."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.passes.analysis import op_cost
from dpcs_compiler.types import NodeCost


def cost_by_name(gm):
    return {node.name: cost for node, cost in op_cost(gm).per_node.items()}


@pytest.mark.parametrize(("m", "k", "n"), [(8, 16, 4), (1, 1, 1), (3, 5, 7)])
def test_mm_costs_two_flops_per_multiply_add(m, k, n):
    gm = make_fx(lambda a, b: (torch.mm(a, b),), tracing_mode="fake")(torch.randn(m, k), torch.randn(k, n))
    expected = NodeCost(flops=2 * m * k * n, bytes_read=4 * (m * k + k * n), bytes_written=4 * m * n)
    assert cost_by_name(gm) == {"mm": expected}


@pytest.mark.parametrize(("m", "k", "n"), [(8, 16, 4), (3, 5, 7)])
def test_addmm_counts_the_product_and_reads_the_bias(m, k, n):
    gm = make_fx(lambda bias, a, b: (torch.addmm(bias, a, b),), tracing_mode="fake")(
        torch.randn(n), torch.randn(m, k), torch.randn(k, n)
    )
    expected = NodeCost(flops=2 * m * k * n, bytes_read=4 * (n + m * k + k * n), bytes_written=4 * m * n)
    assert cost_by_name(gm) == {"addmm": expected}


def test_bmm_counts_every_batch():
    gm = make_fx(lambda a, b: (torch.bmm(a, b),), tracing_mode="fake")(torch.randn(2, 8, 16), torch.randn(2, 16, 4))
    assert cost_by_name(gm) == {"bmm": NodeCost(flops=2 * 2 * 8 * 16 * 4, bytes_read=4 * (256 + 128), bytes_written=256)}


@pytest.mark.parametrize(
    ("fn", "name", "expected"),
    [
        (lambda x: (x.sin(),), "sin", NodeCost(0, 512, 512)),
        (lambda x: (x + x,), "add", NodeCost(0, 512, 512)),  # one input read twice is read once
        (lambda x: (x.to(torch.float16),), "_to_copy", NodeCost(0, 512, 256)),
        (lambda x: (x.sum(1),), "sum_1", NodeCost(0, 512, 32)),
        (lambda x: (x.t(),), "t", NodeCost(0, 0, 0)),  # a view moves nothing
        (lambda x: (x.view(-1),), "view", NodeCost(0, 0, 0)),
    ],
    ids=["sin", "x+x", "to-half", "sum", "t", "view"],
)
def test_ops_without_a_flop_formula_only_move_bytes(fn, name, expected):
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16))
    assert cost_by_name(gm) == {name: expected}


def test_a_multi_output_op_writes_all_its_outputs_and_getitem_nothing():
    gm = make_fx(lambda x: tuple(x.max(dim=1)), tracing_mode="fake")(torch.randn(8, 16))
    assert cost_by_name(gm) == {
        "max_1": NodeCost(0, 512, 32 + 64),  # float values and int64 indices
        "getitem": NodeCost(0, 0, 0),
        "getitem_1": NodeCost(0, 0, 0),
    }


def test_total_flops_sums_the_nodes():
    gm = make_fx(lambda x, w1, w2: (torch.mm(torch.mm(x, w1).relu(), w2),), tracing_mode="fake")(
        torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4)
    )
    assert op_cost(gm).total_flops == 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4


def test_symbolic_shapes_are_costed_with_their_trace_time_values():
    gm = make_fx(lambda a, b: (torch.mm(a, b).sin(),), tracing_mode="symbolic")(torch.randn(8, 16), torch.randn(16, 4))
    assert isinstance(gm.graph.output_node().args[0][0].meta["val"].shape[0], torch.SymInt)
    assert cost_by_name(gm) == {
        "mm": NodeCost(flops=2 * 8 * 16 * 4, bytes_read=4 * (128 + 64), bytes_written=128),
        "sin": NodeCost(flops=0, bytes_read=128, bytes_written=128),
    }


def test_cpu_attention_counts_torchs_attention_flops_forward_and_backward():
    """The attention CPU graphs call has no formula in torch's table: without dpcs's, recomputing it looked free."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (2, 3, 16, 8)
    q, k, v = (torch.randn(shape) for _ in range(3))

    def attention(q, k, v, grad):
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, logsumexp, 0.0, True
        )
        return (out, *grads)

    costs = cost_by_name(make_fx(attention, tracing_mode="fake")(q, k, v, torch.randn(shape)))
    forward = costs["_scaled_dot_product_flash_attention_for_cpu"]
    backward = costs["_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert forward.flops == sdpa_flop_count(shape, shape, shape) == 4 * 2 * 3 * 16 * 16 * 8
    assert backward.flops == sdpa_backward_flop_count(shape, shape, shape, shape) > forward.flops


@pytest.mark.parametrize(
    ("fn", "shapes", "name", "flops"),
    [
        (torch.mv, [(8, 16), (16,)], "mv", 2 * 8 * 16),
        (torch.dot, [(16,), (16,)], "dot", 2 * 16),
        (torch.addmv, [(8,), (8, 16), (16,)], "addmv", 2 * 8 * 16),
        (torch.addbmm, [(8, 4), (3, 8, 16), (3, 16, 4)], "addbmm", 2 * 3 * 8 * 16 * 4),
    ],
    ids=["mv", "dot", "addmv", "addbmm"],
)
def test_matmuls_torch_has_no_formula_for_count_their_flops(fn, shapes, name, flops):
    gm = make_fx(lambda *xs: (fn(*xs),), tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    assert cost_by_name(gm)[name].flops == flops


def test_an_int8_matmul_counts_its_flops():
    a, b = (torch.randint(-5, 5, shape, dtype=torch.int8) for shape in ((32, 64), (64, 16)))
    gm = make_fx(lambda a, b: (torch._int_mm(a, b),), tracing_mode="fake")(a, b)
    assert cost_by_name(gm)["_int_mm"].flops == 2 * 32 * 64 * 16
