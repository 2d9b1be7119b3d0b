"""Cast the inputs of every op with a precision decision to that op's dtype, in the Dynamo graph.

Runs before AOTAutograd, so the backward is traced through the casts: a bf16 linear gets a bf16 weight
gradient cast back to the fp32 parameter's dtype, and the values saved for backward are the bf16 ones
(counted at their real size by the memory model). For each decided op (`Plan.precision_ops`), every
floating-point input in fp32, bf16 or fp16 that is not already in the decided dtype is cast to it with
`Tensor.to`; fp64 and integer inputs are left alone, as autocast leaves them. A value cast to one dtype
is cast once and shared by all its readers (a weight read by two matmuls, a residual read by a norm
and an add). Ops without a decision run in the dtype their inputs promote to.

The dtypes the rewrite sees are the graph's own: after casting an op's inputs, the op is run again on
Dynamo's fake example values, so its `example_value` (and every later op's) shows the dtype it now
computes in. Graphs that enter torch.autocast or call subgraphs (checkpoint regions, control flow) are
refused with an error: their bodies would run in dtypes this rewrite does not see.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from dpcs_compiler.passes.analysis.op_sites import example_value, subgraph_calls
from dpcs_compiler.passes.infra import PassContext, Rewrite

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASTABLE = frozenset(DTYPES.values())


def refuse_unsupported(gm: fx.GraphModule) -> None:
    """Raise if the graph has regions whose dtypes a precision rewrite cannot see or set."""
    calls = subgraph_calls(gm)
    if calls:
        raise NotImplementedError(
            f"dpcs precision rewrites do not reach into subgraphs ({', '.join(str(n.target) for n in calls[:3])}): "
            "torch.utils.checkpoint regions and control-flow ops inside the compiled model are not supported with "
            "'precision' other than 'fp32' or with 'fp8'; let dpcs plan recomputation (memory_budget) instead"
        )
    for node in gm.graph.nodes:
        if node.op == "call_function" and "autocast" in getattr(node.target, "__name__", ""):
            raise NotImplementedError(
                "the compiled model enters torch.autocast itself; with dpcs 'precision' or 'fp8' remove the autocast "
                "context from the model (dpcs sets the dtypes), or leave 'precision' at 'fp32'"
            )


def fake_mode_of(gm: fx.GraphModule) -> Any:
    """The fake mode of the graph's own example values (the backend's tracing context may hold another)."""
    for node in gm.graph.nodes:
        mode = getattr(example_value(node), "fake_mode", None)
        if mode is not None:
            return mode
    raise RuntimeError("the Dynamo graph carries no fake example values to derive dtypes from")


def refresh_example_value(gm: fx.GraphModule, node: fx.Node) -> None:
    """Run the node on its inputs' example values again, so its own shows the dtype it now computes in."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    if node.op == "call_function":
        value = node.target(*args, **kwargs)
    elif node.op == "call_method":
        value = getattr(args[0], node.target)(*args[1:], **kwargs)
    else:
        value = gm.get_submodule(node.target)(*args, **kwargs)
    node.meta["example_value"] = value


def reads_tensors(node: fx.Node) -> bool:
    """True if any input is a tensor or a container of tensors (a `split`'s result read by `getitem`)."""
    found = []
    fx.node.map_arg(
        (node.args, node.kwargs),
        lambda a: found.extend(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(example_value(a))),
    )
    return any(found)


def propagate_dtypes(gm: fx.GraphModule, cast_inputs: Any = None) -> bool:
    """Walk the graph in order, letting `cast_inputs(node)` rewrite a node's inputs, then re-deriving its value.

    Returns True if `cast_inputs` changed anything.
    """
    changed = False
    with fake_mode_of(gm):
        for node in list(gm.graph.nodes):
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            if cast_inputs is not None:
                changed |= bool(cast_inputs(node))
            if reads_tensors(node):
                try:
                    refresh_example_value(gm, node)
                except Exception as error:
                    raise RuntimeError(f"after the precision rewrite, {node.format_node()} fails: {error}") from error
    return changed


class PrecisionCasts(Rewrite):
    """Insert `Tensor.to(dtype)` casts so each decided op computes in its dtype (`Plan.precision_ops`)."""

    name: ClassVar[str] = "precision_casts"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        decided = {d.node: DTYPES[d.dtype] for d in ctx.plan.precision_ops if d.dtype in DTYPES}
        if not decided:
            return False
        refuse_unsupported(gm)
        casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

        def cast(value: fx.Node, dtype: torch.dtype, reader: fx.Node) -> fx.Node:
            key = (value, dtype)
            if key not in casts:
                with gm.graph.inserting_before(reader):
                    made = gm.graph.call_method("to", (value, dtype))
                made.meta["nn_module_stack"] = dict(reader.meta.get("nn_module_stack") or {})
                made.meta["example_value"] = example_value(value).to(dtype)
                casts[key] = made
            return casts[key]

        def cast_inputs(node: fx.Node) -> bool:
            dtype = decided.get(node.name)
            if dtype is None:
                return False

            def convert(arg: fx.Node) -> fx.Node:
                value = example_value(arg)
                if isinstance(value, torch.Tensor) and value.dtype in CASTABLE and value.dtype != dtype:
                    return cast(arg, dtype, node)
                return arg

            before = (node.args, node.kwargs)
            node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), convert)
            return (node.args, node.kwargs) != before

        return propagate_dtypes(gm, cast_inputs)
