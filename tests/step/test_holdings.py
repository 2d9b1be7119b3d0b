"""What a graph compiled in a step's first run counts of the compiled module beyond its own inputs
(`step/holdings.py::unseen_in_first_step`), on a module of three layers without compiling: the graph takes the
middle layer's parameters, eager code before it ran the first layer, the last layer is left to what follows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcs_compiler.step import holdings
from dpcs_compiler.step.holdings import unseen_in_first_step


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture
def three():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 64), nn.Linear(64, 8))
    x = model[0](torch.randn(4, 16))  # eager code before the graph: its input's history reads model[0]
    seen = {p.untyped_storage().data_ptr() for p in model[1].parameters()}
    return model, [x, *model[1].parameters()], seen


def test_the_parameters_it_does_not_take_are_alive_and_later_gradients_come_in_its_backward(three):
    model, inputs, seen = three
    alive, backward = unseen_in_first_step(model, inputs, seen)
    assert alive == _bytes(model[0]) + _bytes(model[2])
    # model[2]'s gradients are made before this graph's backward (its backward runs first); model[0]'s after.
    assert backward == _bytes(model[2])


def test_gradients_already_there_are_alive_throughout_and_frozen_parameters_get_none(three):
    model, inputs, seen = three
    model[2].weight.grad = torch.zeros_like(model[2].weight)
    model[2].bias.requires_grad_(False)
    alive, backward = unseen_in_first_step(model, inputs, seen)
    assert alive == _bytes(model[0]) + _bytes(model[2]) + model[2].weight.numel() * 4
    assert backward == 0


def test_a_walk_cut_short_counts_the_gradients_it_did_not_reach_in_the_backward(three, monkeypatch):
    model, inputs, seen = three
    monkeypatch.setattr(holdings, "AUTOGRAD_WALK_LIMIT", 1)  # the addmm node only: model[0]'s leaves not reached
    alive, backward = unseen_in_first_step(model, inputs, seen)
    assert backward == _bytes(model[0]) + _bytes(model[2])  # over, never under


def test_nothing_without_the_compiled_module_or_when_it_takes_everything(three):
    model, inputs, seen = three
    assert unseen_in_first_step(None, inputs, seen) == (0, 0)
    everything = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert unseen_in_first_step(model, inputs, everything) == (0, 0)
