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

import hashlib
import json
import re
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
    import torch.distributed as dist

    rank, _ = world()
    payload: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            payload = [("ok", compute())]
        except Exception as error:  # noqa: BLE001 - broadcast to the ranks waiting for it, then raised here
            failure = error
            payload = [("error", f"{type(error).__name__}: {error}")]
    with _disable_current_modes():  # object collectives pickle into real tensors, also under Dynamo's fake mode
        dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 could not resolve the {what} every rank plans with: {value}")
    return value


def smallest(value: int) -> int:
    """The smallest of every rank's `value`."""
    return min(every_rank(value))


def every_rank(value: T) -> list[T]:
    """Every rank's `value`, in rank order (one all_gather of objects)."""
    import torch.distributed as dist

    _, size = world()
    gathered: list[Any] = [None] * size
    with _disable_current_modes():
        dist.all_gather_object(gathered, value)
    return gathered


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
