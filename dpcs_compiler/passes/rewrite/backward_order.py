"""Sink a backward graph's nodes toward their first reader where no buffer then lives longer.

Autograd's order of a backward computes a block's input gradient before its weight gradient, and the
partition puts a recomputed value right before its first reader. In a transformer's MLP backward under full
recomputation that is (the bench GPT, 4 layers, its lowest plan):

    mm_27 = grad_h @ W2.T          # d(gelu output): 4 MiB, read only by the GELU backward below
    addmm_2 = x @ W1 + b1          # recomputed: 4 MiB
    mul_6 = gelu(addmm_2)          # recomputed: 4 MiB
    mm_28 = grad_h.T @ mul_6       # W2's gradient: the step's peak, all three alive
    ... the GELU backward reads mm_27 and addmm_2

Moved to just before the GELU backward, `mm_27` is made after `mul_6` died: the peak drops by 4 MiB.

`sunk_order` moves each pure op (last first) to just before the earliest of its first reader and the last
other reader of each buffer it reads (through views; a resident input's buffer, a parameter, is never freed).
Then no buffer lives longer, the op's output lives less, and where it now runs the bytes alive are those
that were alive there before, its output included: by the step's memory model the peak cannot rise. The
compile keeps the new order only if its simulated backward peaks lower (`stages/partition.py`); Inductor's
own reordering starts from it and keeps it unless its estimate finds a lower one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _movable(node: fx.Node) -> bool:
    if node.op != "call_function" or not node.users or node.is_impure():
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False  # dpcs's own ops (offload, reload, waits) and anything with effects stay where they are
    return not target.is_view and torch.Tag.nondeterministic_seeded not in target.tags


def sunk_order(graph: fx.Graph, resident: frozenset[str] = frozenset()) -> list[fx.Node]:
    """The graph's nodes, each pure op moved as late as it goes without making a buffer live longer (module
    docs); a topological order. `resident`: placeholder names whose buffers the graph never frees."""
    nodes = list(graph.nodes)
    # Each node's buffer: a view's is its base's. A buffer's readers are the nodes that read it or a view of
    # it, views aside (a view reads nothing; its readers do).
    root: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        base = n.args[0] if _is_view(n) and n.args and isinstance(n.args[0], fx.Node) else None
        root[n] = root[base] if base is not None else n
        if not _is_view(n):
            for i in n.all_input_nodes:
                readers.setdefault(root[i], []).append(n)
    # A doubly linked order with float keys (an insertion takes the middle of its gap; exhausted: relabel).
    prev = {n: (nodes[i - 1] if i else None) for i, n in enumerate(nodes)}
    nxt = {n: (nodes[i + 1] if i + 1 < len(nodes) else None) for i, n in enumerate(nodes)}
    key = {n: float(i) for i, n in enumerate(nodes)}
    head = [nodes[0]] if nodes else [None]

    def relabel() -> None:
        n, i = head[0], 0.0
        while n is not None:
            key[n], n, i = i, nxt[n], i + 1.0

    def unlink(n: fx.Node) -> None:
        p, q = prev[n], nxt[n]
        if p is None:
            head[0] = q
        else:
            nxt[p] = q
        if q is not None:
            prev[q] = p

    def insert_before(n: fx.Node, u: fx.Node) -> None:
        p = prev[u]
        low = key[p] if p is not None else key[u] - 2.0
        k = (low + key[u]) / 2
        if not low < k < key[u]:
            relabel()
            low = key[p] if p is not None else key[u] - 2.0
            k = (low + key[u]) / 2
        prev[n], nxt[n], prev[u] = p, u, n
        if p is None:
            head[0] = n
        else:
            nxt[p] = n
        key[n] = k

    for n in reversed(nodes):
        if not _movable(n):
            continue
        limits = list(n.users)
        frees = False
        for i in n.all_input_nodes:
            buffer = root[i]
            if buffer.op == "placeholder" and buffer.name in resident:
                continue
            later = [r for r in readers.get(buffer, ()) if r is not n and key[r] > key[n]]
            if not later:
                frees = True  # its last reader: moved, the buffer would live longer
                break
            limits.append(max(later, key=key.__getitem__))  # it may pass the others, not the last
        if frees:
            continue
        target = min(limits, key=key.__getitem__)
        if prev[target] is n:
            continue
        unlink(n)
        insert_before(n, target)
    order, n = [], head[0]
    while n is not None:
        order.append(n)
        n = nxt[n]
    return order


def apply_order(graph: fx.Graph, order: Sequence[fx.Node]) -> bool:
    """Put the graph's nodes in `order` (a permutation of them); True if anything moved."""
    current = list(graph.nodes)
    if len(order) != len(current) or set(order) != set(current):
        raise ValueError("an order must hold every node of the graph once")
    if list(order) == current:
        return False
    if order[0] is not current[0]:
        current[0].prepend(order[0])
    for before, n in zip(order, order[1:]):
        if before.next is not n:
            before.append(n)
    graph.lint()
    return True
