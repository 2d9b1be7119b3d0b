"""Small reference models used by the example, the tests and the benchmarks.

Deliberately plain PyTorch: an MLP, a conv net, a minimal GPT (pre-norm blocks, causal
scaled-dot-product attention, optional dropout) and a model with a graph break in its forward.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 256, d_hidden: int = 512, d_out: int = 10, layers: int = 4) -> None:
        super().__init__()
        dims = [d_in] + [d_hidden] * (layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class ConvNet(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    block_size: int = 128
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class MiniGPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GraphBreakNet(nn.Module):
    """Two MLP halves with a graph break between them: Dynamo hands the backend two graphs."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.first = MLP(d, 2 * d, d, layers=2)
        self.second = MLP(d, 2 * d, 10, layers=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(torch.relu(x))


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its inputs and the loss that turns its output into a scalar for backward."""

    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: object  # Callable[[output], scalar tensor]


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


def workload(name: str, batch: int, *, layers: int = 2, seed: int = 0) -> Workload:
    """Reference workloads by name: "mlp" (batch = rows), "gpt" (batch = sequences of 128 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "mlp":
        return Workload(name, MLP(), (torch.randn(batch, 256, generator=generator),), _mean_square)
    if name == "gpt":
        cfg = GPTConfig(layers=layers)
        idx = torch.randint(0, cfg.vocab, (batch, cfg.block_size), generator=generator)
        return Workload(name, MiniGPT(cfg), (idx, torch.roll(idx, -1, dims=1)), _identity)
    raise ValueError(f"unknown workload {name!r}; valid choices: 'mlp', 'gpt'")
