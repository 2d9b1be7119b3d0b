"""Which values Inductor never materializes: a structural model of its pointwise fusion.

Inductor inlines a pointwise op (or an indexed load: gather, index, embedding) into the kernels that read
it when every reader is itself pointwise, an indexed load or a reduction (looking through views), the value is not a graph output, and it is read at most
`realize_reads_threshold` times; such a value gets no buffer. Everything else (matmul, conv, attention,
reductions' results, values feeding extern kernels or leaving the graph) is materialized. The memory
timeline treats a fused value as an alias of its inputs: they stay alive until its readers run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcs_compiler.passes.analysis.tensor_bytes import is_view


aten = torch.ops.aten
# Ops Inductor lowers as pointwise loads with indirect indexing: they fuse like pointwise ops.
INDEXED_LOADS = {aten.gather.default, aten.index.Tensor, aten.embedding.default}
# Ops without the pointwise tag that Inductor also lowers as pointwise computations: constant fills, and
# scatters into a slice (a `where` over the index), e.g. the backward of slicing logits for a shifted loss.
POINTWISE_LOWERINGS = {
    aten.full.default, aten.zeros.default, aten.ones.default, aten.full_like.default, aten.zeros_like.default,
    aten.ones_like.default, aten.slice_scatter.default, aten.select_scatter.default,
}


def _tagged(node: fx.Node, tag: torch.Tag) -> bool:
    return node.op == "call_function" and tag in getattr(node.target, "tags", ())


def is_pointwise(node: fx.Node) -> bool:
    return _tagged(node, torch.Tag.pointwise) or (
        node.op == "call_function" and (node.target in INDEXED_LOADS or node.target in POINTWISE_LOWERINGS)
    )


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read `node`'s data, looking through views."""
    readers = []
    for user in node.users:
        if is_view(user) and user.op == "call_function":
            readers.extend(_readers(user))
        else:
            readers.append(user)
    return readers


def inductor_fusion(gm: fx.GraphModule, analyses: Any | None = None) -> frozenset[fx.Node]:
    """The analysis: nodes whose results Inductor computes inside their readers' kernels."""
    threshold = torch._inductor.config.realize_reads_threshold
    fused = set()
    for node in gm.graph.nodes:
        if not is_pointwise(node) or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        readers = _readers(node)
        if not readers or len(readers) > threshold:
            continue
        if all(is_pointwise(r) or _tagged(r, torch.Tag.reduction) for r in readers):
            fused.add(node)
    return frozenset(fused)
