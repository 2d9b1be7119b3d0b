"""One budget for activations and optimizer state (the small GPT of the main job, through dpcs): the optimizer's
state is counted in the step's peak, a budget below what activation plans can reach with fp32 AdamW state is
refused naming the smallest peak and its split, and met (measured) when dpcs may choose how a
CompressedOptimizer(states="auto") keeps its state."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dpcs_compiler.cost.profiles import BUILTIN_PROFILES
from dpcs_compiler.measure import measure_peak_memory, optimizer_state_bytes, resident_bytes
from dpcs_compiler.models import workload
from dpcs_compiler.report import compile_records, step_records
from dpcs_compiler.model_states import CompressedOptimizer
from dpcs_compiler.stages.job import BudgetInfeasibleError
from dpcs_testing import dpcs_compile, expecting_best_plan

STEPS = 5  # the first plans, the step planned with the optimizer's state once it exists, then steady


def train(budget: int, auto: bool, on_infeasible: str = "error", **options) -> dict:
    """STEPS training steps; one more (forward, backward and the optimizer's step), measured (its absolute
    peak: parameters, the input and the optimizer's state on the device counted in)."""
    w = workload("gpt", 4, layers=2)
    plain = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    optimizer = CompressedOptimizer(plain, states="auto") if auto else plain
    compiled = dpcs_compile(w.model, memory_budget=budget, on_infeasible=on_infeasible, **options)

    def forward_backward() -> None:
        w.loss_fn(compiled(*w.inputs)).backward()

    for _ in range(STEPS):
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = optimizer_state_bytes(optimizer)
    _, peak = measure_peak_memory(lambda: (forward_backward(), optimizer.step()))
    record = step_records()[-1]
    return {"measured": peak.absolute(resident_bytes([*w.model.parameters(), *w.inputs]) + state), "state": state,
            "record": record, "lever": (record.optimizer_state or {}).get("format")}


@functools.cache
def lowest_with_fp32_state() -> dict:
    """The lowest step peak activation plans reach with fp32 AdamW state (the reference-cpu profile every test
    plans with): planned once for the tests below, as its search (a bisection on the step's target) is the
    costly part of each."""
    with expecting_best_plan():
        return train(1_000_000, auto=False, on_infeasible="best")


def test_optimizer_state_is_counted_and_a_compressed_lever_meets_a_budget_activation_plans_cannot():
    lowest = lowest_with_fp32_state()
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
    assert "parameters" in message and "gradients" in message and "activations" in message

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


def test_the_levers_costs_come_from_the_planning_profile_not_this_machines_timing(monkeypatch):
    """With a pinned profile the state lever is chosen alike on every machine: encoding and decoding cost what
    the profile's memory bandwidth gives them, whatever this machine's codec timings (here made 1000x slower
    for bf16)."""
    from dpcs_compiler.step import planning
    from dpcs_compiler.cost.model_state import StateRates

    lowest = lowest_with_fp32_state()  # planned with reference-cpu, as here
    budget = lowest["record"].predicted_peak_bytes - lowest["state"] // 3
    here = train(budget, auto=True, hardware_profile="reference-cpu")["record"].optimizer_state
    slow = dict.fromkeys(("fp32", "bf16", "fp16", "int8"), 1e-9) | {"bf16": 1e-6}
    monkeypatch.setattr(planning, "measured_state_rates", lambda device: StateRates(slow, slow, None))
    elsewhere = train(budget, auto=True, hardware_profile="reference-cpu")["record"].optimizer_state
    assert here["format"] == elsewhere["format"] == "bf16" and here["options"] == elsewhere["options"]


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


def train_offloaded(budget: int, prefetch: int | None, on_infeasible: str = "error", auto: bool = False,
                    overlap: bool = False, **options) -> dict:
    """STEPS steps of the stack through dpcs with its blocks' parameters offloaded (prefetch None: not
    offloaded; auto: as the step planner chooses), then one more (forward, backward and the optimizer's step)
    measured (parameters and state on the device counted in)."""
    from dpcs_compiler.model_states import ParameterOffload

    torch.manual_seed(0)
    net = _Stack()
    offload = ParameterOffload(list(net.blocks), prefetch=prefetch, auto=auto) if prefetch is not None else None
    optimizer = CompressedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), states="fp32", offload=offload,
                                    overlap=overlap)
    compiled = dpcs_compile(net, memory_budget=budget, on_infeasible=on_infeasible, **options)
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
        _, peak = measure_peak_memory(lambda: (forward_backward(), optimizer.step()))
        return {"measured": peak.absolute(resident_bytes([*on_device, x]) + state), "record": step_records()[-1],
                "offloaded": [i for i, b in enumerate(net.blocks) if offload and b in offload.offloaded_modules()],
                "records": compile_records()}
    finally:
        if offload is not None:
            offload.close()


