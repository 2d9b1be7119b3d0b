"""Small reference models used by the example, the tests and the benchmarks.

Deliberately plain PyTorch: an MLP, a conv net, a minimal GPT (pre-norm blocks, causal
scaled-dot-product attention, optional dropout) and a model with a graph break in its forward.
For `dpcs bench`: an MLP and a ResNet-style conv net made of checkpointable blocks, and a Llama built with
`transformers` from a config (random weights); `bench_workload` sizes them, `apply_activation_checkpointing`
checkpoints each block.
"""

from __future__ import annotations

import dataclasses
import io

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


class ResidualMLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class BranchingNet(nn.Module):
    """Three stacks of residual MLP blocks with two graph breaks between them, as real models make them: a
    branch on a tensor's value (`if h.sum() > 0`) and a `print`. Dynamo hands the backend three graphs per
    step; which middle graph runs depends on the data."""

    def __init__(self, d: int = 128, blocks: int = 2, log: object | None = None) -> None:
        super().__init__()
        self.first = nn.Sequential(*[ResidualMLPBlock(d) for _ in range(blocks)])
        self.middle = nn.Sequential(*[ResidualMLPBlock(d) for _ in range(blocks)])
        self.last = nn.Sequential(*[ResidualMLPBlock(d) for _ in range(blocks)])
        self.log = log if log is not None else io.StringIO()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if h.sum() > 0:  # data-dependent: a graph break
            h = self.middle(h)
        else:
            h = self.middle(-h)
        print("middle done", file=self.log)  # a graph break
        return self.last(h)


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
    """Reference workloads by name: "mlp" (batch = rows), "gpt" (batch = sequences of 128 tokens), "breaks"
    (`BranchingNet`: three graphs per step; batch = rows)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "mlp":
        return Workload(name, MLP(), (torch.randn(batch, 256, generator=generator),), _mean_square)
    if name == "gpt":
        cfg = GPTConfig(layers=layers)
        idx = torch.randint(0, cfg.vocab, (batch, cfg.block_size), generator=generator)
        return Workload(name, MiniGPT(cfg), (idx, torch.roll(idx, -1, dims=1)), _identity)
    if name == "breaks":
        return Workload(name, BranchingNet(blocks=layers), (torch.randn(batch, 128, generator=generator),), _mean_square)
    raise ValueError(f"unknown workload {name!r}; valid choices: 'mlp', 'gpt', 'breaks'")


def markov_text(vocab: int, batch: int, seq: int, steps: int, *, successors: int = 4, seed: int = 0
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of (tokens, next tokens) from a fixed random Markov chain in which each token is followed
    by one of `successors` tokens, uniformly: a language a model can learn, with a loss floor of
    log(successors) nats, for comparing optimizers over many steps (fresh batches, fixed by `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    follows = torch.randint(0, vocab, (vocab, successors), generator=generator)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
        choices = torch.randint(0, successors, (batch, seq), generator=generator)
        for t in range(seq):
            tokens[:, t + 1] = follows[tokens[:, t], choices[:, t]]
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def markov_gpt_final_loss(make_optimizer, steps: int = 200, *, seed: int = 0) -> float:
    """Train a 2-layer `MiniGPT` (d_model 64) `steps` steps of 8 sequences of `markov_text` with the optimizer
    `make_optimizer(parameters)` makes; the mean of its last 10 losses (the floor is log 4 = 1.386 nats)."""
    cfg = GPTConfig(vocab=128, block_size=64, d_model=64, heads=2, layers=2)
    torch.manual_seed(seed)
    model = MiniGPT(cfg)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for tokens, targets in markov_text(cfg.vocab, 8, cfg.block_size, steps, seed=seed):
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return sum(losses[-10:]) / len(losses[-10:])


# --- Benchmark models (`dpcs bench`) --------------------------------------------------------------------
#
# Each has a list of blocks (`checkpoint_blocks`) so the benchmark can apply eager full activation
# checkpointing per block (`apply_activation_checkpointing`) as a user would.


class BlockMLP(nn.Module):
    """An MLP made of blocks (Linear + GELU), so that per-block activation checkpointing saves memory.

    (`MLP` applies GELU between its Linear layers, outside them: checkpointing a bare Linear saves nothing.)
    """

    def __init__(self, d_in: int = 256, d_hidden: int = 512, d_out: int = 10, layers: int = 4) -> None:
        super().__init__()
        dims = [d_in] + [d_hidden] * (layers - 1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ResidualConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResConvNet(nn.Module):
    """A small ResNet-style conv net: a stem conv, `layers` residual blocks at one resolution, a linear head."""

    def __init__(self, channels: int = 32, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ResidualConvBlock(channels) for _ in range(layers))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


@dataclasses.dataclass(frozen=True)
class LlamaSize:
    vocab: int = 1000
    hidden: int = 256
    intermediate: int = 688
    layers: int = 4
    heads: int = 4
    seq: int = 128
    kv_heads: int | None = None  # grouped-query attention's key/value heads (None: one per head)


class LlamaLM(nn.Module):
    """`transformers.LlamaForCausalLM` built from a config with random weights (nothing is downloaded).

    forward(ids) returns the next-token cross entropy of the logits against the ids shifted by one.
    Needs the `transformers` package (imported when the model is built).
    """

    def __init__(self, size: LlamaSize = LlamaSize()) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            intermediate_size=size.intermediate,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.heads if size.kv_heads is None else size.kv_heads,
            max_position_embeddings=size.seq,
            use_cache=False,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        self.lm = LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class HFGPT2LM(nn.Module):
    """`transformers.GPT2LMHeadModel` built from a config with random weights (nothing is downloaded), trained
    with its own loss (`labels=`): Dynamo breaks its graph at the loss function, so a step is two graphs.

    forward(ids) returns the model's next-token loss. Needs the `transformers` package.
    """

    def __init__(self, layers: int = 4, d_model: int = 256, heads: int = 4, vocab: int = 2048, seq: int = 128) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=layers, n_embd=d_model, n_head=heads, vocab_size=vocab, n_positions=seq,
                            bos_token_id=vocab - 1, eos_token_id=vocab - 1, loss_type="ForCausalLM",
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic, like the others
                            attn_implementation="sdpa", use_cache=False)
        self.lm = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids, use_cache=False).loss


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks that full activation checkpointing per block wraps: transformer layers, residual blocks."""
    if isinstance(model, LlamaLM):
        return list(model.lm.model.layers)
    if isinstance(model, HFGPT2LM):
        return list(model.lm.transformer.h)
    if isinstance(model, (MiniGPT, BlockMLP, ResConvNet)):
        return list(model.blocks)
    if isinstance(model, BranchingNet):
        return [*model.first, *model.middle, *model.last]
    raise ValueError(
        f"no checkpoint blocks known for {type(model).__name__}; valid: MiniGPT, BlockMLP, ResConvNet, LlamaLM, "
        "BranchingNet, HFGPT2LM"
    )


