"""Graphs traced under `torch.autocast` (bf16, CPU) planned under a memory budget: a plan that recomputes and a
plan that offloads each compile, train as eager does under autocast, and carry out what they decide (issue 57).

Under autocast a linear casts its weight to bf16 inside the graph, and the backward reads that cast through its
transpose, a view: a plan that offloaded the cast once fell back to plain Inductor ("cannot offload ...: it is a
forward node but not a tensor saved for backward"), the partition having saved the view instead."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn

from dpcs_testing import allowing_best_plan, dpcs_compile
from dpcs_compiler import DpcsFallbackWarning, clear_compile_records, compile_records
from dpcs_compiler.cost.profiles import BUILTIN_PROFILES
from dpcs_compiler.passes.rewrite.offload import OFFLOAD, RELOAD
from dpcs_compiler.stages import partition as partition_stage

# An H100 whose host link makes offload the cheaper way to free a value: copies hidden and free to issue, and
# memory traffic slow enough that making a cast again costs more than moving it out and back.
FAST_HOST_LINK = dataclasses.replace(
    BUILTIN_PROFILES["h100"][1], memory_bandwidth=1e9, host_to_device=1e13, device_to_host=1e13, offload_ops_s=0.0
)
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}


class FrozenBody(nn.Module):
    """A trainable input layer, a frozen wide body (a frozen backbone being fine-tuned) and a trainable side
    branch, whose backward runs first. The body's bf16 weight casts are alive from the forward to the backward,
    which reads them through their transposes to reach the input layer."""

    def __init__(self, d: int = 64, wide: int = 512) -> None:
        super().__init__()
        self.inp, self.body, self.out = nn.Linear(d, wide), nn.Linear(wide, wide), nn.Linear(wide, d)
        self.body.requires_grad_(False)
        self.out.requires_grad_(False)
        self.side_in, self.side_out = nn.Linear(d, wide), nn.Linear(wide, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(torch.relu(self.inp(x)))) + self.side_out(torch.tanh(self.side_in(x)))


def autocast_step(model: nn.Module, fn, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step of `fn` under bf16 autocast: the loss and the trainable parameters' gradients."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16):
        loss = fn(x).float().sum()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def planned_record(model: nn.Module, x: torch.Tensor, **options):
    """Compile afresh under autocast with these options and run one step: the training graph's record."""
    torch._dynamo.reset()
    clear_compile_records()
    with allowing_best_plan():  # any other dpcs warning fails the test
        autocast_step(model, dpcs_compile(model, **options), x)
    (record,) = [r for r in compile_records() if r.mode == "training"]
    return record


def planned_step(monkeypatch, model: nn.Module, x: torch.Tensor, **options):
    """Compile afresh under autocast with these options and train one step, beside eager under autocast from the
    same parameters: the step's numerics must match eager's. Returns the training graph's record and, for each
    time the offload ops were inserted, (forward, backward, the values offloaded)."""
    offloaded = []
    insert_offloads = partition_stage.insert_offloads

    def spy(forward, backward, offloads, **kwargs):
        insert_offloads(forward, backward, offloads, **kwargs)
        offloaded.append((forward, backward, dict(offloads)))

    monkeypatch.setattr(partition_stage, "insert_offloads", spy)
    torch._dynamo.reset()
    clear_compile_records()
    eager = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = autocast_step(model, dpcs_compile(model, keep_torch_plan=False, **options), x)
    assert not [w for w in caught if issubclass(w.category, DpcsFallbackWarning)]
    expected_loss, expected_grads = autocast_step(eager, eager, x)
    torch.testing.assert_close(loss, expected_loss, **BF16)
    for got, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, expected, **BF16)
    (record,) = [r for r in compile_records() if r.mode == "training"]
    assert record.fallback is None
    return record, offloaded


def test_a_recompute_plan_of_an_autocast_graph_matches_eager(monkeypatch):
    torch.manual_seed(0)
    model, x = FrozenBody(), torch.randn(1024, 64)
    lowest = planned_record(model, x, memory_budget=1, on_infeasible="best")
    highest = planned_record(model, x, memory_budget="1TiB", keep_torch_plan=False)
    budget = (lowest.predicted_peak_bytes + highest.predicted_peak_bytes) // 2
    record, offloaded = planned_step(monkeypatch, model, x, memory_budget=budget)
    assert record.plan_feasible and record.recomputed_values > 0
    assert record.offloaded_values == 0 and not offloaded  # the reference CPU has no host link


def test_an_offload_plan_of_an_autocast_graph_matches_eager_and_copies_what_it_offloads(monkeypatch):
    """The lowest plan under a profile that makes offload pay. (A CPU-traced graph keeps its host copies in the
    memory it is measured in, so offload plans are judged over their budget here, and compiled as the best.)"""
    torch.manual_seed(0)
    model, x = FrozenBody(), torch.randn(1024, 64)
    record, offloaded = planned_step(monkeypatch, model, x, memory_budget=1, on_infeasible="best",
                                     hardware_profile=FAST_HOST_LINK)
    forward, backward, offloads = offloaded[-1]  # the plan compiled (after the re-plans)
    assert record.offloaded_values == len(offloads) > 0
    copies = {n.args[0].name: n for n in forward.graph.nodes if n.target is OFFLOAD}
    reloads = {n.args[0].name for n in backward.graph.nodes if n.target is RELOAD}
    assert set(copies) == set(offloads) == reloads  # each value the plan offloads is copied out and back
    # Among them the body's bf16 weight cast, which the backward reads through its transpose.
    values = [copies[name].args[0].meta["val"] for name in offloads]
    assert any(v.dtype == torch.bfloat16 and tuple(v.shape) == (512, 512) for v in values)
