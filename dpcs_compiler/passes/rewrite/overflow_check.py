"""Make the backward graph raise the device-side overflow flag when a gradient it returns is inf or NaN.

Runs on the AOTAutograd backward graph after partitioning, so recomputation and offload rewrites have
already placed their nodes and do not matter: the check reads the gradients exactly as the backward returns
them. Under GradScaler these are still loss-scaled, and a non-finite value there is exactly what makes
GradScaler skip the step. One `dpcs.note_nonfinite([g1, g2, ...])` goes right before the output, over every
floating-point output (decided from `meta["val"]`); see `ops/overflow.py` for the flag and its readers.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dpcs_compiler.passes.infra import PassContext, Rewrite
from dpcs_compiler.ops.overflow import NOTE_NONFINITE


def floating_outputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's outputs whose `meta["val"]` is a floating-point tensor, each once, in output order."""
    (output,) = gm.graph.find_nodes(op="output")
    outputs: list[fx.Node] = []
    fx.node.map_arg(output.args, outputs.append)
    return [
        node
        for node in dict.fromkeys(outputs)
        if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].is_floating_point()
    ]


class OverflowCheck(Rewrite):
    """Insert `dpcs.note_nonfinite` over the floating-point gradients, before the output, if the plan asks."""

    name = "overflow_check"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        if not ctx.plan.detect_overflow:
            return False
        if gm.graph.find_nodes(op="call_function", target=NOTE_NONFINITE):
            return False  # already checked (the rewrite ran on this graph before)
        grads = floating_outputs(gm)
        if not grads:
            return False
        (output,) = gm.graph.find_nodes(op="output")
        with gm.graph.inserting_before(output):
            note = gm.graph.call_function(NOTE_NONFINITE, (grads,))
        note.meta["val"] = None
        return True
