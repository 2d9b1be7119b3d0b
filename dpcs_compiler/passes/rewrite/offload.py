"""Insert offload / reload / wait ops into a partitioned forward and backward pair.

For each saved value chosen for offloading, the forward copies it to host memory right after it is made and
hands the host copy to backward instead of the device tensor; the backward starts the reload at the prefetch
point the cost model chose and waits for it right before the first use:

    forward:  v = producer(...); host = dpcs.offload(v); ...last use of v...; dpcs.wait_offload(host, v)
              return (*user_outputs, ..., host, ...)
    backward: v (now the host copy); ...; dev = dpcs.reload(v, device)   (before `offloads[v]`)
              ...; dpcs.wait_tensor(dev); first use of dev; every other use reads dev too

`wait_offload` goes where v's device memory may be freed: after its last forward use by default, or later
(`release_after`) so that the copy has time to finish without stalling the compute stream. A value whose
storage belongs to a graph input gets none: the graph never frees or reuses it, and `record_stream` covers
the caller freeing it (see ops/offload_ops.py for the stream reasoning).

AOTAutograd pairs forward outputs and backward placeholders by name; the backward placeholder keeps its name
and now receives the host tensor. Saved values that are the same tensor under another name (an `alias` or
`detach` of it, which AOTAutograd saves next to e.g. a tanh output) share the one host copy and reload:
otherwise they would keep the device memory alive and the offload would free nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from dpcs_compiler.passes.analysis.tensor_bytes import is_view, tensor_bytes
from dpcs_compiler.ops import offload_ops  # noqa: F401  (registers the dpcs ops)

PASS_NAME = "offload"

OFFLOAD = torch.ops.dpcs.offload.default
WAIT_OFFLOAD = torch.ops.dpcs.wait_offload.default
RELOAD = torch.ops.dpcs.reload.default
WAIT_TENSOR = torch.ops.dpcs.wait_tensor.default
_ALIASES = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)


@dataclasses.dataclass(frozen=True)
class _Request:
    """One validated offload: the nodes it touches and where its ops go."""

    value: fx.Node
    aliases: tuple[fx.Node, ...]  # other saved values that are the same tensor (alias / detach of it)
    release_after: fx.Node | None  # forward node after which wait_offload goes; None: no wait needed
    placeholders: tuple[fx.Node, ...]  # backward inputs of value and aliases, value's first
    reload_before: fx.Node
    first_use: fx.Node


def insert_offloads(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    offloads: Mapping[str, str],
    *,
    release_after: Mapping[str, str] | None = None,
) -> None:
    """Offload each saved value `name` of `offloads` and reload it before the backward node `offloads[name]`.

    `release_after[name]` (optional) is the forward node after which the value's device memory may be freed;
    by default its last forward use. Saved aliases of a value go with it. Checks every request first
    (ValueError naming the value and the valid choices), then rewrites both graphs in place, lints and
    recompiles them.
    """
    release_after = dict(release_after or {})
    unknown = sorted(set(release_after) - set(offloads))
    if unknown:
        raise ValueError(f"release_after names values that are not offloaded: {unknown}; offloaded: {sorted(offloads)}")
    requests = [
        _validate(forward, backward, name, before, release_after.get(name)) for name, before in offloads.items()
    ]
    _check_requests(requests)
    for request in requests:
        _offload_in_forward(forward.graph, request)
        _reload_in_backward(backward.graph, request)
    if requests:
        for gm in (forward, backward):
            gm.graph.lint()
            gm.recompile()


def saved_value_names(forward: fx.GraphModule, backward: fx.GraphModule) -> list[str]:
    """Tensors the forward outputs and the backward receives as a placeholder of the same name (the saved ones)."""
    placeholders = {n.name for n in backward.graph.find_nodes(op="placeholder")}
    return [
        n.name
        for n in dict.fromkeys(_output_node(forward.graph).args[0])
        if isinstance(n, fx.Node) and n.name in placeholders and isinstance(n.meta.get("val"), torch.Tensor)
    ]


def _output_node(graph: fx.Graph) -> fx.Node:
    return graph.find_nodes(op="output")[0]


def _choices(names: Iterable[str], limit: int = 30) -> str:
    names = list(names)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return "[" + ", ".join(repr(n) for n in names[:limit]) + more + "]"


def _nodes_by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _validate(
    forward: fx.GraphModule, backward: fx.GraphModule, name: str, before: str, release: str | None
) -> _Request:
    """Resolve one request to nodes, or raise ValueError saying what is wrong and what would be valid."""
    fw_nodes, bw_nodes = _nodes_by_name(forward), _nodes_by_name(backward)
    saved = saved_value_names(forward, backward)
    if name not in saved and name in fw_nodes:
        # Saved only under another name: AOTAutograd hands backward an alias of it (a log_softmax output,
        # read by backward as `alias_2`). The plan names the buffer; the first saved alias carries it.
        root = _alias_root(fw_nodes[name])
        name = next((s for s in saved if _alias_root(fw_nodes[s]) is root), name)
    if name not in saved:
        what = "a forward node but not a tensor saved for backward" if name in fw_nodes else "not a forward node"
        raise ValueError(f"cannot offload {name!r}: it is {what}; saved values: {_choices(saved)}")
    value = fw_nodes[name]
    _check_layout(name, value.meta["val"])
    root = _alias_root(value)
    aliases = tuple(fw_nodes[s] for s in saved if s != name and _alias_root(fw_nodes[s]) is root)
    placeholders = (bw_nodes[name], *(bw_nodes[a.name] for a in aliases))
    order = {n: i for i, n in enumerate(backward.graph.nodes)}
    uses = [u for p in placeholders for u in p.users]
    if not uses:
        raise ValueError(f"cannot offload {name!r}: the backward never reads it")
    first_use = min(uses, key=order.__getitem__)
    points = [n for n in backward.graph.nodes if n.op != "placeholder" and order[n] <= order[first_use]]
    target = bw_nodes.get(before)
    if target is not None and target not in points and _only_views_between(backward, first_use, target):
        # The partition remade views of the value (a transposed weight cast) in backward just before the node
        # the plan reloads it for: they read the reload, and cost nothing to wait for.
        before = first_use.name
    if bw_nodes.get(before) not in points:
        target = bw_nodes.get(before)
        where = (
            "not a backward node" if target is None
            else "a backward input" if target.op == "placeholder"
            else f"after the first use {first_use.name!r}"
        )
        raise ValueError(
            f"cannot reload {name!r} before {before!r}: it is {where}; valid reload points: "
            f"{_choices(n.name for n in points)}"
        )
    release_after = _release_point(forward, value, release)
    return _Request(value, aliases, release_after, placeholders, bw_nodes[before], first_use)


def _only_views_between(backward: fx.GraphModule, first: fx.Node, last: fx.Node) -> bool:
    """Whether every node from `first` up to (not including) `last` is a view, which allocates nothing and
    takes no time: a reload before `first` then reaches `last` as soon as one before `last` would."""
    nodes = list(backward.graph.nodes)
    start, end = nodes.index(first), nodes.index(last)
    return start < end and all(is_view(n) for n in nodes[start:end])


def _check_requests(requests: Sequence[_Request]) -> None:
    """Two requests for the same tensor (one names an alias of the other) would copy it twice."""
    owner: dict[fx.Node, str] = {}
    for request in requests:
        for node in (request.value, *request.aliases):
            if node in owner:
                raise ValueError(
                    f"cannot offload both {owner[node]!r} and {request.value.name!r}: they are the same tensor "
                    f"(aliases {sorted(n.name for n in (request.value, *request.aliases))}); offload one of them"
                )
            owner[node] = request.value.name


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _ALIASES


def _alias_root(node: fx.Node) -> fx.Node:
    """The node an alias / detach chain starts from: the same tensor, with the same size and strides."""
    while _is_alias(node):
        node = node.args[0]
    return node


def _check_layout(name: str, val: object) -> None:
    """The host copy (empty_like) keeps the value's strides only for a dense tensor; refuse others."""
    if not isinstance(val, FakeTensor):
        raise ValueError(f"cannot offload {name!r}: its meta['val'] is not a FakeTensor")
    with val.fake_mode:
        host = OFFLOAD(val)
    same = all(
        statically_known_true(size == 1) or statically_known_true(a == b)
        for size, a, b in zip(val.shape, val.stride(), host.stride())
    )
    if not same:
        raise ValueError(
            f"cannot offload {name!r}: size {tuple(val.shape)} stride {val.stride()} is not dense; "
            f"its host copy would have stride {host.stride()}"
        )


