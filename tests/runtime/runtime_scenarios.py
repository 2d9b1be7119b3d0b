"""What the 2-rank runtime tests and their single-process references share (imported, not collected)."""

from __future__ import annotations

import torch


class Blocks(torch.nn.Module):
    """Two regions (blocks.0, blocks.1) and a head."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(2)
        )
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


# The forced decisions of each step of the DDP test: (precision, memory budget or None).
SWITCHES = [("fp32", None), ("bf16", None), ("bf16", "tight"), ("fp32", "tight"), ("fp32", None), ("bf16", "tight"),
            ("fp32", None)]
WIDTH = 512  # each block's Linear holds 1 MiB: DDP buckets of 1 MiB (the smallest DDPOptimizer takes) split the graph
TIGHT_BUDGET = 600_000  # bytes: below the per-rank graph's unplanned peak (663 kB), so its plan recomputes


def global_batch() -> torch.Tensor:
    return torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(1))


def apply_switch(runtime, switch) -> None:
    precision, budget = switch
    runtime.clear_overrides()
    runtime.force_precision(precision)
    if budget is not None:
        runtime.force_budget(TIGHT_BUDGET)
