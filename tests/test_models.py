"""The benchmark models: forward and backward run, per-block activation checkpointing keeps gradients and
lowers the peak, and the Llama is built from a config without touching the network."""

from __future__ import annotations

import copy
import socket

import pytest
import torch

from dpcs_compiler.measure import measure_peak_memory
from dpcs_compiler.models import (
    BENCH_MODELS,
    BlockMLP,
    MiniGPT,
    ResConvNet,
    apply_activation_checkpointing,
    bench_workload,
    checkpoint_blocks,
    workload,
)

NEEDS_TRANSFORMERS = {"llama"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the network: Hugging Face offline, and any socket connection fails."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def _workload(name: str, quick: bool = True):
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    return bench_workload(name, quick=quick)


def _loss_and_grads(w, model=None):
    model = model or w.model
    model.zero_grad(set_to_none=True)
    loss = w.loss_fn(model(*w.inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", BENCH_MODELS)
def test_bench_model_forward_backward(name):
    w = _workload(name)
    loss, grads = _loss_and_grads(w)
    assert loss.ndim == 0 and torch.isfinite(loss)
    params = dict(w.model.named_parameters())
    assert set(grads) == set(params), "every parameter gets a gradient"
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert len(checkpoint_blocks(w.model)) >= 2


@pytest.mark.parametrize("name", BENCH_MODELS)
def test_activation_checkpointing_keeps_gradients_and_lowers_peak(name):
    w = _workload(name)
    plain = w.model
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain))
    if name == "convnet":  # BatchNorm in training mode: compare in eval mode, where recompute is exact
        plain.eval()
        checkpointed.eval()
    loss, grads = _loss_and_grads(w, plain)
    loss_ac, grads_ac = _loss_and_grads(w, checkpointed)
    torch.testing.assert_close(loss_ac, loss)
    assert grads_ac.keys() == grads.keys()
    for key in grads:
        torch.testing.assert_close(grads_ac[key], grads[key], rtol=1e-4, atol=1e-5)

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            w.loss_fn(model(*w.inputs)).backward()
        return run

    plain.train()
    checkpointed.train()
    for model in (plain, checkpointed):
        step(model)()
        model.zero_grad(set_to_none=True)
    _, peak = measure_peak_memory(step(plain))
    _, peak_ac = measure_peak_memory(step(checkpointed))
    assert peak_ac.peak_increase_bytes < peak.peak_increase_bytes


def test_apply_activation_checkpointing_is_idempotent():
    model = BlockMLP(8, 8, 2, layers=3)
    apply_activation_checkpointing(model)
    forwards = [block.forward for block in model.blocks]
    apply_activation_checkpointing(model)
    assert [block.forward for block in model.blocks] == forwards


def test_checkpoint_blocks_unknown_model():
    with pytest.raises(ValueError, match="no checkpoint blocks"):
        checkpoint_blocks(torch.nn.Linear(2, 2))


def test_bench_workload_unknown_name():
    with pytest.raises(ValueError, match="unknown bench workload 'resnet'"):
        bench_workload("resnet")


def test_full_size_bench_workloads():
    """The full sizes (built, not run): a >= 4-layer GPT, 4-layer Llama with the issue's dimensions."""
    gpt = bench_workload("gpt")
    assert isinstance(gpt.model, MiniGPT) and gpt.model.cfg.layers >= 4
    mlp = bench_workload("mlp")
    assert isinstance(mlp.model, BlockMLP) and len(mlp.model.blocks) >= 4
    conv = bench_workload("convnet")
    assert isinstance(conv.model, ResConvNet) and conv.inputs[0].shape[1] == 3
    pytest.importorskip("transformers")
    llama = bench_workload("llama")
    config = llama.model.lm.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size,
            config.vocab_size) == (256, 4, 4, 688, 1000)
    assert config._attn_implementation == "sdpa"
    assert llama.inputs[0].shape == (8, 128)


def test_llama_is_random_init_and_seeded():
    pytest.importorskip("transformers")
    a = bench_workload("llama", quick=True, seed=1)
    b = bench_workload("llama", quick=True, seed=1)
    c = bench_workload("llama", quick=True, seed=2)
    pa, pb, pc = (dict(w.model.named_parameters()) for w in (a, b, c))
    name = "lm.model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(pa[name], pb[name])
    assert not torch.equal(pa[name], pc[name])


def test_reference_workloads_unchanged():
    """The existing workloads other tests use keep their models and shapes."""
    mlp = workload("mlp", 16)
    assert type(mlp.model).__name__ == "MLP" and mlp.inputs[0].shape == (16, 256)
    gpt = workload("gpt", 2)
    assert isinstance(gpt.model, MiniGPT) and gpt.model.cfg.layers == 2 and gpt.inputs[0].shape == (2, 128)
