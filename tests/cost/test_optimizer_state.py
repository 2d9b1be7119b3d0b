"""cost/optimizer_state: the state torch's optimizers make at their first step, counted before it."""

from __future__ import annotations

import pytest
import torch

from dpcs_compiler.cost.optimizer_state import PARAMETER_SHAPED_STATES, anticipated_state_bytes, state_now_bytes

OPTIMIZERS = [
    ("Adam", {}), ("Adam", {"amsgrad": True}), ("AdamW", {}), ("AdamW", {"amsgrad": True}), ("Adamax", {}),
    ("NAdam", {}), ("RAdam", {}), ("Adadelta", {}), ("Adagrad", {}), ("RMSprop", {}),
    ("RMSprop", {"momentum": 0.9, "centered": True}), ("SGD", {}), ("SGD", {"momentum": 0.9}), ("Rprop", {}),
    ("ASGD", {}),
]


def _net() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    net[2].bias.requires_grad_(False)  # frozen: never gets state
    return net


@pytest.mark.parametrize("name, settings", OPTIMIZERS, ids=[f"{n}{s or ''}" for n, s in OPTIMIZERS])
def test_the_anticipated_state_is_the_state_the_first_step_makes(name, settings):
    net = _net()
    optimizer = getattr(torch.optim, name)(net.parameters(), lr=1e-3, **settings)
    anticipated, known = anticipated_state_bytes(optimizer)
    assert known
    net(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    assert state_now_bytes(optimizer) == anticipated
    assert anticipated_state_bytes(optimizer) == (anticipated, True)  # after the step: what it holds


def test_adamw_anticipates_two_moments_of_each_trained_parameter_and_nothing_for_a_frozen_one():
    net = _net()
    trained = sum(p.numel() * 4 for p in net.parameters() if p.requires_grad)
    assert anticipated_state_bytes(torch.optim.AdamW(net.parameters()))[0] == 2 * trained
    assert anticipated_state_bytes(torch.optim.SGD(net.parameters(), lr=0.1))[0] == 0


def test_an_optimizer_not_of_torchs_is_counted_as_it_is_and_said_unknown():
    class Mine(torch.optim.SGD):
        pass

    Mine.__module__ = "my_project.optim"
    assert anticipated_state_bytes(Mine(_net().parameters(), lr=0.1)) == (0, False)
    assert "Adam" in PARAMETER_SHAPED_STATES


def test_a_wrapper_sharing_an_optimizers_state_is_counted_once_through_it():
    """accelerate's AcceleratedOptimizer (the Trainer's) is an Optimizer whose state is its inner one's: the
    step counts the state once (`step/holdings.py::_state_bytes`), and never warns that the wrapper is unknown."""
    from dpcs_compiler.step.holdings import _state_bytes

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):  # as accelerate's: no Optimizer.__init__, the inner one's state
            self.optimizer = optimizer

        @property
        def state(self):
            return self.optimizer.state

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    inner = torch.optim.AdamW(_net().parameters())
    expected = anticipated_state_bytes(inner)[0]
    assert _state_bytes([Wrapper(inner), inner]) == _state_bytes([inner, Wrapper(inner)]) == expected
