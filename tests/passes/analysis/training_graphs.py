"""Toy training graphs for the analysis tests: AOTAutograd's joint graph and the partition of it.

A plain module, not a conftest: a second conftest.py would replace the `conftest` module that other tests
import their helpers from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import default_partition


@dataclasses.dataclass(frozen=True)
class TrainingGraphs:
    joint: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int


def trace_training(fn: Callable, *inputs: torch.Tensor, partition: Callable = default_partition) -> TrainingGraphs:
    """The joint graph AOTAutograd builds for one training step of `fn`, and `partition`'s split of it."""
    captured = {}

    def capture(joint, joint_inputs, **kwargs):
        captured["joint"], captured["num_fwd_outputs"] = joint, kwargs["num_fwd_outputs"]
        captured["forward"], captured["backward"] = partition(joint, joint_inputs, **kwargs)
        return captured["forward"], captured["backward"]

    def keep(gm, example_inputs):
        return make_boxed_func(gm)

    aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=capture)(*inputs)
    return TrainingGraphs(**captured)


def trace_module_training(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable, *, partition: Callable = default_partition
) -> TrainingGraphs:
    """`trace_training` of a module's step `loss_fn(model(*inputs))`, parameters first as primals."""
    names = [n for n, _ in model.named_parameters()]

    def step(*args: torch.Tensor) -> torch.Tensor:
        params = dict(zip(names, args[: len(names)]))
        return loss_fn(torch.func.functional_call(model, params, args[len(names) :]))

    return trace_training(step, *[p for _, p in model.named_parameters()], *inputs, partition=partition)
