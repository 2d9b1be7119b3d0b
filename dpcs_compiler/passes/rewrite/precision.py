"""Cast the inputs of every op with a precision decision to that op's dtype, in the Dynamo graph.

Runs before AOTAutograd, so the backward is traced through the casts: a bf16 linear gets a bf16 weight
gradient cast back to the fp32 parameter's dtype, and the values saved for backward are the bf16 ones
(counted at their real size by the memory model). For each decided op (`Plan.precision_ops`), every
floating-point input in fp32, bf16 or fp16 that is not already in the decided dtype is cast to it with
`Tensor.to`; fp64 and integer inputs are left alone, as autocast leaves them. A value cast to one dtype
is cast once and shared by its readers (a weight read by two matmuls, a residual read by a norm and an
add) until an in-place op writes to any value, which drops every shared cast. Promote ops ("widest") get
their floating inputs cast to the widest of them. Ops without a decision run in the dtype their inputs
promote to.

What an op writes to is never cast (the write would land in a copy): an op whose mutated input is not
already in the decided dtype keeps all its inputs as they are (a bf16 model's BatchNorm updates its own
bf16 running statistics in bf16).

The dtypes the rewrite sees are the graph's own: an op whose inputs changed dtype is run again on
Dynamo's fake example values (without autograd), so its `example_value` shows the dtype it now computes
in; ops whose results hold no floating tensor are not run again (their dtype cannot change). Graphs with
higher-order ops (checkpoint regions, custom autograd functions, flex attention, control flow) or that
enter torch.autocast are refused with an error: their bodies would run in dtypes this rewrite does not see.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from dpcs_compiler.passes.analysis.op_sites import example_value, subgraph_calls
from dpcs_compiler.passes.infra import PassContext, Rewrite
from dpcs_compiler.solve.precision import WIDEST

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASTABLE = frozenset(DTYPES.values())


def refuse_unsupported(gm: fx.GraphModule) -> None:
    """Raise if the graph has regions whose dtypes a precision rewrite cannot see or set."""
    calls = subgraph_calls(gm)
    if calls:
        raise NotImplementedError(
            f"dpcs precision rewrites do not reach into the bodies of higher-order ops "
            f"({', '.join(str(n.target) for n in calls[:3])}: torch.utils.checkpoint regions, custom "
            "autograd.Function, flex_attention, control flow); compile such a model with 'precision' 'fp32' and "
            "no 'fp8' (for checkpointing, dpcs's memory_budget plans recomputation without checkpoint regions)"
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
    """Run the node on its inputs' example values again (no autograd), so its own shows the dtype it now
    computes in. Call under the graph's fake mode."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    with torch.no_grad():
        if node.op == "call_function":
            value = node.target(*args, **kwargs)
        elif node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = gm.get_submodule(node.target)(*args, **kwargs)
    node.meta["example_value"] = value


# Calls that write to arguments beyond an in-place method's `self` (position, keyword), in Dynamo graphs.
_WRITES = {
    "batch_norm": ((1, "running_mean"), (2, "running_var")),
    "instance_norm": ((1, "running_mean"), (2, "running_var")),
}
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
    operator.imod, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.setitem,
}


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The graph values a call writes to: an in-place method's or operator's self, `out=`, a norm's
    running statistics, an aten op's written arguments."""
    written: list[Any] = []
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op in ("call_method", "call_function") and node.args and (
        node.target in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
    ):
        written.append(node.args[0])
    written.append(node.kwargs.get("out"))
    for index, keyword in _WRITES.get(name, ()):
        written.append(node.args[index] if len(node.args) > index else node.kwargs.get(keyword))
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written.append(node.args[i] if i < len(node.args) else node.kwargs.get(argument.name))
    return [w for w in pytree.tree_leaves(written) if isinstance(w, fx.Node)]


def _dtypes(value: Any) -> list[torch.dtype | None]:
    return [v.dtype if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(value)]


def _has_float_result(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in pytree.tree_leaves(value))


def propagate_dtypes(gm: fx.GraphModule, cast_inputs: Callable[[fx.Node], bool] | None = None) -> bool:
    """Walk the graph in order, letting `cast_inputs(node)` rewrite a node's inputs, and re-derive the value
    of every node whose inputs changed dtype. Returns True if `cast_inputs` changed anything."""
    rewritten = False
    changed: set[fx.Node] = set()  # nodes whose example value now has other dtypes than traced
    with fake_mode_of(gm):
        for node in list(gm.graph.nodes):
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            cast = bool(cast_inputs(node)) if cast_inputs is not None else False
            rewritten |= cast
            stale = cast or any(i in changed for i in node.all_input_nodes) or node.meta.get("dpcs_stale", False)
            node.meta.pop("dpcs_stale", None)
            if not stale or not _has_float_result(example_value(node)):
                continue
            before = _dtypes(example_value(node))
            try:
                refresh_example_value(gm, node)
            except Exception as error:
                raise RuntimeError(f"after the precision rewrite, {node.format_node()} fails: {error}") from error
            if _dtypes(example_value(node)) != before:
                changed.add(node)
    return rewritten


def widest(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype a promote op computes in: fp32 if any input is fp32 or if bf16 meets fp16."""
    return next(iter(dtypes)) if len(dtypes) == 1 else torch.float32


class PrecisionCasts(Rewrite):
    """Insert `Tensor.to(dtype)` casts so each decided op computes in its dtype (`Plan.precision_ops`)."""

    name: ClassVar[str] = "precision_casts"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        decided = {d.node: d.dtype for d in ctx.plan.precision_ops if d.dtype in DTYPES or d.dtype == WIDEST}
        if not decided and not any(n.meta.get("dpcs_stale") for n in gm.graph.nodes):
            return False
        refuse_unsupported(gm)
        casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

        def cast(value: fx.Node, dtype: torch.dtype, reader: fx.Node) -> fx.Node:
            key = (value, dtype)
            if key not in casts:
                with gm.graph.inserting_before(reader):
                    made = gm.graph.call_method("to", (value, dtype))
                for field in ("nn_module_stack", "stack_trace"):
                    if field in reader.meta:
                        made.meta[field] = copy.copy(reader.meta[field])
                made.meta["example_value"] = example_value(value).to(dtype)
                casts[key] = made
            return casts[key]

        def castable(arg: Any) -> torch.dtype | None:
            value = example_value(arg)
            return value.dtype if isinstance(value, torch.Tensor) and value.dtype in CASTABLE else None

        def cast_inputs(node: fx.Node) -> bool:
            written = mutated_inputs(node)
            if written:
                casts.clear()  # a value read after this op may differ from its cast before it
            decision = decided.get(node.name)
            if decision is None:
                return False
            inputs = [a for a in node.all_input_nodes if castable(a) is not None]
            if decision == WIDEST:
                dtype = widest({castable(a) for a in inputs}) if inputs else None
            else:
                dtype = DTYPES[decision]
            if dtype is None or any(castable(w) not in (None, dtype) for w in written):
                return False  # what the op writes to cannot be cast: it runs as traced

            def convert(arg: fx.Node) -> fx.Node:
                return cast(arg, dtype, node) if castable(arg) not in (None, dtype) else arg

            before = (node.args, node.kwargs)
            node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), convert)
            return (node.args, node.kwargs) != before

        return propagate_dtypes(gm, cast_inputs)
