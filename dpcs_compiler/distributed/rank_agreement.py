"""Rank agreement: every rank of a distributed job plans with the same inputs and compiles the same plan.

Plans that differ between ranks (different values recomputed or offloaded, different dtypes) make DDP's and
FSDP's gradients disagree or their collectives deadlock. A plan is a pure function of (graph, options,
hardware profile, budget), so with torch.distributed initialized:

- rank 0 resolves the hardware profile and broadcasts it (`from_rank_zero`): a rank's own cached profile,
  measured on its own, possibly busy or different, CPU or GPU, is never used;
- a budget given as a fraction of device memory or "auto" becomes the smallest over the ranks (`smallest`):
  the plan must fit on every one;
- after planning a training graph, the ranks compare plan hashes (`check_plans_agree`): one small
  collective per compiled graph, never per step; a mismatch raises `RankDisagreementError` on every rank,
  naming the graph, the ranks and what differs.

Every rank takes every collective path (an error on rank 0 is broadcast and raised everywhere, not raised
on rank 0 alone while the others wait). The collectives use the default process group, whose timeout
bounds how long a rank waits for one that compiles something else. All of this assumes every rank compiles
the same training graphs in the same order, as data-parallel training (DDP, FSDP) does; jobs whose ranks
compile different graphs (pipeline stages) pass the option rank_agreement=False.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pickle
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.utils._python_dispatch import _disable_current_modes

T = TypeVar("T")


class RankDisagreementError(RuntimeError):
    """The ranks of a distributed job compiled different plans (or different graphs) for one graph."""


def world() -> tuple[int, int] | None:
    """(rank, world size) when torch.distributed is initialized with more than one rank, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def from_rank_zero(compute: Callable[[], T], what: str) -> T:
    """Rank 0 runs `compute`; every rank returns its result, or raises if it failed on rank 0."""
    rank, _ = world()
    payload: Any = None
    failure: BaseException | None = None
    if rank == 0:
        try:
            payload = ("ok", compute())
        except Exception as error:  # noqa: BLE001 - broadcast to the ranks waiting for it, then raised here
            failure = error
            payload = ("error", f"{type(error).__name__}: {error}")
    status, value = _broadcast_object(payload)
    if status == "error":
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 could not resolve the {what} every rank plans with: {value}")
    return value


def smallest(value: int) -> int:
    """The smallest of every rank's `value`."""
    return min(every_rank(value))


# dpcs's object collectives are its own, not torch's `*_object` ones, for one reason. A gloo worker thread
# drops a finished collective's tensors while it holds its process group's queue lock; if Python dropped a
# tensor first, its Python object is freed there, which takes the GIL; and a collective issued meanwhile by a
# thread that holds the GIL waits for that lock: neither moves. Suspected from a 2-rank FSDP2 run, 1 in 36:
# one rank stuck inside `group.broadcast` itself for 120 s, beside two frameless Python threads (gloo's
# workers: they had taken the GIL before). torch's object collectives drop their tensors as soon as they
# return, right before the next collective; these keep them alive for the next few collectives
# (`_KEPT_TENSORS`), and let go of the GIL for a moment before each.
_KEPT_TENSORS: collections.deque[Any] = collections.deque(maxlen=32)
GLOO_PAUSE_S = 0.001


def _kept(tensor: Any) -> Any:
    _KEPT_TENSORS.append(tensor)
    return tensor


def _collective(run: Callable[[], Any]) -> None:
    time.sleep(GLOO_PAUSE_S)
    run()


