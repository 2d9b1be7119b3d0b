"""The state an optimizer will hold once it has stepped, known before its first step.

torch's optimizers make their state lazily, at their first `step()`: AdamW's two moments appear after the
first backward, so a plan made at the first compile that counts only what exists runs the second step over
its budget by the moments' size (3.3 GiB for a 439M-parameter model). The state each of torch's optimizers
makes per parameter is fixed by its type and its group's settings (torch/optim/*.py, `_init_group`): that is
counted here from the parameters, before the first step, so the first plan already fits.

Only tensors with at least one dimension are counted, as `measure.optimizer_state_bytes` counts them (step
counts are scalars). An optimizer whose type is not known here is counted as it is now (`known` False), and
the step recorder plans for its state once it exists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

# Per torch optimizer: how many parameter-shaped state tensors its first step makes for a parameter, from the
# parameter's group settings.
PARAMETER_SHAPED_STATES: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "Adam": lambda g: 3 if g.get("amsgrad") else 2,  # exp_avg, exp_avg_sq, max_exp_avg_sq
    "AdamW": lambda g: 3 if g.get("amsgrad") else 2,
    "Adamax": lambda g: 2,  # exp_avg, exp_inf
    "NAdam": lambda g: 2,  # exp_avg, exp_avg_sq
    "RAdam": lambda g: 2,
    "Adadelta": lambda g: 2,  # square_avg, acc_delta
    "Adagrad": lambda g: 1,  # sum (made at construction: already there)
    "RMSprop": lambda g: 1 + (1 if g.get("momentum", 0) else 0) + (1 if g.get("centered") else 0),
    "SGD": lambda g: 1 if g.get("momentum", 0) else 0,  # momentum_buffer
    "Rprop": lambda g: 2,  # prev, step_size
    "ASGD": lambda g: 1,  # ax
}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_now_bytes(optimizer: torch.optim.Optimizer, device_type: str | None = None) -> int:
    """Bytes of the state tensors the optimizer holds now (distinct storages, scalars left out), on devices of
    `device_type` (None: all)."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0 and (device_type is None or t.device.type == device_type):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def anticipated_state_bytes(optimizer: torch.optim.Optimizer, device_type: str | None = None) -> tuple[int, bool]:
    """(bytes of state the optimizer holds once every parameter it trains has stepped, whether its type is
    known here): its state now, plus what its first step makes for the parameters that have none yet.

    A parameter counts if it requires a gradient (a frozen one never gets state); its state has its dtype,
    as `torch.zeros_like(p)` makes it."""
    now = state_now_bytes(optimizer, device_type)
    per_parameter = PARAMETER_SHAPED_STATES.get(type(optimizer).__name__) if type(optimizer).__module__.startswith(
        "torch.optim") else None
    if per_parameter is None:
        return now, False
    to_come = 0
    for group in optimizer.param_groups:
        states = per_parameter(group)
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p) or (device_type is not None and p.device.type != device_type):
                continue
            to_come += states * _tensor_bytes(p)
    return now + to_come, True
