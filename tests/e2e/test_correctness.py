"""Losses, gradients and outputs through dpcs match eager PyTorch, with both final compilers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dpcs_testing import COMPILERS, dpcs_compile
from dpcs_compiler import compile_records
from dpcs_compiler.models import MLP, ConvNet, GPTConfig, GraphBreakNet, MiniGPT

GPT = GPTConfig(vocab=128, block_size=32, d_model=64, heads=4, layers=2, dropout=0.0)


def _mlp():
    return MLP(32, 64, 10, layers=3), (torch.randn(16, 32),), lambda out: out.square().mean()


def _conv():
    return ConvNet(8), (torch.randn(4, 3, 16, 16),), lambda out: F.cross_entropy(out, torch.arange(4))


def _gpt():
    idx = torch.randint(0, GPT.vocab, (4, GPT.block_size))
    return MiniGPT(GPT), (idx, torch.roll(idx, 1, 1)), lambda loss: loss


def _graph_break():
    return GraphBreakNet(32), (torch.randn(8, 32),), lambda out: out.square().mean()


MODELS = {"mlp": _mlp, "convnet": _conv, "gpt": _gpt, "graph_break": _graph_break}
EXPECTED_GRAPHS = {"mlp": 1, "convnet": 1, "gpt": 1, "graph_break": 2}


def _train_step(model, inputs, loss_fn):
    """One step; gradients by the original module's parameter names (a compiled wrapper prefixes them)."""
    module = getattr(model, "_orig_mod", model)
    module.zero_grad(set_to_none=True)
    loss = loss_fn(model(*inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_matches_eager(name, compiler):
    model, inputs, loss_fn = MODELS[name]()
    reference = copy.deepcopy(model)
    compiled = dpcs_compile(model, compiler)
    for _ in range(2):  # the second step runs the cached compiled graphs
        loss, grads = _train_step(compiled, inputs, loss_fn)
        ref_loss, ref_grads = _train_step(reference, inputs, loss_fn)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for key in grads:
            torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5, msg=key)
    for buffer, ref_buffer in zip(model.buffers(), reference.buffers()):  # batch-norm running stats
        torch.testing.assert_close(buffer, ref_buffer, rtol=1e-4, atol=1e-5)
    records = compile_records()
    assert len(records) == EXPECTED_GRAPHS[name]
    assert all(r.mode == "training" and r.fallback is None and r.compiler == compiler for r in records)
    assert all(r.predicted_peak_bytes > r.resident_bytes > 0 and r.backward_nodes > 0 for r in records)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_inference_under_no_grad(compiler):
    model, inputs, _ = MODELS["gpt"]()
    compiled = dpcs_compile(model.eval(), compiler)
    with torch.no_grad():
        out = compiled(inputs[0])
        expected = model(inputs[0])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    (record,) = compile_records()
    assert record.mode == "inference" and record.backward_nodes == 0 and record.predicted_peak_bytes > 0


@pytest.mark.parametrize("compiler", COMPILERS)
def test_second_batch_size_recompiles_dynamic(compiler):
    model = MLP(32, 64, 10, layers=3)
    reference = copy.deepcopy(model)
    compiled = dpcs_compile(model, compiler)
    for batch in (8, 12, 20):
        x = torch.randn(batch, 32)
        loss, grads = _train_step(compiled, (x,), lambda out: out.square().mean())
        ref_loss, ref_grads = _train_step(reference, (x,), lambda out: out.square().mean())
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        for key in grads:
            torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5)
    records = compile_records()
    # First a static graph; the second batch size makes Dynamo compile one dynamic graph for all others.
    assert [r.symbolic_shapes for r in records] == [False, True]
    assert all(r.predicted_peak_bytes > 0 for r in records)


def test_dynamic_true_from_the_start():
    model, inputs, loss_fn = MODELS["gpt"]()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": True}, dynamic=True)
    loss, _ = _train_step(compiled, inputs, loss_fn)
    ref_loss, _ = _train_step(reference, inputs, loss_fn)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    (record,) = compile_records()
    assert record.symbolic_shapes
