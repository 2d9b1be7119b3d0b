"""The ops of a Dynamo (pre-autograd) graph as the precision planner sees them: name, modules, linear sizes.

A Dynamo graph calls torch-level functions (`torch._C._nn.linear`, `F.layer_norm`, `operator.matmul`) and
tensor methods (`x.softmax(-1)`). Each call becomes an `OpSite`: the op's name as torch.autocast's op lists
spell it (`linear`, `layer_norm`, `pow`, `rtruediv` for `2 / x`), the modules it runs inside, from the
node's `nn_module_stack` metadata (outermost first, as `named_modules()` names them: `blocks.0.attn.qkv`),
and for a linear its in / out features and rows at the traced sizes. Read-only; the precision planner
(`solve/precision.py`) decides from these alone.
"""

from __future__ import annotations

import numbers
import operator
import re
from typing import Any

import torch
import torch.fx as fx

from dpcs_compiler.passes.analysis.tensor_bytes import find_shape_env, hint_int, to_sympy
from dpcs_compiler.types import LinearShape, OpSite

# Python operators whose method name autocast lists under another name.
_OPERATOR_NAMES = {
    operator.matmul: "matmul",
    operator.pow: "pow",
    operator.truediv: "truediv",
    operator.mul: "mul",
    operator.add: "add",
    operator.sub: "sub",
}
_METHOD_ALIASES = {"__matmul__": "matmul", "__pow__": "pow", "__rpow__": "rpow", "__rtruediv__": "rtruediv",
                   "__rdiv__": "rtruediv", "__truediv__": "truediv"}


def module_name(stack_path: str, root: str = "") -> str:
    """A module-stack path relative to the root module's, as `named_modules()` spells it:
    `L['self'].blocks[0]._modules['attn']` or `L['self'].blocks.0.attn` (root `L['self']`) -> `blocks.0.attn`."""
    path = stack_path[len(root):] if root and stack_path.startswith(root) else re.sub(r"^[LG]\['[^']*'\]", "", stack_path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]|\[(\d+)\]", lambda m: "." + (m.group(1) or m.group(2)), path)
    return path.lstrip(".")


def module_stack(node: fx.Node) -> tuple[str, ...]:
    """The modules a node runs in, outermost first, named relative to the root model: the module compiled
    (`L['self']`, never itself on the stack), or else the outermost module the compiled function called
    (`L['model']`, `G['model']`, `G['trainer'].model`). The root, "", comes first: every op runs in it."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    root = "L['self']" if paths and paths[0].startswith("L['self']") else paths[0] if paths else ""
    names = tuple(module_name(path, root) for path in paths)
    return names if names[:1] == ("",) else ("", *names)


def op_name(node: fx.Node) -> str | None:
    """The op's autocast-list name, or None for nodes that compute nothing (placeholders, output, attrs)."""
    if node.op == "call_method":
        return _METHOD_ALIASES.get(node.target, node.target)
    if node.op == "call_module":
        return f"module:{type(node.graph.owning_module.get_submodule(node.target)).__name__}"
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.truediv and isinstance(node.args[0], numbers.Number):
        return "rtruediv"
    if target is operator.pow and isinstance(node.args[0], numbers.Number):
        return "rpow"
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    return getattr(target, "__name__", None) or str(target)


def example_value(node: Any) -> Any:
    """The fake value Dynamo traced for a node (None for constants)."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def linear_operands(node: fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of a `torch._C._nn.linear` call, however its arguments were passed."""
    values = list(node.args) + [None] * (3 - len(node.args))
    for i, name in enumerate(("input", "weight", "bias")):
        if name in node.kwargs:
            values[i] = node.kwargs[name]
    return tuple(values)


def _linear_shape(node: fx.Node, shape_env: Any | None) -> LinearShape | None:
    x, weight, _ = (example_value(a) for a in linear_operands(node))
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    out_features, in_features = (hint_int(to_sympy(d), shape_env) for d in weight.shape)
    tokens = hint_int(to_sympy(x.numel()), shape_env) // max(in_features, 1)
    return LinearShape(in_features, out_features, tokens)


def subgraph_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """Calls whose body is another graph (higher-order ops: checkpoint regions, cond, ...)."""
    subgraphs = {n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule)}
    return [n for n in gm.graph.nodes if n.op == "call_function" and subgraphs.intersection(n.all_input_nodes)]


def op_sites(gm: fx.GraphModule, analyses: Any | None = None) -> tuple[OpSite, ...]:
    """The analysis: one OpSite per call of the Dynamo graph, in graph order."""
    shape_env = find_shape_env(example_value(n) for n in gm.graph.nodes if n.op == "placeholder")
    sites = []
    for node in gm.graph.nodes:
        name = op_name(node)
        if name is None:
            continue
        linear = _linear_shape(node, shape_env) if name == "linear" else None
        sites.append(OpSite(node.name, name, module_stack(node), linear))
    return tuple(sites)
