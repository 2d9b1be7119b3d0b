"""op_sites: each call of a Dynamo graph named as autocast's lists name it, with its modules and linear sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcs_testing import PrecisionToy, dynamo_graph
from dpcs_compiler.passes.analysis.op_sites import module_name, op_sites


@pytest.mark.parametrize(
    "path, root, name",
    [("L['self'].blocks.0.attn", "L['self']", "blocks.0.attn"),
     ("L['self']._modules['blocks']._modules['0']", "L['self']", "blocks.0"),
     ("L['self'].layers[3].mlp", "L['self']", "layers.3.mlp"),
     ("L['self']", "L['self']", ""),
     ("G['model'].head", "G['model']", "head"),
     ("G['trainer'].model.blocks[1]", "G['trainer'].model", "blocks.1")],
)
def test_module_names(path, root, name):
    assert module_name(path, root) == name


def test_ops_named_with_their_modules_and_linear_sizes():
    sites = op_sites(dynamo_graph(PrecisionToy(), torch.randn(4, 32)))
    assert [(s.op, s.modules) for s in sites] == [
        ("linear", ("", "proj")), ("layer_norm", ("", "norm")), ("matmul", ("",)), ("softmax", ("",)),
        ("linear", ("", "head")), ("mul", ("",)),
    ]
    head = sites[4].linear
    assert (head.in_features, head.out_features, head.tokens) == (32, 16, 4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.a(x))


GLOBAL_MODEL = Block()


def step_on_global(x):
    return GLOBAL_MODEL(x).sum()


def step_on_argument(model, x):
    return model(x).sum()


def test_a_compiled_function_names_modules_from_the_model_it_calls():
    x = torch.randn(2, 16)
    for gm in (dynamo_graph(step_on_global, x), dynamo_graph(step_on_argument, Block(), x)):
        assert [(s.op, s.module) for s in op_sites(gm)] == [("linear", "a"), ("linear", "head"), ("sum", "")]


def test_keyword_linear_and_python_operators():
    def f(x, w):
        return F.linear(input=x, weight=w), 2.0 / x, x ** 2, x @ w

    sites = op_sites(dynamo_graph(f, torch.randn(16, 32), torch.randn(32, 32)))
    assert [s.op for s in sites] == ["linear", "rtruediv", "pow", "matmul"]
    assert (sites[0].linear.in_features, sites[0].linear.out_features, sites[0].linear.tokens) == (32, 32, 16)
