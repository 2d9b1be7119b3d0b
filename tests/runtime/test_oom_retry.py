"""`Runtime.run_step` on an out-of-memory error: an exact rerun (parameters, optimizer state and buffers equal
to a run without the error, bit for bit), a tighter plan for it, the telemetry lines; or, where a rerun
would not be exact, an error saying why. The OOM is injected (`torch.OutOfMemoryError`) on CPU."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.runtime import MemoryPolicy, Runtime, read_telemetry
from dpcs_compiler.runtime.oom_retry import _OptimizerStep
from dpcs_testing import dpcs_compile
from runtime_scenarios import Blocks

WIDTH = 128
STEPS = 3


class NormBlocks(Blocks):
    """Blocks with a BatchNorm before the head: running statistics the forward updates in place."""

    def __init__(self):
        super().__init__(WIDTH)
        self.norm = torch.nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


class FirstWritesThenRuns(torch.optim.Optimizer):
    """Plain SGD that keeps a step count per parameter (created at its first step, as torch's optimizers do)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("steps", torch.zeros(()))
                self.update(p, group["lr"])
        return None

    def update(self, p, lr):
        self.state[p]["steps"].add_(1)
        p.add_(p.grad, alpha=-lr)


OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam-foreach": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "custom": lambda params: FirstWritesThenRuns(params),
}


@dataclasses.dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    runtime: Runtime
    losses: list[float]


def train(optimizer_name: str, *, inject: Callable | None = None, norm: bool = False, telemetry=None,
          zero: str | None = "start", **runtime_options) -> Run:
    """STEPS steps of a small model (eager compiler, no budget: a tighter level recomputes) through
    `run_step`; `inject(run, step, where)` is called at "forward" (the loss computed), before the optimizer
    step and after it, to arm or raise an OOM. `zero`: where the step zeroes the gradients ("start", "end",
    None: never)."""
    torch.manual_seed(0)
    model = NormBlocks() if norm else Blocks(WIDTH)
    compiled = dpcs_compile(model)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    runtime = Runtime(model, policies=[MemoryPolicy(factor=0.9)], signal_every=STEPS + 1, telemetry=telemetry,
                      telemetry_every=1, **runtime_options)
    run = Run(model, optimizer, runtime, [])
    x = torch.randn(256, WIDTH)

    def step(number):
        if zero == "start":
            optimizer.zero_grad(set_to_none=True)
        loss = compiled(x).square().mean()
        if inject:
            inject(run, number, "forward")
        loss.backward()
        optimizer.step()
        if inject:
            inject(run, number, "after")
        if zero == "end":
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for number in range(1, STEPS + 1):
        loss = runtime.run_step(step, number)
        runtime.step(loss=loss, optimizer=optimizer)
        run.losses.append(loss.item())
    runtime.close()
    return run


@functools.cache
def reference(optimizer_name: str, norm: bool = False) -> tuple[list[torch.Tensor], dict, list[float]]:
    """The parameters (and buffers), optimizer state and losses of the run without an OOM."""
    run = train(optimizer_name, norm=norm)
    return [t.clone() for t in run.model.state_dict().values()], run.optimizer.state_dict(), run.losses