def _release_point(forward: fx.GraphModule, value: fx.Node, release: str | None) -> fx.Node | None:
    """Where wait_offload goes: None for storage owned by a graph input, else `release` or the last use.

    The last use counts every alias / detach of the value; the saved aliases are copied with it.
    """
    owners = tensor_bytes(forward).references.get(value, ())
    if not owners or any(b.producer.op != "call_function" for b in owners):
        if release is not None:
            raise ValueError(
                f"cannot release {value.name!r}: its storage belongs to a graph input, which the graph never frees"
            )
        return None
    nodes = list(forward.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    same = _alias_closure(_alias_root(value))
    uses = [u for n in same for u in n.users if u.op != "output" and u not in same]
    last = max(uses, key=order.__getitem__, default=value)
    if order[last] < order[value]:
        last = value
    points = nodes[order[last] : order[_output_node(forward.graph)]]
    if release is None:
        return last
    chosen = next((n for n in points if n.name == release), None)
    if chosen is None:
        raise ValueError(
            f"cannot release {value.name!r} after {release!r}: it must be a forward node at or after the last "
            f"use {last.name!r}; valid release points: {_choices(n.name for n in points)}"
        )
    return chosen


def _alias_closure(root: fx.Node) -> set[fx.Node]:
    """The root and every alias / detach chain hanging off it."""
    found, todo = {root}, [root]
    while todo:
        for user in todo.pop().users:
            if _is_alias(user) and user not in found:
                found.add(user)
                todo.append(user)
    return found


def _stamp(node: fx.Node, val: object) -> fx.Node:
    """Give a created node its meta val (FakeTensor or None) and the dpcs pass stamp."""
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    node.meta["dpcs"] = {"pass": PASS_NAME}
    return node


def _offload_in_forward(graph: fx.Graph, request: _Request) -> None:
    """Copy the value to host right after it exists, wait at its release point, return the copy instead."""
    value = request.value
    val = value.meta["val"]
    after = graph.find_nodes(op="placeholder")[-1] if value.op == "placeholder" else value
    with graph.inserting_after(after):
        host = graph.create_node("call_function", OFFLOAD, (value,), name=f"offload_{value.name}")
    with val.fake_mode:
        _stamp(host, OFFLOAD(val))
    if request.release_after is not None:
        release = host if request.release_after is value else request.release_after
        with graph.inserting_after(release):
            wait = graph.create_node("call_function", WAIT_OFFLOAD, (host, value), name=f"wait_offload_{value.name}")
        _stamp(wait, None)
    output = _output_node(graph)
    outputs = list(output.args[0])
    for saved in (value, *request.aliases):
        # Saved values follow the user outputs: the last occurrence is the saved slot of a value that is both.
        outputs[len(outputs) - 1 - outputs[::-1].index(saved)] = host
    output.update_arg(0, type(output.args[0])(outputs))


def _reload_in_backward(graph: fx.Graph, request: _Request) -> None:
    """Make the placeholders host copies, reload at the prefetch point, wait right before the first use."""
    placeholder = request.placeholders[0]
    device_val = placeholder.meta["val"]
    uses = [(p, u) for p in request.placeholders for u in list(p.users)]
    with device_val.fake_mode:
        host_val = OFFLOAD(device_val)
        reloaded_val = RELOAD(host_val, device_val.device)
    for p in request.placeholders:
        p.meta["val"] = host_val
        if "tensor_meta" in p.meta:
            p.meta["tensor_meta"] = _extract_tensor_metadata(host_val)
    with graph.inserting_before(request.reload_before):
        reloaded = graph.create_node(
            "call_function", RELOAD, (placeholder, device_val.device), name=f"reload_{placeholder.name}"
        )
    _stamp(reloaded, reloaded_val)
    with graph.inserting_before(request.first_use):
        wait = graph.create_node("call_function", WAIT_TENSOR, (reloaded,), name=f"wait_{placeholder.name}")
    _stamp(wait, None)
    for p, user in uses:
        user.replace_input_with(p, reloaded)


def offload_nodes(gm: fx.GraphModule) -> Sequence[fx.Node]:
    """The nodes this pass created in a graph (for tests and dumps)."""
    return [n for n in gm.graph.nodes if n.meta.get("dpcs", {}).get("pass") == PASS_NAME]
