"""What the cadence rank tests and their single-process references share (imported, not collected)."""

from __future__ import annotations

import torch

ROUNDS = 3
SPEEDS = (1.0, 2.0)  # rank 1 twice as fast: with anchor 1 it runs 2 micro-batches per sync, rank 0 runs 1
LR = 0.1


class Net(torch.nn.Module):
    """Two linear layers with a buffer (DDP broadcasts rank 0's buffers), in float64: the gradients compare to
    ~1e-12, far below the difference an unweighted average makes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 16)
        self.second = torch.nn.Linear(16, 3)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.second(torch.tanh(self.first(x)))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def micro_batch(round_: int, rank: int, index: int, uneven: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch `index` of round `round_`: 2 + rank + index samples if `uneven` (the ranks and
    the micro-batches differ in size), else 3. (A compiled model gets even ones: a graph per shape, and rank
    agreement wants every rank to compile the same graphs.)"""
    generator = torch.Generator().manual_seed(1000 * round_ + 100 * rank + index)
    rows = 2 + rank + index if uneven else 3
    return (torch.randn(rows, 6, generator=generator, dtype=torch.float64),
            torch.randn(rows, 3, generator=generator, dtype=torch.float64))


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def round_batch(round_: int, counts: tuple[int, ...], uneven: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample every rank ran in a round, as one batch."""
    pairs = [micro_batch(round_, rank, index, uneven) for rank, count in enumerate(counts) for index in range(count)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
