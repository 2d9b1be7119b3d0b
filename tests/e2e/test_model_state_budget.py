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


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Stack(torch.nn.Module):
    """Parameters (2 MiB a block) much larger than activations: model states are the step's memory."""

    def __init__(self, width: int = 256, blocks: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train_offloaded(budget: int, prefetch: int | None, on_infeasible: str = "error") -> dict:
    """STEPS steps of the stack through dpcs with its blocks' parameters offloaded (prefetch None: not
    offloaded), then one more forward and backward measured (parameters and state on the device counted in)."""
    from dpcs_compiler.runtime import ParameterOffload

    torch.manual_seed(0)
    net = _Stack()
    offload = ParameterOffload(list(net.blocks), prefetch=prefetch) if prefetch is not None else None
    optimizer = CompressedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), states="fp32", offload=offload)
    compiled = dpcs_compile(net, memory_budget=budget, on_infeasible=on_infeasible)
    x = torch.randn(64, 16)

    def forward_backward() -> None:
        compiled(x).square().mean().backward()

    try:
        for _ in range(STEPS):
            forward_backward()
            optimizer.step()
            optimizer.zero_grad()
        state = optimizer_state_bytes(optimizer)
        on_device = [p for p in net.parameters() if p.untyped_storage().nbytes()]
        _, peak = measure_peak_memory(forward_backward)
        return {"measured": peak.absolute(resident_bytes([*on_device, x]) + state), "record": step_records()[-1]}
    finally:
        if offload is not None:
            offload.close()


def test_offloaded_blocks_are_planned_in_the_step_and_meet_a_budget_the_resident_model_cannot():
    """With ParameterOffload a block's parameters are on the device only around its own call and its neighbours'
    (the prefetch): the step planner counts them there, so the predicted peak is the measured one, and a
    budget the model with resident parameters cannot reach is met (measured)."""
    resident = train_offloaded(1_000_000, None, on_infeasible="best")
    assert abs(resident["measured"] - resident["record"].predicted_peak_bytes) <= 0.01 * resident["measured"]
    peaks = {}
    for prefetch in (0, 1, 2):
        run = train_offloaded(10**9, prefetch)
        record = run["record"]
        assert len(record.calls) == 4, "every block's call is in the step"  # (a graph called once per block)
        assert abs(run["measured"] - record.predicted_peak_bytes) <= 0.01 * run["measured"], (prefetch, run)
        peaks[prefetch] = run["measured"]
    block = sum(p.numel() * 4 for p in _Block(256).parameters())
    # Each block prefetched further keeps one more block's parameters in (in the forward or the backward).
    assert abs((peaks[1] - peaks[0]) - block) <= 0.05 * block and abs((peaks[2] - peaks[1]) - block) <= 0.05 * block

    budget = (peaks[1] + resident["record"].predicted_peak_bytes) // 2 // 4  # well below what resident reaches
    budget = max(budget, peaks[1] - block // 2)  # and below offload's unplanned peak: activations are planned too
    met = train_offloaded(budget, 1)
    print(f"budget {budget} B: resident parameters reach {resident['measured']} B at best; offloaded blocks "
          f"measured {met['measured']} B (predicted {met['record'].predicted_peak_bytes} B)")
    assert resident["measured"] > budget
    assert met["record"].feasible and met["measured"] <= budget
    assert abs(met["measured"] - met["record"].predicted_peak_bytes) <= 0.01 * met["measured"]