def test_offloaded_blocks_are_planned_in_the_step_and_meet_a_budget_the_resident_model_cannot():
    """With ParameterOffload a block's parameters are on the device only around its own call and its neighbours'
    (the prefetch): the step planner counts them there, so the predicted peak is the measured one, and a
    budget the model with resident parameters cannot reach is met (measured)."""
    with expecting_best_plan():
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


# A profile with a host link that is other memory than the device's, so offloading parameters saves device memory
# (on this CPU the host copies are allocated before the measured step, outside it, as they are off a GPU).
LINKED_PROFILE = dataclasses.replace(BUILTIN_PROFILES["reference-cpu"][1], host_to_device=8e9, device_to_host=8e9)


def test_the_step_planner_chooses_which_blocks_to_offload():
    """ParameterOffload(auto=True): the step planner keeps every block on the device when the budget allows it,
    and offloads the fewest blocks a tighter budget needs (measured within it); where the host is the device's
    own memory (the reference CPU profile), offloading saves nothing and no block is offloaded."""
    kept = train_offloaded(10**9, 1, auto=True, hardware_profile=LINKED_PROFILE)
    assert kept["offloaded"] == [] and kept["record"].optimizer_state["offloaded_blocks"] == 0
    assert abs(kept["measured"] - kept["record"].predicted_peak_bytes) <= 0.01 * kept["measured"]
    block = sum(p.numel() * 4 for p in _Block(256).parameters())
    budget = kept["measured"] - 2 * block  # two blocks' parameters (and gradients and state) less than all kept
    tight = train_offloaded(budget, 1, auto=True, hardware_profile=LINKED_PROFILE)
    chosen = tight["record"].optimizer_state
    print(f"budget {budget} B: all blocks kept {kept['measured']} B; dpcs offloaded blocks {tight['offloaded']} "
          f"and measured {tight['measured']} B (predicted {tight['record'].predicted_peak_bytes} B); "
          f"options {chosen['options']}")
    assert chosen["offloadable_blocks"] == 4 and 0 < chosen["offloaded_blocks"] < 4
    assert len(tight["offloaded"]) == chosen["offloaded_blocks"]
    # The planned step offloads no activation (host copies on CPU). (Its first step, run before the step is
    # known, holds least: each block's graph goes on to more of the stack's forward, `more_of_frame_follows`.)
    last = {(r.variant_of or r.graph): r for r in tight["records"] if r.mode == "training"}
    assert all(last[g].offloaded_values == 0 for g in tight["record"].calls), "activation offloaded"
    assert tight["record"].feasible and tight["measured"] <= budget
    assert abs(tight["measured"] - tight["record"].predicted_peak_bytes) <= 0.01 * tight["measured"]
    with expecting_best_plan():  # the reference CPU: host is the device
        on_cpu = train_offloaded(budget, 1, auto=True, on_infeasible="best")
    assert on_cpu["offloaded"] == [] and on_cpu["record"].optimizer_state["offloadable_blocks"] == 4


def test_a_host_step_overlapped_with_the_next_forward_is_planned_at_the_wait_it_causes(monkeypatch):
    """CompressedOptimizer(overlap=True) steps the offloaded blocks on the host beside the next forward: the
    planner counts each offloading option at the wait that causes (`cost.model_state.host_step_stall`), not
    the whole host step, so its options cost less than without overlap, and no less than their copies. The
    host step's rate is this machine's timing (none on CPU, where the host is the device): made slow here."""
    from dpcs_compiler.cost.model_state import StateRates
    from dpcs_compiler.step import planning
    from dpcs_compiler.step.planning import offloading_seconds

    rates = dict.fromkeys(("fp32", "bf16", "fp16", "int8"), 1e-9)
    host_step = 1e-7  # about 50 ms a block's host step: more than the whole forward's estimate, so it waits
    monkeypatch.setattr(planning, "measured_state_rates", lambda device: StateRates(
        rates, rates, None, host_step_seconds=host_step, device_step_seconds=1e-9))
    priced = []  # the rates each option is priced with: this machine's host and device step, the profile's link
    monkeypatch.setattr(planning, "offloading_seconds",
                        lambda *args: priced.append(args[3]) or offloading_seconds(*args))
    kept = train_offloaded(10**9, 1, auto=True, hardware_profile=LINKED_PROFILE)
    block = sum(p.numel() * 4 for p in _Block(256).parameters())
    budget = kept["measured"] - 2 * block
    runs = {overlap: train_offloaded(budget, 1, auto=True, overlap=overlap, hardware_profile=LINKED_PROFILE)
            for overlap in (False, True)}
    plain, overlapped = (runs[o]["record"].optimizer_state for o in (False, True))
    print(f"options without overlap {plain['options']}; with overlap {overlapped['options']}")
    assert not plain["host_step_overlapped"] and overlapped["host_step_overlapped"]
    assert [o[:2] for o in plain["options"]] == [o[:2] for o in overlapped["options"]]
    elements = sum(p.numel() for p in _Block(256).parameters())
    copies = 3 * block / LINKED_PROFILE.host_to_device  # parameters twice, gradients once
    for (name, _, whole), (_, _, waited) in zip(plain["options"], overlapped["options"]):
        k = int(name.split(" of ")[0].split()[-1])  # "k of 4 blocks offloaded"
        assert whole == pytest.approx(k * (copies + elements * host_step)), name
        assert k * copies - 1e-12 <= waited <= whole + 1e-12, name
        if k:  # the last blocks are offloaded first: the forwards of those before them hide part of their steps
            assert waited < whole, name
    for run in runs.values():
        assert run["record"].feasible and run["measured"] <= budget
    assert {(r.host_step_seconds, r.device_step_seconds, r.link_bytes_per_second) for r in priced} == {
        (host_step, 1e-9, LINKED_PROFILE.host_to_device)}


