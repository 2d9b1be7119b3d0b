"""What `Runtime.run_step` watches in one attempt at a training step, to tell whether a rerun after an
out-of-memory error is exact (no update lost or applied twice) and to undo what a rerun redoes: the optimizer
steps begun (torch's global step hooks), the parameters' version counters, shallow copies of the optimizers'
state and groups, the buffers a step writes in place (docs/oom.md)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# The autograd engine's entry from Python: an error whose traceback passes through it came from a backward.
_BACKWARD_CODE = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def _noted(values: Mapping[str, Any]) -> dict[str, tuple[Any, int | None]]:
    """A shallow copy of an optimizer's state of a parameter, or of a param group (less its parameters): each
    value, a tensor with its version counter."""
    return {k: (v, v._version if isinstance(v, torch.Tensor) else None) for k, v in values.items() if k != "params"}


def _altered(noted: dict[str, tuple[Any, int | None]], now: Mapping[str, Any]) -> bool:
    """Whether `now` lacks a key it had when `noted`, or holds another value, or a tensor written since."""
    return any(k not in now or _changed(v, version, now[k]) for k, (v, version) in noted.items())


def _changed(before: Any, version: int | None, now: Any) -> bool:
    """Whether a value (a tensor: with its version counter then) is another object now, or written in place."""
    if now is before:
        return isinstance(now, torch.Tensor) and now._version != version
    if isinstance(now, torch.Tensor) or isinstance(before, torch.Tensor):
        return True
    try:
        return not bool(now == before)
    except (TypeError, ValueError, RuntimeError):
        return True


class _OptimizerStep:
    """An optimizer step begun in a `run_step` attempt, as it found things: its parameters' version counters,
    and shallow copies (references, no tensor copied) of the state and the groups, to tell whether an OOM
    inside it left what existed before it untouched, and to drop the state it created (torch's optimizers
    create their state at a parameter's first step, when it finds none)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.versions = [p._version for p in self.params]
        self.state = {p: _noted(state) for p in self.params if (state := optimizer.state.get(p))}
        self.groups = [_noted(group) for group in optimizer.param_groups]

    def written(self) -> str | None:
        """What that existed before the step it wrote or replaced, or None."""
        name = type(self.optimizer).__name__
        written = sum(p._version != v for p, v in zip(self.params, self.versions))
        if written:
            return f"{name}.step() had written {written} of its {len(self.params)} parameters"
        if any(_altered(before, self.optimizer.state.get(p, {})) for p, before in self.state.items()):
            return f"{name}.step() had updated its state of a parameter in place"
        if any(group.keys() - {"params"} != before.keys() or _altered(before, group)
               for group, before in zip(self.optimizer.param_groups, self.groups)):
            return f"{name}.step() had changed its param_groups"
        return None

    def drop_new_state(self) -> None:
        """Remove the state the step created, so the rerun's step creates it again, as the first one did."""
        for p in self.params:
            if p not in self.state:
                self.optimizer.state.pop(p, None)
            elif p in self.optimizer.state:
                state = self.optimizer.state[p]
                for key in [k for k in state if k not in self.state[p]]:
                    del state[key]


class StepAttempt:
    """One attempt of `Runtime.run_step` at a step: it watches every optimizer step (torch's global step
    hooks) and keeps what tells whether a rerun of the step is exact (see `Runtime.run_step`)."""

    def __init__(self, runtime: Any) -> None:
        self.step_count = runtime.step_count
        self.buffers = runtime._named_buffers()
        self.buffer_versions = [b._version for _, b in self.buffers]
        # Copies of the buffers a step writes in place (norm layers' running statistics): small.
        self.buffer_copies = {id(b): b.detach().clone() for _, b in self.buffers if id(b) in runtime._written_buffers}
        self.gradients = [(p, weakref.ref(p.grad)) for p in runtime.parameters if p.grad is not None]
        self.running: list[_OptimizerStep] = []  # optimizer steps begun and not completed (nested: a stack)
        self.completed: list[str] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.handles = [register_optimizer_step_pre_hook(self._began), register_optimizer_step_post_hook(self._completed)]

    def _began(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.running.append(_OptimizerStep(optimizer))
        self.optimizers.append(optimizer)

    def _completed(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.running and self.running[-1].optimizer is optimizer:
            self.running.pop()
        self.completed.append(type(optimizer).__name__)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()

    def phase(self, error: BaseException) -> str:
        """Where the error came from: inside an optimizer step, a backward, after an optimizer step, or before
        any (the forward, or other code of the step)."""
        if self.running:
            return "optimizer"
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is _BACKWARD_CODE:
                return "backward"
            tb = tb.tb_next
        return "after_optimizer" if self.completed else "forward"

    def inexact(self, runtime: Any) -> str | None:
        """Why a rerun of the whole step would not be exact, or None."""
        if self.completed:
            return (f"{', '.join(self.completed)}.step() had completed before it: a rerun would apply that update "
                    "twice")
        written = next((w for step in self.running if (w := step.written()) is not None), None)
        if written is not None:
            return f"{written}: the parameters hold a partially applied update"
        if runtime.step_count != self.step_count:
            return "Runtime.step ran in the step: a rerun would count the step twice"
        now = runtime._named_buffers()
        if len(now) != len(self.buffers) or any(a is not b for (_, a), (_, b) in zip(now, self.buffers)):
            return "the step replaced a buffer of the model: a rerun would start from the new one"
        for (name, buffer), version in zip(self.buffers, self.buffer_versions):
            if buffer._version != version and id(buffer) not in self.buffer_copies:
                return (f"the step updated the buffer {name!r} in place, and run_step copies only norm layers' running "
                        "statistics and the buffers a completed step updated: a rerun would update it twice")
        for p, gradient in self.gradients:
            if p.grad is not None and p.grad is gradient():
                return ("a gradient held before run_step was still held (step_fn did not zero the gradients with "
                        "set_to_none=True, or accumulates over calls): a rerun from zeroed gradients would lose it")
        return None

    def restore(self) -> None:
        """Undo what the failed attempt did that a rerun redoes: the state its optimizer step created, the
        buffers it updated in place."""
        for step in self.running:
            step.drop_new_state()
        for (_, buffer), version in zip(self.buffers, self.buffer_versions):
            if buffer._version != version:
                with torch.no_grad():
                    buffer.copy_(self.buffer_copies[id(buffer)])