def apply_activation_checkpointing(model: nn.Module, *, selective: bool = False) -> nn.Module:
    """Wrap each block's forward in `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, in place.

    Each block then saves only its inputs for backward and recomputes its forward during backward. With
    `selective`, torch's selective activation checkpointing instead: a policy (`sac_policy`) saves the
    outputs of matmuls and attention, and everything else in the block is recomputed. Apply it to the model
    that will run (a deepcopy made afterwards still calls the original's blocks).
    """
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, sac_policy) if selective else None
    for block in checkpoint_blocks(model):
        if getattr(block, "_dpcs_checkpointed", False):
            continue

        def checkpointed(*args, _forward=block.forward, **kwargs):
            if context_fn is None:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        block.forward = checkpointed
        block._dpcs_checkpointed = True
    return model


# Selective activation checkpointing's usual policy (torchtitan's): keep what is costly to make again.
SAC_SAVED_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention", "convolution",
)


def sac_policy(ctx, op, *args, **kwargs):
    """Save the outputs of matmuls, attention and convolutions; recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(getattr(op, "_overloadpacket", op), "__name__", str(op))
    return CheckpointPolicy.MUST_SAVE if name in SAC_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


BENCH_MODELS = ("mlp", "gpt", "llama", "convnet", "breaks", "hf_gpt2", "gpt_long")


def bench_workload(name: str, *, quick: bool = False, seed: int = 0) -> Workload:
    """The `dpcs bench` workloads: "mlp", "gpt" (4 layers; 2 when quick), "llama" (transformers, random init), "convnet",
    "breaks" (`BranchingNet`: two graph breaks, three graphs per step), "hf_gpt2" (`HFGPT2LM`, transformers,
    two graphs per step), "gpt_long" (the 4-layer GPT at sequence length 1024).

    Full sizes take ~50-300 ms per eager fp32 training step on a 2-core CPU, with peaks of tens to a few
    hundred MiB; `quick` sizes are tiny (tests). Every model's output is turned into a loss by `loss_fn`.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "mlp":
        d, batch, layers = (64, 64, 3) if quick else (512, 2048, 6)
        x = torch.randn(batch, d, generator=generator)
        return Workload(name, BlockMLP(d, d, 10, layers=layers + 1), (x,), _mean_square)
    if name == "gpt":
        cfg = GPTConfig(vocab=128, block_size=32, d_model=32, heads=2, layers=2) if quick else GPTConfig(
            vocab=512, block_size=128, d_model=256, heads=4, layers=4
        )
        batch = 2 if quick else 8
        idx = torch.randint(0, cfg.vocab, (batch, cfg.block_size), generator=generator)
        return Workload(name, MiniGPT(cfg), (idx, torch.roll(idx, -1, dims=1)), _identity)
    if name == "llama":
        size = LlamaSize(vocab=128, hidden=32, intermediate=88, layers=2, heads=2, seq=32) if quick else LlamaSize()
        batch = 2 if quick else 8
        ids = torch.randint(0, size.vocab, (batch, size.seq), generator=generator)
        return Workload(name, LlamaLM(size), (ids,), _identity)
    if name == "convnet":
        channels, layers, batch, hw = (8, 2, 4, 16) if quick else (32, 4, 32, 32)
        x = torch.randn(batch, 3, hw, hw, generator=generator)
        return Workload(name, ResConvNet(channels, layers), (x,), _mean_square)
    if name == "hf_gpt2":
        layers, d, heads, vocab, seq, batch = (2, 32, 2, 128, 32, 2) if quick else (4, 256, 4, 2048, 128, 8)
        ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        return Workload(name, HFGPT2LM(layers, d, heads, vocab, seq), (ids,), _identity)
    if name == "gpt_long":
        cfg = GPTConfig(vocab=128, block_size=128, d_model=32, heads=2, layers=2) if quick else GPTConfig(
            vocab=512, block_size=1024, d_model=256, heads=4, layers=4
        )
        batch = 2
        idx = torch.randint(0, cfg.vocab, (batch, cfg.block_size), generator=generator)
        return Workload(name, MiniGPT(cfg), (idx, torch.roll(idx, -1, dims=1)), _identity)
    if name == "breaks":
        d, blocks, rows = (32, 1, 64) if quick else (256, 2, 2048)
        x = torch.randn(rows, d, generator=generator)
        return Workload(name, BranchingNet(d, blocks), (x,), _mean_square)
    raise ValueError(f"unknown bench workload {name!r}; valid choices: {', '.join(map(repr, BENCH_MODELS))}")