def train_stack(budget: int, make_optimizer, on_infeasible: str = "error") -> dict:
    """STEPS steps of the stack (batch 4: model states are the step's memory); then one more measured two ways
    in one run: its forward and backward alone, and the whole step with the optimizer's."""
    torch.manual_seed(0)
    net = _Stack()
    optimizer = make_optimizer(net.parameters())
    compiled = dpcs_compile(net, memory_budget=budget, on_infeasible=on_infeasible)
    x = torch.randn(4, 16)

    def forward_backward() -> None:
        compiled(x).square().mean().backward()

    for _ in range(STEPS):
        forward_backward()
        optimizer.step()
        optimizer.zero_grad()
    resident = resident_bytes([*net.parameters(), x]) + optimizer_state_bytes(optimizer)
    _, without = measure_peak_memory(forward_backward)
    optimizer.zero_grad()
    resident = resident_bytes([*net.parameters(), x]) + optimizer_state_bytes(optimizer)
    _, whole = measure_peak_memory(lambda: (forward_backward(), optimizer.step()))
    return {"record": step_records()[-1], "forward_backward": without.absolute(resident),
            "measured": whole.absolute(resident)}


def test_the_optimizer_step_is_planned_as_a_phase_of_the_step():
    """The optimizer's step runs after the step's last backward, on top of every gradient and the state: its
    temporaries (foreach AdamW: a square root of every second moment at once) are measured at the first steps
    and planned as a phase of the step, so the budget bounds the whole step and the predicted peak is the one
    measured with `optimizer.step()` in it. A budget between the forward-and-backward peak and the whole step's
    is refused naming the optimizer step, and met when dpcs may choose how the state is kept (stepped a chunk
    at a time)."""
    plain = train_stack(10**9, lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
    record = plain["record"]
    print(f"foreach AdamW: forward and backward {plain['forward_backward']} B, whole step {plain['measured']} B "
          f"(predicted {record.predicted_peak_bytes} B in the {record.peak_phase}; temporaries "
          f"{record.optimizer_bytes} B)")
    assert plain["measured"] > plain["forward_backward"] + 1_000_000, "the optimizer step is the step's peak"
    assert record.peak_phase == "optimizer" and record.split()["optimizer_step"] == record.optimizer_bytes > 0
    # every gradient is alive in the optimizer step: as many bytes as the parameters
    assert record.split()["gradients"] == record.split()["parameters"] == sum(
        p.numel() * 4 for p in _Stack().parameters())
    assert abs(plain["measured"] - record.predicted_peak_bytes) <= 0.01 * plain["measured"]

    budget = (plain["forward_backward"] + plain["measured"]) // 2
    try:
        train_stack(budget, lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
    except BudgetInfeasibleError as error:
        message = str(error)
    else:
        raise AssertionError("a budget below the optimizer step's peak was taken as met")
    assert "in the optimizer step after the backward" in message and "the optimizer step's temporaries" in message

    chosen = train_stack(budget, lambda p: CompressedOptimizer(torch.optim.AdamW(p, lr=1e-3, foreach=True),
                                                               states="auto", chunk_bytes=1 << 20))
    record = chosen["record"]
    print(f"budget {budget} B: dpcs kept the state {record.optimizer_state['format']} and measured the whole step "
          f"{chosen['measured']} B (predicted {record.predicted_peak_bytes} B in the {record.peak_phase})")
    assert record.feasible and chosen["measured"] <= budget
    assert abs(chosen["measured"] - record.predicted_peak_bytes) <= 0.01 * chosen["measured"]
