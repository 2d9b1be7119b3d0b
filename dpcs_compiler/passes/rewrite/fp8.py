"""Replace the linears the plan marks as fp8 regions with `ops.fp8.fp8_linear`, in the Dynamo graph.

Runs before AOTAutograd and before the precision casts: AOTAutograd traces `fp8_linear`'s autograd
function into plain ops (amax, scale, cast to float8, `_scaled_mm` or its emulation), forward and
backward, so Inductor fuses the scaling with its neighbours and the memory planner sees the fp8 values
(1 byte per element) saved for backward. The output is in the region's dtype (the `precision` option);
the weight stays in its own dtype for the optimizer and is cast anew in backward (no fp8 weight copy is
saved). The recipe, scaling margin and matmul implementation come from the plan's `Fp8Decision`.
"""

from __future__ import annotations

from typing import ClassVar

import torch.fx as fx

from dpcs_compiler.passes.analysis.op_sites import linear_operands
from dpcs_compiler.passes.infra import PassContext, Rewrite
from dpcs_compiler.passes.rewrite.precision import DTYPES, fake_mode_of, refresh_example_value, refuse_unsupported
from dpcs_compiler.ops.fp8 import fp8_linear


class Fp8Regions(Rewrite):
    """Turn each linear with an fp8 decision (`Plan.fp8_linears`) into an `fp8_linear` call."""

    name: ClassVar[str] = "fp8_regions"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        chosen = {d.node: d for d in ctx.plan.fp8_linears if d.fp8}
        if not chosen:
            return False
        refuse_unsupported(gm)
        # fp32 regions: the output in the input's dtype, as F.linear gives it (a bf16 model stays bf16).
        out_dtype = None if ctx.plan.precision == "fp32" else DTYPES[ctx.plan.precision]
        nodes = {n.name: n for n in gm.graph.nodes}
        for name, decision in chosen.items():
            node = nodes[name]
            node.target = fp8_linear
            node.args = linear_operands(node)
            node.kwargs = {
                "recipe": decision.recipe, "margin": decision.margin, "matmul": decision.matmul, "out_dtype": out_dtype,
                "grad_dtype": decision.grad_dtype,
                "weight_grad_dtype": DTYPES[decision.weight_grad_dtype] if decision.weight_grad_dtype else None,
            }
            with fake_mode_of(gm):
                refresh_example_value(gm, node)
            for user in node.users:
                # The precision casts re-derive these from the region's output dtype (they run next, and cast
                # what must agree, e.g. attention's query, key and value).
                user.meta["dpcs_stale"] = True
        return True
