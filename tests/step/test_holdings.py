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
    return model, [x, *model[1].parameters()]


def test_the_parameters_it_does_not_take_are_alive_and_later_gradients_come_in_its_backward(three):
    model, inputs = three
    alive, backward = unseen_in_first_step(model, inputs, follows=True)
    assert alive == _bytes(model[0]) + _bytes(model[2])
    # model[2]'s gradients are made before this graph's backward (its backward runs first); model[0]'s after.
    assert backward == _bytes(model[2])
    # A graph nothing follows: no other graph's backward runs before its own.
    assert unseen_in_first_step(model, inputs, follows=False) == (alive, 0)


def test_gradients_already_there_are_alive_throughout_and_frozen_parameters_get_none(three):
    model, inputs = three
    model[2].weight.grad = torch.zeros_like(model[2].weight)
    model[2].bias.requires_grad_(False)
    alive, backward = unseen_in_first_step(model, inputs, follows=True)
    assert alive == _bytes(model[0]) + _bytes(model[2]) + model[2].weight.numel() * 4
    assert backward == 0


def test_a_walk_cut_short_counts_the_gradients_it_did_not_reach_in_the_backward(three, monkeypatch):
    model, inputs = three
    monkeypatch.setattr(holdings, "AUTOGRAD_WALK_LIMIT", 1)  # the addmm node only: model[0]'s leaves not reached
    alive, backward = unseen_in_first_step(model, inputs, follows=True)
    assert backward == _bytes(model[0]) + _bytes(model[2])  # over, never under


def test_a_tied_weight_read_before_counts_its_gradient_a_later_graph_may_make(three):
    """A causal LM's output layer shares its embedding's weight: eager code before the graph reads it, and a
    later graph's backward makes its gradient before this graph's backward runs."""
    model, inputs = three
    model.add_module("head", nn.Linear(16, 32))
    model.head.weight = model[0].weight  # tied: one Parameter registered twice
    alive, backward = unseen_in_first_step(model, inputs, follows=True)
    assert alive == _bytes(model[0]) + _bytes(model[2]) + model.head.bias.numel() * 4
    assert backward == model[0].weight.numel() * 4 + _bytes(model[2]) + model.head.bias.numel() * 4


def test_earlier_calls_storages_and_the_graphs_own_are_not_counted_again(three):
    model, inputs = three
    assert unseen_in_first_step(model, inputs, follows=True, taken=[p.untyped_storage().data_ptr()
                                                                  for p in model[2].parameters()])[0] == _bytes(model[0])
    # A parameter it takes as a plain tensor (a view) is its own too.
    assert unseen_in_first_step(model, [*inputs, model[0].weight.detach()], follows=False)[0] == (
        _bytes(model[0]) - model[0].weight.numel() * 4 + _bytes(model[2]))


def test_nothing_without_the_compiled_module_or_when_it_takes_everything(three):
    model, inputs = three
    assert unseen_in_first_step(None, inputs, follows=True) == (0, 0)
    assert unseen_in_first_step(model, [*inputs, *model.parameters()], follows=True) == (0, 0)
