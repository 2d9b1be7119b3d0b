"""FLOPs and bytes moved by every node of an aten graph.

FLOPs come from torch's own formulas (`torch.utils.flop_counter.flop_registry`, the table FlopCounterMode
uses), evaluated on the traced shapes with symbolic sizes replaced by their hints, and for the matmul and
attention ops torch has no formula for, from dpcs's (`EXTRA_FLOP_FORMULAS`: among them the attention CPU
graphs call, which would otherwise cost nothing to recompute); other ops without a formula (pointwise,
reductions, data movement) count zero FLOPs. Bytes read are the sizes of the distinct tensor
inputs; bytes written are the buffers the node allocates. Views read and write nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import bmm_flop, flop_registry, mm_flop, sdpa_backward_flop_count, sdpa_flop_count

from dpcs_compiler.passes.analysis.base import require
from dpcs_compiler.passes.analysis.tensor_bytes import TensorBytes, is_view, tensor_bytes, tensor_bytes_of, to_sympy
from dpcs_compiler.types import NodeCost


@dataclasses.dataclass(frozen=True)
class OpCost:
    per_node: dict[fx.Node, NodeCost]

    @property
    def total_flops(self) -> int:
        return sum(c.flops for c in self.per_node.values())


def _hinted_shape(value: object, sizes: TensorBytes) -> object:
    if isinstance(value, torch.Tensor):
        return torch.Size(sizes.hint(to_sympy(d)) for d in value.shape)
    if isinstance(value, torch.SymInt):
        return sizes.hint(to_sympy(value))
    return value


def _attention(query, key, value, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)  # as torch counts its GPU attention: causal masks not discounted


def _attention_backward(grad_out, query, key, value, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _matrix_vector(matrix, vector, *args: Any, **kwargs: Any) -> int:
    return 2 * matrix[0] * matrix[1]


def _dot(a, b, *args: Any, **kwargs: Any) -> int:
    return 2 * a[0]


def _addmv(bias, matrix, vector, *args: Any, **kwargs: Any) -> int:
    return _matrix_vector(matrix, vector)


def _addbmm(bias, a, b, *args: Any, **kwargs: Any) -> int:
    return bmm_flop(a, b)  # the batched products; their sum over the batch is not counted, as torch's baddbmm


def _extra_formulas() -> dict[Any, Any]:
    """Formulas, over shapes, for the matmul and attention ops `flop_registry` lacks (this torch's names only).
    The attention ops' argument order is torch's GPU ones' (query, key, value [B, H, S, D]; the backward's
    grad_out first), so torch's own counts apply."""
    names = {
        "_scaled_dot_product_flash_attention_for_cpu": _attention,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward,
        "_scaled_dot_product_fused_attention_overrideable": _attention,
        "_scaled_dot_product_fused_attention_overrideable_backward": _attention_backward,
        "mv": _matrix_vector,
        "dot": _dot,
        "addmv": _addmv,
        "addbmm": _addbmm,
        "_int_mm": mm_flop,
    }
    formulas = {}
    for name, formula in names.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and packet not in flop_registry:
            formulas[packet] = formula
    return formulas


EXTRA_FLOP_FORMULAS = _extra_formulas()


def node_flops(node: fx.Node, sizes: TensorBytes) -> int:
    packet = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function":
        return 0
    formula = flop_registry.get(packet) or EXTRA_FLOP_FORMULAS.get(packet)
    if formula is None:
        return 0

    def shape_of(arg: object) -> object:
        return _hinted_shape(arg.meta.get("val"), sizes) if isinstance(arg, fx.Node) else arg

    args, kwargs = pytree.tree_map(shape_of, (node.args, node.kwargs))
    out = pytree.tree_map(lambda v: _hinted_shape(v, sizes), node.meta.get("val"))
    # flop_registry entries map tensors to shapes themselves; shapes pass through unchanged.
    return int(formula(*args, out_val=out, **kwargs))


def op_cost(gm: fx.GraphModule, analyses: Any | None = None) -> OpCost:
    """The analysis: per-node FLOPs and bytes read/written."""
    sizes = require(analyses, tensor_bytes, gm)
    per_node = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_view(node):
            per_node[node] = NodeCost(0, 0, 0)
            continue
        read = 0
        for arg in dict.fromkeys(node.all_input_nodes):
            value = arg.meta.get("val")
            if isinstance(value, torch.Tensor):
                read += sizes.hint(tensor_bytes_of(value))
        per_node[node] = NodeCost(
            flops=node_flops(node, sizes),
            bytes_read=read,
            bytes_written=sizes.nbytes_hint(node),
        )
    return OpCost(per_node)
