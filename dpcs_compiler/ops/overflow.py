"""A device-side flag that compiled backward graphs raise when a gradient they produce is inf or NaN.

    dpcs.note_nonfinite(grads)      # in the backward, right before it returns (`passes/rewrite/overflow_check.py`)

The op ORs "some element of some grad is not finite" into a 0-dim bool flag per device, kept in a module-level
registry, with device ops only: per device, one `_foreach_norm(grads, inf)` per grad dtype (max |x|, which
unlike a sum cannot overflow from finite values, and keeps NaN), the amax of those norms, then a compare and two
logical ops on 0-dim tensors. Nothing waits for the device, so a training loop can read the flag between steps
(GradScaler style: skip the step, shrink the scale) off the hot path. Work is queued on the current stream, like
the backward's. Integer, empty and float4 tensors are skipped; float8 ones are widened to float32 first (a
temporary copy: `_foreach_norm` does not take them).

Reading the flag. `device=None` means the current accelerator (`torch.accelerator.current_accelerator()`,
at its current index) when there is one, else the CPU; a device type without an index means its current index.
None of these block on the device except `overflowed`:

    overflow_flag(device) -> Tensor     the live flag (created False on first use), for device-side consumers
    take_overflow(device) -> Tensor     a copy of the flag, then the flag reset: two device ops
    reset_overflow(device=None)         zero in place; None resets every device's flag
    overflowed(device) -> bool          syncs; for logging and tests

Why the op survives dead code elimination. It returns nothing and mutates no input, so it is registered with
`torch.fx.node.has_side_effect`. FX (`Node.is_impure`, used by AOTAutograd's and Inductor's post-grad DCE) and
Inductor's scheduler (`FallbackKernel.has_side_effects`) both ask `torch._library.utils.is_impure`, which
reads that registry; Inductor lowers the op to a fallback kernel, a Python call of this implementation.

Flags are created lazily by the first op or read on their device. Under CUDA graph capture create them before
capturing (`overflow_flag(device)`), so the captured graph writes the same tensor the loop reads.
"""

from __future__ import annotations

import inspect
import threading

import torch
from torch.library import custom_op

__all__ = ["note_nonfinite", "overflow_flag", "reset_overflow", "take_overflow", "overflowed", "NOTE_NONFINITE"]

_INF = float("inf")

_flags: dict[torch.device, torch.Tensor] = {}
_flags_lock = threading.Lock()

# Checked as they are; other floating dtypes (the float8 family) are widened to float32, which holds their values.
_NORM_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# No inf or NaN encodings: nothing to check.
_ALWAYS_FINITE = frozenset(getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name))


def _op_tags() -> dict[str, object]:
    """Tell Inductor the op reads its inputs in any layout, so it copies none (where custom_op takes tags)."""
    if "tags" not in inspect.signature(custom_op).parameters:
        return {}
    return {"tags": (torch.Tag.flexible_layout,)}


def _device_key(device: str | torch.device | None) -> torch.device:
    """The registry key of a device: an explicit index for indexed device types, plain "cpu" for the host."""
    if device is None:
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        device = accelerator if accelerator is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        return torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def overflow_flag(device: str | torch.device | None = None) -> torch.Tensor:
    """The live overflow flag of `device`: a 0-dim bool tensor there, created False on first use. No sync."""
    key = _device_key(device)
    flag = _flags.get(key)
    if flag is None:
        with _flags_lock:
            flag = _flags.get(key)
            if flag is None:
                flag = _flags[key] = torch.zeros((), dtype=torch.bool, device=key)
    return flag


def reset_overflow(device: str | torch.device | None = None) -> None:
    """Clear the flag of `device` in place, or of every device when `device` is None. No sync."""
    if device is None:
        for flag in list(_flags.values()):
            flag.zero_()
    else:
        overflow_flag(device).zero_()


def take_overflow(device: str | torch.device | None = None) -> torch.Tensor:
    """A copy of `device`'s flag, then the flag cleared: the value since the last reset. No sync."""
    flag = overflow_flag(device)
    taken = flag.clone()
    flag.zero_()
    return taken


def overflowed(device: str | torch.device | None = None) -> bool:
    """Whether `device`'s flag is set. Waits for the device: for logging and tests, not the hot path."""
    return bool(overflow_flag(device).item())


def _checkable(grad: torch.Tensor) -> torch.Tensor | None:
    """`grad` in a dtype `_foreach_norm` takes, or None when it cannot hold inf or NaN (or is empty)."""
    if grad.numel() == 0 or not grad.is_floating_point() or grad.dtype in _ALWAYS_FINITE:
        return None
    return grad if grad.dtype in _NORM_DTYPES else grad.float()


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@custom_op("dpcs::note_nonfinite", mutates_args=(), **_op_tags())
def note_nonfinite(grads: list[torch.Tensor]) -> None:
    """Set the overflow flag of each grad's device if any of its elements is inf or NaN; device ops only."""
    # device -> dtype -> grads: one multi-tensor reduction per dtype (CUDA's fast path wants a single dtype).
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for grad in grads:
        checkable = _checkable(grad)
        if checkable is not None:
            groups.setdefault(grad.device, {}).setdefault(checkable.dtype, []).append(checkable)
    for device, by_dtype in groups.items():
        # max |x| per grad: NaN-propagating, and unlike a sum it cannot overflow from finite values; in float32
        # (float64 for float64 grads), which holds every value of the narrower dtypes exactly.
        norms = [
            norm
            for dtype, same in by_dtype.items()
            for norm in torch._foreach_norm(same, _INF, dtype=_norm_dtype(dtype))
        ]
        largest = norms[0] if len(norms) == 1 else torch.stack(norms).amax()
        overflow_flag(device).logical_or_(largest.lt(_INF).logical_not_())  # `x < inf` is False for inf and NaN


@note_nonfinite.register_fake
def _note_nonfinite_fake(grads: list[torch.Tensor]) -> None:
    return None


NOTE_NONFINITE = torch.ops.dpcs.note_nonfinite.default
torch.fx.node.has_side_effect(NOTE_NONFINITE)
