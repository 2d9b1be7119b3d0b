"""Bytes of every value of an aten-level FX graph, as storage allocations ("buffers").

A node that makes new tensors allocates one buffer per tensor it returns; a view or alias (any op whose
schema says its result aliases an input, `_unsafe_view`, `getitem` of a tuple) allocates nothing and
points into the buffers of its base. Sizes are sympy expressions in the graph's shape symbols, so they
stay exact under dynamic shapes; `hint` evaluates one with the values the symbols had when traced, or those
`size_hints` sets (a plan made for a larger size than the traced one).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator
from collections.abc import Iterable, Iterator
from typing import Any

import sympy
import torch
import torch._inductor.config
import torch.fx as fx
from torch._prims_common import compute_required_storage_length

aten = torch.ops.aten

# Ops whose schema does not declare an alias but whose result shares its input's storage in practice.
_UNDECLARED_VIEWS = {aten._unsafe_view.default, aten.lift_fresh.default}


@dataclasses.dataclass(frozen=True, eq=False)
class Buffer:
    """One storage allocation: output `index` of `producer` (index None for a single-tensor result)."""

    producer: fx.Node
    index: int | None
    size: sympy.Expr

    def __repr__(self) -> str:
        suffix = "" if self.index is None else f"[{self.index}]"
        return f"Buffer({self.producer.name}{suffix}, {self.size})"


def to_sympy(value: int | torch.SymInt) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def storage_bytes(tensor: torch.Tensor) -> sympy.Expr:
    """Bytes of a freshly allocated tensor with this shape, stride and dtype."""
    elements = compute_required_storage_length(tensor.shape, tensor.stride(), 0)
    return sympy.expand(to_sympy(elements) * tensor.element_size())


def tensor_bytes_of(tensor: torch.Tensor) -> sympy.Expr:
    """Bytes of the elements a tensor value covers (what an op reading it touches)."""
    return sympy.expand(to_sympy(tensor.numel()) * tensor.element_size())


def is_view(node: fx.Node) -> bool:
    """True if the node's result aliases an input's storage instead of allocating."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if node.target in _UNDECLARED_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(ret.alias_info is not None for ret in schema.returns)


def _tensors(value: Any) -> list[tuple[int | None, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    if isinstance(value, (list, tuple)):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _view_base(node: fx.Node) -> fx.Node | None:
    """The aliased input: `self`, the first tensor argument, of every aten view and in-place op."""
    return next((arg for arg in node.args if isinstance(arg, fx.Node)), None)


@dataclasses.dataclass(frozen=True)
class TensorBytes:
    """Result of the analysis: which buffers each node allocates and which each value points into."""

    allocations: dict[fx.Node, tuple[Buffer, ...]]
    references: dict[fx.Node, tuple[Buffer, ...]]
    shape_env: Any | None

    def nbytes(self, node: fx.Node) -> sympy.Expr:
        """Bytes the node allocates (zero for views, aliases and non-tensor values)."""
        return sympy.Add(*(b.size for b in self.allocations.get(node, ())))

    def hint(self, expr: sympy.Expr | int) -> int:
        """Evaluate a size with the values the shape symbols had at trace time."""
        return hint_int(expr, self.shape_env)

    def nbytes_hint(self, node: fx.Node) -> int:
        return self.hint(self.nbytes(node))


# Shape symbols (by name) evaluated at these values instead of their traced ones while planning a variant of a
# graph with dynamic shapes for a larger size (`runtime/variants.py`: one plan per size bucket).
_SIZE_HINTS: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("dpcs_size_hints", default={})


@contextlib.contextmanager
def size_hints(values: Iterable[tuple[str, int]]) -> Iterator[None]:
    """Evaluate the named shape symbols at `values` (pairs of name and size) inside the block."""
    token = _SIZE_HINTS.set(dict(values))
    try:
        yield
    finally:
        _SIZE_HINTS.reset(token)


def planned_sizes_override() -> dict[str, int]:
    """The shape symbols `size_hints` sets now, by name (empty: the traced sizes)."""
    return dict(_SIZE_HINTS.get())


def hint_int(expr: sympy.Expr | int, shape_env: Any | None) -> int:
    expr = sympy.sympify(expr)
    if not expr.free_symbols:
        return int(expr)
    if shape_env is None:
        raise ValueError(f"size {expr} is symbolic but the graph carries no shape environment to evaluate it")
    substitutions = {}
    overrides = _SIZE_HINTS.get()
    # torch 2.13 renamed var_to_val to backed_var_to_val (the old name warns); 2.11 has only the old one.
    known = shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val
    for symbol in expr.free_symbols:
        if symbol.name in overrides:
            substitutions[symbol] = overrides[symbol.name]
        elif symbol in known:
            substitutions[symbol] = known[symbol]
        else:  # an unbacked (data-dependent) size: use Inductor's fallback guess, as Inductor does
            substitutions[symbol] = torch._inductor.config.unbacked_symint_fallback
    return int(expr.xreplace(substitutions))


def find_shape_env(values: Iterable[Any]) -> Any | None:
    for value in values:
        for _, tensor in _tensors(value):
            for dim in (*tensor.shape, *tensor.stride()):
                if isinstance(dim, torch.SymInt):
                    return dim.node.shape_env
        if isinstance(value, torch.SymInt):
            return value.node.shape_env
    return None


def tensor_bytes(gm: fx.GraphModule, analyses: Any | None = None) -> TensorBytes:
    """The analysis: buffers allocated and referenced by every node of an aten graph with meta['val']."""
    allocations: dict[fx.Node, tuple[Buffer, ...]] = {}
    references: dict[fx.Node, tuple[Buffer, ...]] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        value = node.meta.get("val")
        if node.op == "call_function" and node.target is operator.getitem:
            parent, index = node.args
            parent_refs = references.get(parent, ())
            element = [b for b in allocations.get(parent, ()) if b.index == index]
            # getitem of a multi-output op picks that output's buffer; of a view-tuple (split) the base's.
            references[node] = tuple(element) if element else parent_refs
            allocations[node] = ()
            continue
        if is_view(node):
            base = _view_base(node)
            allocations[node] = ()
            references[node] = references.get(base, ()) if base is not None else ()
            continue
        buffers = tuple(Buffer(node, index, storage_bytes(t)) for index, t in _tensors(value))
        allocations[node] = buffers
        references[node] = buffers
    shape_env = find_shape_env(n.meta.get("val") for n in gm.graph.nodes)
    return TensorBytes(allocations=allocations, references=references, shape_env=shape_env)