def _to_bytes(value: Any) -> Any:
    import torch

    data = pickle.dumps(value)
    return _kept(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank (a broadcast of its length, then of its pickled bytes)."""
    import torch
    import torch.distributed as dist

    rank, _ = world()
    with _disable_current_modes():  # real tensors, also under Dynamo's fake mode
        data = _to_bytes(value) if rank == 0 else None
        length = _kept(torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64))
        _collective(lambda: dist.broadcast(length, src=0))
        if data is None:
            data = _kept(torch.empty(int(length.item()), dtype=torch.uint8))
        _collective(lambda: dist.broadcast(data, src=0))
        return pickle.loads(data.numpy().tobytes())


def every_rank(value: T) -> list[T]:
    """Every rank's `value`, in rank order (an all_gather of lengths, then of pickled bytes)."""
    import torch
    import torch.distributed as dist

    _, size = world()
    with _disable_current_modes():
        data = _to_bytes(value)
        length = _kept(torch.tensor([data.numel()], dtype=torch.int64))
        lengths = [_kept(torch.zeros(1, dtype=torch.int64)) for _ in range(size)]
        _collective(lambda: dist.all_gather(lengths, length))
        longest = max(int(n.item()) for n in lengths)
        padded = _kept(torch.zeros(longest, dtype=torch.uint8))
        padded[: data.numel()] = data
        gathered = [_kept(torch.empty(longest, dtype=torch.uint8)) for _ in range(size)]
        _collective(lambda: dist.all_gather(gathered, padded))
        return [pickle.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, lengths)]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_plans_agree(graph: str, graph_fingerprint: str, plan_fields: dict[str, Any]) -> None:
    """Compare this graph's plan across the ranks; raise `RankDisagreementError` on every rank if they differ.

    `plan_fields` is the plan as JSON without rank-local names (the graph's counter). The ranks first
    exchange a digest per field (small); only when one differs do they exchange the differing fields, so
    the error can say what differs.
    """
    rank, _ = world()
    mine = {"graph": graph, "fingerprint": graph_fingerprint, "fields": {k: _digest(v) for k, v in plan_fields.items()}}
    everyone = every_rank(mine)
    if any(g["fingerprint"] != everyone[0]["fingerprint"] for g in everyone):
        ranks = ", ".join(f"rank {r}: {g['graph']} (graph {g['fingerprint']})" for r, g in enumerate(everyone))
        raise RankDisagreementError(
            f"dpcs: the ranks compiled different graphs at the same point ({ranks}) while rank agreement compares "
            "the plans of the graphs every rank compiles in the same order; if the ranks compile different graphs by "
            "design (pipeline stages), pass the option rank_agreement=False and pin hardware_profile on every rank"
        )
    differing = sorted({k for g in everyone for k, d in g["fields"].items() if d != everyone[0]["fields"].get(k)})
    if not differing:
        return
    details = every_rank({k: plan_fields.get(k) for k in differing})  # every rank saw the same mismatch: all take it
    lines = []
    for other in range(1, len(everyone)):
        diffs = [_describe(k, details[0][k], details[other][k]) for k in differing if details[0][k] != details[other][k]]
        if diffs:
            lines.append(f"rank {other} differs from rank 0 in " + "; ".join(diffs))
    raise RankDisagreementError(
        f"dpcs compiled different plans for {graph} on different ranks (this is rank {rank}): " + " | ".join(lines)
        + ". Ranks that run different plans disagree on gradients or deadlock in collectives; every rank must get "
        "the same options, and with rank_agreement=True rank 0's hardware profile is used everywhere"
    )


def _describe(field: str, zero: Any, other: Any) -> str:
    """What differs in one plan field between rank 0 and another rank, in a line."""
    if isinstance(zero, list) and isinstance(other, list):
        if len(zero) != len(other):
            return f"{field} ({len(other)} entries vs {len(zero)} on rank 0)"
        changed = [(a, b) for a, b in zip(zero, other) if a != b]
        examples = ", ".join(_entry_difference(a, b) for a, b in changed[:3])
        return f"{field} ({len(changed)} of {len(zero)} differ: {examples})"
    return f"{field} ({other!r} vs {zero!r} on rank 0)"


def _entry_difference(zero: Any, other: Any) -> str:
    if isinstance(zero, dict) and isinstance(other, dict):
        name = zero.get("name", zero.get("node", "?"))
        keys = [k for k in zero if zero.get(k) != other.get(k)]
        return f"{name!r}: " + ", ".join(f"{k} {other.get(k)!r} vs {zero.get(k)!r}" for k in keys)
    return f"{other!r} vs {zero!r}"


def graph_fingerprint(code: str, example_inputs: Sequence[Any]) -> str:
    """Identity of a Dynamo graph across ranks: its code and its inputs' shapes, strides and dtypes, with
    device indices left out (rank 1's graph makes its tensors on cuda:1 where rank 0's makes them on cuda:0)."""
    import torch

    code = re.sub(r"device\(type='(\w+)', index=\d+\)", r"device(type='\1')", code)
    code = re.sub(r"(['\"])(\w+):\d+\1", r"\1\2\1", code)

    inputs = [
        (tuple(map(str, x.shape)), tuple(map(str, x.stride())), str(x.dtype)) if isinstance(x, torch.Tensor) else type(x).__name__
        for x in example_inputs
    ]
    return _digest([code, inputs])
