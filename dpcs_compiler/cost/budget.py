"""Turn the memory_budget option into bytes for the device a graph runs on.

A fraction is of the device's total memory; "auto" is what the step may use without running out: the
device's free memory now, plus the bytes the step's inputs already hold (they are part of its peak and
already allocated), less a margin for the allocator's fragmentation and for what runs outside the graph.
"""

from __future__ import annotations

import dataclasses
import os

import torch

AUTO_MARGIN_FRACTION = 0.05  # of total device memory, kept free under "auto"
# Of the budget, left for memory kernels allocate inside themselves, which no graph shows: measured, CPU
# convolution_backward's internal copy (72 KB on a 65 MiB conv-net step); on CUDA, cuDNN/cuBLAS workspaces.
WORKSPACE_FRACTION = 0.0025


def planning_target(budget_bytes: int) -> int:
    """The peak plans are held to: the budget less `WORKSPACE_FRACTION` of it."""
    return budget_bytes - int(budget_bytes * WORKSPACE_FRACTION)


# What a measured step may hold beyond its prediction and still count as predicted (measurement noise, and
# errors too small to plan again for): the larger of these (`measurement_tolerance`). The step recorder plans
# again only for more (`runtime/step.py`); a plan that drops the fusion guard keeps this much to spare
# (`stages/compile_parts.PartCompiler.schedule_fits`).
CORRECTION_MIN_BYTES = 64 * 1024
CORRECTION_MIN_FRACTION = 0.002


def measurement_tolerance(bytes_: int) -> int:
    """The excess over a prediction of `bytes_` that counts as noise: max(64 KiB, 0.2%)."""
    return max(CORRECTION_MIN_BYTES, int(CORRECTION_MIN_FRACTION * bytes_))


# Bytes the planner counts at every step for what the runtime allocates around a compiled step (autograd's
# scalars; measured 16 B on CPU): `passes.analysis.planning.RUNTIME_ALLOWANCE_BYTES` is this value.
RUNTIME_ALLOWANCE_BYTES = 256


def torch_plan_limit(budget_bytes: int, other_calls: int = 0) -> int:
    """What torch's own partition is held to when dpcs keeps it (no pressure): the budget, its predicted peak
    counted without the planner's allowances. The workspace and runtime allowances are margins for plans dpcs
    makes; torch's plan measured without a budget already includes its kernels' workspace and the runtime's
    bytes, so a budget at that measured peak must get that plan. In a step, the prediction counts the runtime
    allowance of each of the step's `other_calls` too (what they hold around it)."""
    return budget_bytes + RUNTIME_ALLOWANCE_BYTES * (1 + other_calls)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int
    free_bytes: int


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and currently free memory of a device (host RAM for the CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Memory the caching allocator holds but no tensor uses is free for this step too.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return DeviceMemory(total_bytes=int(total), free_bytes=int(free + cached))
    if device.type == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceMemory(total_bytes=int(total), free_bytes=_available_host_bytes(total))
    raise ValueError(f"memory_budget: device {device} is not supported; valid choices: cpu, cuda")


def _available_host_bytes(total: int) -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else total


def resolve_budget(
    spec: int | float | str, device: torch.device, resident_bytes: int, *, memory: DeviceMemory | None = None
) -> int:
    """Bytes the step's peak may reach, from a parsed memory_budget option (see options.parse_memory_budget).

    `memory` is the device's memory as planned for (default: `device_memory(device)`, read now).
    """
    if isinstance(spec, bool):
        raise ValueError(f"memory_budget {spec!r} is not valid")
    if isinstance(spec, int):
        return spec
    memory = device_memory(device) if memory is None else memory
    if isinstance(spec, float):
        return int(spec * memory.total_bytes)
    if spec == "auto":
        return max(0, memory.free_bytes + resident_bytes - int(AUTO_MARGIN_FRACTION * memory.total_bytes))
    raise ValueError(f"memory_budget {spec!r} is not valid; valid choices: bytes, a fraction in (0, 1], 'auto'")