def assert_equal_state(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_equal_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_state(x, y)
    else:
        assert a == b


def once(where: str, at_step: int, arm: Callable | None = None):
    """An injector raising one OOM at `where` of step `at_step` (or, with `arm`, arming `arm(run, raise_oom)`
    there to raise it later, inside the backward or the optimizer step)."""
    fired = []

    def raise_oom():
        if not fired:
            fired.append(True)
            raise torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")

    def inject(run, step, here):
        if step == at_step and here == where:
            arm(run, raise_oom) if arm else raise_oom()

    inject.fired = fired
    return inject


def in_backward(run, raise_oom):
    """Raise once the first block's weight got its gradient: the head's gradients are in already."""
    def hook(weight):
        handle.remove()
        raise_oom()

    handle = run.model.blocks[0][0].weight.register_post_accumulate_grad_hook(hook)


def in_optimizer(function: str):
    """Raise at the optimizer step's first call of `function` (an attribute of torch, or of the optimizer's
    class), after running it."""

    def arm(run, raise_oom):
        owner = torch if hasattr(torch, function) else type(run.optimizer)
        original, own = getattr(owner, function), function in vars(owner)

        def patched(*args, **kwargs):
            setattr(owner, function, original) if own else delattr(owner, function)
            result = original(*args, **kwargs)
            raise_oom()
            return result

        setattr(owner, function, patched)

    return arm


# (optimizer, step, where the OOM is raised, what arms it): each rerun is exact.
EXACT = {
    "forward": ("adamw", 2, "forward", None),
    "backward": ("sgd", 2, "forward", in_backward),
    # AdamW's first step: its state allocated, no parameter written yet
    "adamw-first-step-state": ("adamw", 1, "forward", in_optimizer("_init_group")),
    # SGD's second step: its momentum found (and untouched) when the OOM came
    "sgd-existing-state": ("sgd", 2, "forward", in_optimizer("_init_group")),
    # foreach Adam (no weight decay) mid-way through its first step: the state it created is written, no parameter
    "adam-foreach-first-step-midway": ("adam-foreach", 1, "forward", in_optimizer("_foreach_sqrt")),
}


@pytest.mark.parametrize("case", EXACT)
def test_a_rerun_after_an_oom_is_exact_and_runs_a_tighter_plan(case, tmp_path):
    optimizer_name, at_step, where, arm = EXACT[case]
    inject = once(where, at_step, arm)
    run = train(optimizer_name, inject=inject, telemetry=tmp_path / "t.jsonl")
    assert inject.fired
    parameters, optimizer_state, losses = reference(optimizer_name)
    assert_equal_state(list(run.model.state_dict().values()), parameters)
    assert_equal_state(run.optimizer.state_dict(), optimizer_state)
    assert run.losses == losses
    assert run.runtime.step_count == STEPS  # the step that raised counts once
    entries = read_telemetry(tmp_path / "t.jsonl")
    [oom] = [e for e in entries if e["kind"] == "oom"]
    phase = {"forward": "forward", "backward": "backward"}.get(case, "optimizer")
    assert (oom["step"], oom["attempt"], oom["phase"], oom["retried"], oom["why_not"]) == (at_step, 1, phase, True, None)
    assert oom["optimizer"] == (type(run.optimizer).__name__ if phase == "optimizer" else None)
    assert oom["decisions"]["budget_scale"] == 0.9 and oom["changed"] and "out of memory" in oom["error"]
    [signals] = [e for e in entries if e["kind"] == "signals" and e["signals"]["oom"]]
    assert any("out-of-memory error: budget tightened to x0.9" in r for r in signals["reasons"])
    [recovered] = [e for e in entries if e["kind"] == "oom_recovered"]
    assert recovered["step"] == at_step and recovered["attempts"] == 2 and recovered["variant"] == oom["variant"]
    # the rerun ran the tighter variant: its budget is 0.9x the planned peak of the attempt that failed
    assert recovered["budget_bytes"] == int(0.9 * oom["planned_peak_bytes"])
    assert recovered["planned_peak_bytes"] <= recovered["budget_bytes"] < oom["planned_peak_bytes"]


def test_buffers_updated_in_place_are_restored_for_the_rerun():
    """BatchNorm's running statistics, updated by the failed attempt's forward, are those of one forward."""
    inject = once("forward", 1, in_backward)
    run = train("sgd", inject=inject, norm=True)
    assert inject.fired
    parameters, optimizer_state, _ = reference("sgd", norm=True)
    assert_equal_state(list(run.model.state_dict().values()), parameters)
    assert run.model.norm.num_batches_tracked.item() == STEPS
    assert_equal_state(run.optimizer.state_dict(), optimizer_state)


# (optimizer, step, where, what arms it, phase, why not): a rerun would not be exact.
REFUSED = {
    "adamw-foreach-weight-decay-written": ("adamw-foreach", 1, "forward", in_optimizer("_foreach_sqrt"), "optimizer",
                                           "AdamW.step() had written 6 of its 6 parameters"),
    "adam-foreach-state-updated": ("adam-foreach", 2, "forward", in_optimizer("_foreach_sqrt"), "optimizer",
                                   "Adam.step() had updated its state of a parameter in place"),
    "custom-optimizer-midway": ("custom", 2, "forward", in_optimizer("update"), "optimizer",
                                "FirstWritesThenRuns.step() had written 1 of its 6 parameters"),
    "after-the-optimizer-step": ("sgd", 2, "after", None, "after_optimizer",
                                 "SGD.step() had completed before it: a rerun would apply that update twice"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_oom_whose_rerun_would_not_be_exact_is_an_error_saying_why(case, tmp_path):
    optimizer_name, at_step, where, arm, phase, why = REFUSED[case]
    with pytest.raises(RuntimeError, match="rerun would not be exact") as raised:
        train(optimizer_name, inject=once(where, at_step, arm), telemetry=tmp_path / "t.jsonl")
    assert why in str(raised.value) and f"step {at_step} ran out of memory ({phase})" in str(raised.value)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    [oom] = [e for e in read_telemetry(tmp_path / "t.jsonl") if e["kind"] == "oom"]  # flushed before the raise
    assert (oom["step"], oom["phase"], oom["retried"]) == (at_step, phase, False) and oom["why_not"].startswith(why)
    assert oom["decisions"]["budget_scale"] == 0.9  # the plan is tightened all the same


def test_an_optimizer_step_that_replaced_its_state_or_changed_its_groups_wrote_something():
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    optimizer.state[p]["momentum_buffer"] = torch.zeros(2)
    step = _OptimizerStep(optimizer)
    optimizer.state[p]["new"] = torch.zeros(2)  # created by the step: dropped, not a write
    assert step.written() is None
    step.drop_new_state()
    assert list(optimizer.state[p]) == ["momentum_buffer"]
    optimizer.state[p]["momentum_buffer"] = torch.zeros(2)  # replaced, equal
    assert step.written() == "SGD.step() had updated its state of a parameter in place"
    step = _OptimizerStep(optimizer)
    optimizer.param_groups[0]["lr"] = 0.2
    assert step.written() == "SGD.step() had changed its param_groups"


def test_gradients_accumulated_over_calls_are_not_lost_to_a_rerun():
    with pytest.raises(RuntimeError, match="a gradient held before run_step was still held"):
        train("sgd", inject=once("forward", 2, in_backward), zero=None)


def test_a_rerun_starts_from_no_gradients_when_the_step_zeroes_them_at_its_end():
    """The failed backward had accumulated some gradients; run_step sets them to None for the rerun."""
    inject = once("forward", 2, in_backward)
    run = train("sgd", inject=inject, zero="end")
    assert inject.fired
    parameters, optimizer_state, losses = reference("sgd")
    assert_equal_state(list(run.model.state_dict().values()), parameters)
    assert_equal_state(run.optimizer.state_dict(), optimizer_state)


# The Runtime's tightened plans compile with on_infeasible="best": below what the step reaches, that is its verdict.
@pytest.mark.filterwarnings(r"ignore:memory_budget .* cannot be met .*on_infeasible='best':dpcs_compiler.DpcsWarning")
def test_with_no_retry_left_or_in_a_distributed_job_the_oom_propagates(tmp_path, monkeypatch):
    def always(run, step, where):
        if step == 2 and where == "forward":
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        train("sgd", inject=always, telemetry=tmp_path / "a.jsonl", max_oom_retries=1)
    ooms = [e for e in read_telemetry(tmp_path / "a.jsonl") if e["kind"] == "oom"]
    assert [(e["attempt"], e["retried"], e["decisions"]["budget_scale"]) for e in ooms] == [(1, True, 0.9), (2, False, 0.81)]

    # in an optimizer step, before it wrote: the state it created is dropped before the OOM propagates
    optimizers = []

    def allocating_state(run, raise_oom):
        optimizers.append(run.optimizer)
        in_optimizer("_init_group")(run, raise_oom)

    with pytest.raises(torch.OutOfMemoryError):
        train("adamw", inject=once("forward", 1, allocating_state), max_oom_retries=0)
    assert len(optimizers[0].state) == 0

    def as_rank_zero_of_two(run, step, where):  # the job is "distributed" from the OOM on
        if where == "forward":
            monkeypatch.setattr(rank_agreement, "world", lambda: (0, 2))
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        train("sgd", inject=as_rank_zero_of_two, telemetry=tmp_path / "b.jsonl")
    [oom] = [e for e in read_telemetry(tmp_path / "b.jsonl") if e["kind"] == "oom"]
    assert not oom["retried"] and not oom["changed"] and oom["decisions"]["budget_scale"] is None  # no collective


def test_run_step_leaves_no_optimizer_hook_behind():
    from torch.optim import optimizer as optimizer_module

    before = (len(optimizer_module._global_optimizer_pre_hooks), len(optimizer_module._global_optimizer_post_hooks))
    with pytest.raises(ValueError):
        Runtime(Blocks(), policies=[]).run_step(lambda: (_ for _ in ()).throw(ValueError("not an OOM")))
    train("sgd", inject=once("forward", 2))
    assert (len(optimizer_module._global_optimizer_pre_hooks), len(optimizer_module._global_optimizer_post_hooks)) == before


def test_the_docs_page_block_is_its_twins_and_the_twin_runs(tmp_path, monkeypatch):
    """docs/oom.md follows the README's rule (tests/test_readme.py): its block is marked with a twin under
    examples/ that holds it word for word, and the twin runs (eager final compiler)."""
    import re
    import runpy
    from pathlib import Path

    from test_readme import contains_block

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "oom.md").read_text()
    [(twin, block)] = re.findall(r"^<!-- twin: (\S+) -->\n```python\n(.*?)^```$", text, flags=re.M | re.S)
    assert text.count("```") == 2 and contains_block((root / twin).read_text(), block.splitlines())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPCS_OPTIONS", '{"compiler": "eager"}')
    runpy.run_path(str(root / twin), run_name="__main__")
