"""FLOPs and bytes moved by every node of an aten graph.

FLOPs come from torch's own formulas (`torch.utils.flop_counter.flop_registry`, the table FlopCounterMode
uses), evaluated on the traced shapes with symbolic sizes replaced by their hints; ops without a formula
(pointwise, reductions, data movement) count zero FLOPs. Bytes read are the sizes of the distinct tensor
inputs; bytes written are the buffers the node allocates. Views read and write nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry

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


def node_flops(node: fx.Node, sizes: TensorBytes) -> int:
    packet = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function" or packet not in flop_registry:
        return 0

    def shape_of(arg: object) -> object:
        return _hinted_shape(arg.meta.get("val"), sizes) if isinstance(arg, fx.Node) else arg

    args, kwargs = pytree.tree_map(shape_of, (node.args, node.kwargs))
    out = pytree.tree_map(lambda v: _hinted_shape(v, sizes), node.meta.get("val"))
    # flop_registry entries map tensors to shapes themselves; shapes pass through unchanged.
    return int(flop_registry[packet](*args, out_val=out, **kwargs))


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
