"""One budget for activations and optimizer state (the small GPT of the main job, through dpcs): the optimizer's
state is counted in the step's peak, a budget below what activation plans can reach with fp32 AdamW state is
refused naming the smallest peak and its split, and met (measured) when dpcs may choose how a
CompressedOptimizer(states="auto") keeps its state."""

from __future__ import annotations

import torch

from dpcs_compiler.measure import measure_peak_memory, optimizer_state_bytes, resident_bytes
from dpcs_compiler.models import workload
from dpcs_compiler.report import step_records
from dpcs_compiler.runtime import CompressedOptimizer
from dpcs_compiler.stages.job import BudgetInfeasibleError
from dpcs_testing import dpcs_compile

STEPS = 5  # the first plans, the step planned with the optimizer's state once it exists, then steady


def train(budget: int, auto: bool, on_infeasible: str = "error") -> dict:
    """STEPS training steps; the forward and backward of one more, measured (its absolute peak: parameters,
    the input and the optimizer's state on the device counted in)."""
    w = workload("gpt", 4, layers=2)
    plain = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    optimizer = CompressedOptimizer(plain, states="auto") if auto else plain
    compiled = dpcs_compile(w.model, memory_budget=budget, on_infeasible=on_infeasible)

    def forward_backward() -> None:
        w.loss_fn(compiled(*w.inputs)).backward()

    for _ in range(STEPS):
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = optimizer_state_bytes(optimizer)
    _, peak = measure_peak_memory(forward_backward)
    record = step_records()[-1]
    return {"measured": peak.absolute(resident_bytes([*w.model.parameters(), *w.inputs]) + state), "state": state,
            "record": record, "lever": (record.optimizer_state or {}).get("format")}


def test_optimizer_state_is_counted_and_a_compressed_lever_meets_a_budget_activation_plans_cannot():
    lowest = train(1_000_000, auto=False, on_infeasible="best")  # the lowest peak with fp32 AdamW state
    split = lowest["record"].split()
    assert split["optimizer_state"] == lowest["state"] > 0
    assert abs(lowest["measured"] - lowest["record"].predicted_peak_bytes) <= 0.01 * lowest["measured"]
    # Halfway between that peak and the same step with the state in int8 (a quarter of the bytes and scales):
    budget = lowest["record"].predicted_peak_bytes - lowest["state"] // 3

    try:
        train(budget, auto=False)
    except BudgetInfeasibleError as error:
        message = str(error)
    else:
        raise AssertionError("fp32 AdamW state and activation plans alone met a budget below their lowest peak")
    assert "the smallest step peak dpcs can reach" in message and "optimizer state" in message
    assert "parameters" in message and "activations and gradients" in message

    chosen = train(budget, auto=True)
    options = chosen["record"].optimizer_state["options"]
    print(f"budget {budget} B: fp32 AdamW state reaches {lowest['measured']} B at best; "
          f"dpcs kept the state {chosen['lever']} and measured {chosen['measured']} B "
          f"(predicted {chosen['record'].predicted_peak_bytes} B); options {options}")
    assert chosen["lever"] in ("bf16", "fp16", "int8")
    assert chosen["record"].feasible and chosen["measured"] <= budget
    assert abs(chosen["measured"] - chosen["record"].predicted_peak_bytes) <= 0.01 * chosen["measured"]
    assert chosen["state"] < lowest["state"] / 1.9


def test_state_kept_as_is_when_the_budget_allows_it():
    chosen = train(10**9, auto=True)
    assert chosen["lever"] == "fp32" and chosen["record"].optimizer_state["seconds"] == 0
    assert chosen["record"].split()["optimizer_state"] == chosen["state"]
