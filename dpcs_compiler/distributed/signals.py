"""Rank-consistent runtime decisions: signals combined over the ranks, decisions taken on rank 0.

Every read (every N steps, at the same step on every rank), each rank's signal vector is gathered in one
small collective and combined slot by slot (`signals.reduce_rule`: any overflow, mean statistics, largest
deviation, least headroom); rank 0 runs the policies on the combined signals and its decisions are
broadcast (`rank_agreement.from_rank_zero`), so every rank switches at the same step to the same variant and
compiles the same plans. Nothing runs per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from dpcs_compiler.distributed import rank_agreement

T = TypeVar("T")


def _collective_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def combine(vectors: Sequence[Sequence[float]], rules: Sequence[str]) -> list[float]:
    """Slot by slot: "max", "min" or "mean" over the ranks' vectors; a slot any rank does not know (-1) in a
    min is left out."""
    combined = []
    for slot, rule in enumerate(rules):
        values = [v[slot] for v in vectors]
        if rule == "max":
            combined.append(max(values))
        elif rule == "min":
            known = [x for x in values if x >= 0]
            combined.append(min(known) if known else -1.0)
        else:
            combined.append(sum(values) / len(values))
    return combined


def reduce_signals(vector: Sequence[float], rules: Sequence[str]) -> list[float]:
    """This rank's signal vector combined with every other rank's (one all_gather); itself without a job."""
    if rank_agreement.world() is None:
        return list(vector)
    import torch.distributed as dist

    _, size = rank_agreement.world()
    local = torch.tensor(list(vector), dtype=torch.float64, device=_collective_device())
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local)
    return combine([g.tolist() for g in gathered], rules)


def decide_on_rank_zero(decide: Callable[[], T]) -> T:
    """`decide()` on rank 0, its result on every rank; `decide()` itself without a job."""
    if rank_agreement.world() is None:
        return decide()
    return rank_agreement.from_rank_zero(decide, "the runtime's decisions")
