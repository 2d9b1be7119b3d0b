"""What the 2-rank step-budget tests and their single-process references share (imported, not collected)."""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 256  # each Linear holds 1 MiB: 2 MB DDP buckets split the stack mid-block, into 7 graphs


class LayerNormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class LayerNormStack(nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[LayerNormBlock(width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def global_batch() -> torch.Tensor:
    return torch.randn(1024, WIDTH, generator=torch.Generator().manual_seed(1))
