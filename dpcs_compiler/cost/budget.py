"""Turn the memory_budget option into bytes for the device a graph runs on.

A fraction is of the device's total memory; "auto" is what the step may use without running out: the
device's free memory now, plus the bytes the step's inputs already hold (they are part of its peak and
already allocated), less a margin for the allocator's fragmentation and for what runs outside the graph.

On CUDA the budget bounds what the caching allocator reserves from the device, which is what runs out, not
what tensors hold: under dpcs's plans on an H200 (torch 2.11) reserved ran 30-32% above allocated with the
default allocator, whose blocks split and cache per segment. With a budget dpcs turns on the allocator's
expandable segments (`use_expandable_segments`): memory is mapped in 20 MiB pages of one growing segment, and
on a failed allocation the pages no live tensor touches are unmapped, so what a step needs is its live bytes
plus partly used pages (0.7-1.6% above the allocated peak in the recorded traces,
`tests/cost/data/h200_allocator`, up to 6.6% with freed pages kept mapped). Plans are held, in allocated bytes,
to the budget less `allocator_slack`, and the process's cap is lowered to the budget (`cap_reserved`): where
reserved would still grow past it, the allocator gives back pages no tensor uses instead.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch

from dpcs_compiler.diagnostics import DpcsWarning

AUTO_MARGIN_FRACTION = 0.05  # of total device memory, kept free under "auto"
# Of the budget, left for memory kernels allocate inside themselves, which no graph shows: measured, CPU
# convolution_backward's internal copy (72 KB on a 65 MiB conv-net step); on CUDA, cuDNN/cuBLAS workspaces.
WORKSPACE_FRACTION = 0.0025


# What a CUDA budget keeps for the caching allocator beyond the bytes plans allocate (`allocator_slack`). With
# expandable segments, reserved is the live bytes plus the free parts of pages live blocks touch (which no release
# gives back) plus freed pages kept mapped. On the H200 (torch 2.11, the 439M Llama of benchmarks/gpu_scale.py),
# uncapped, reserved ran 2.0% above the allocated peak under plans that recompute little (16 GiB) and 3.8-6.6%
# under plans that recompute ~100 values (12 GiB); under a cap at the budget with 2% kept, the pages live blocks
# touched came to 2.9% of the budget above the live bytes and a step ran out of memory, and the release-and-retry
# that the cap forces cost 6.6% of a step (2026-12-04, `benchmarks/results/h200_2026-12-04b`). Kept: 7%, enough that
# the cap (`cap_reserved`) is rarely reached. Without expandable segments blocks split across segments (2-11%
# above allocated under torch's own plans, 30-32% under dpcs's before it bounded reserved bytes): 12%.
EXPANDABLE_PAGE_BYTES = 20 << 20  # the large pool's page (the allocator's large segment size)
EXPANDABLE_SLACK_PAGES = 8
EXPANDABLE_SLACK_FRACTION = 0.07
SEGMENTED_SLACK_FRACTION = 0.12


# What the caching allocator reserves beyond a step's allocated peak, as expected (not bounded): with expandable
# segments 2.0-6.6% of it on the H200 runs above (the middle: 4%); without, torch's own plans measured 3.6-10%
# (`benchmarks/results/h200_2026-12-04_explore`).
EXPANDABLE_EXPECTED_FRACTION = 0.04
SEGMENTED_EXPECTED_FRACTION = 0.08


def predicted_reserved(allocated_peak: int, reserved_now: int, expandable: bool, cap: int | None = None) -> int:
    """The caching allocator's reserved peak expected for a step whose allocated peak is `allocated_peak`, with
    `reserved_now` reserved when it is planned (reserved never falls without a release, nor rises past the
    process's `cap` while freed pages can be given back)."""
    fraction = EXPANDABLE_EXPECTED_FRACTION if expandable else SEGMENTED_EXPECTED_FRACTION
    expected = max(reserved_now, allocated_peak + int(fraction * allocated_peak))
    return expected if cap is None else min(cap, expected)


def allocator_slack(budget_bytes: int, expandable: bool) -> int:
    """Bytes of a CUDA budget left to the caching allocator: what it reserves beyond what tensors hold."""
    if expandable:
        return max(EXPANDABLE_SLACK_PAGES * EXPANDABLE_PAGE_BYTES, int(EXPANDABLE_SLACK_FRACTION * budget_bytes))
    return int(SEGMENTED_SLACK_FRACTION * budget_bytes)


_ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_EXPANDABLE: list[bool] = []  # set once per process: whether dpcs runs with expandable segments


def expandable_segments_on() -> bool:
    """Whether dpcs runs the CUDA allocator with expandable segments (False before a CUDA budget was planned)."""
    return bool(_EXPANDABLE and _EXPANDABLE[0])


def use_expandable_segments() -> bool:
    """Turn on the CUDA caching allocator's expandable segments, once per process (a budget on CUDA bounds
    reserved bytes, and they keep reserved close to allocated); whether they are on.

    The user's allocator settings win: when PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) names
    `expandable_segments`, it stays as given; with `max_split_size_mb` they stay off (together they make
    reserved grow without bound, pytorch#123548), with a warning. The settings string given to torch restates
    the user's, since setting it resets what it does not name. Known conflicts of expandable segments, which a
    user avoids with `expandable_segments:False`: tensors shared between processes through CUDA IPC, and
    NCCL's user-buffer registration."""
    if _EXPANDABLE:
        return _EXPANDABLE[0]
    conf = next((os.environ[e] for e in _ALLOC_CONF_ENVS if os.environ.get(e)), "")
    settings = {k.strip().lower(): v.strip().lower() for k, _, v in (p.partition(":") for p in conf.split(",") if p.strip())}
    if "expandable_segments" in settings:
        on = settings["expandable_segments"] == "true"
    elif "max_split_size_mb" in settings:
        warnings.warn(
            "dpcs: PYTORCH_CUDA_ALLOC_CONF sets max_split_size_mb, so dpcs leaves expandable segments off (the two "
            "together make reserved memory grow without bound, pytorch#123548); the budget keeps "
            f"{SEGMENTED_SLACK_FRACTION:.0%} of itself for the allocator's fragmentation",
            category=DpcsWarning, stacklevel=2)
        on = False
    else:
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        setter(",".join(filter(None, [conf, "expandable_segments:True"])))
        on = True
    _EXPANDABLE.append(on)
    return on


# The process's cap on each CUDA device as dpcs set it (`cap_reserved`): device index -> (the cap the process had
# before dpcs lowered it, in bytes; the cap dpcs set).
_CAPS: dict[int, tuple[int, int]] = {}


def cap_reserved(budget_bytes: int, device: torch.device) -> int:
    """Hold what the process reserves on `device` to a budget: the caching allocator's per-process cap
    (`torch.cuda.set_per_process_memory_fraction`) lowered to `budget_bytes`; the cap in force after.

    Planned in allocated bytes, a step's reserved peak still grows past its budget where the allocator keeps
    freed pages mapped and maps new ones for the next allocation (1.5-4.2% over on the H200, torch 2.11). Under a
    cap, the allocator instead gives back the pages no tensor uses and retries, so reserved stays within it. A
    cap the process already has below the budget (the user's) stays; with several budgets in one process the cap
    is the largest of them (each budget bounds its own step), never above the cap found before dpcs set one. A
    cap the user sets after dpcs's is taken as theirs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = int(torch.cuda.get_device_properties(index).total_memory)
    current = int(torch.cuda.get_per_process_memory_fraction(index) * total)
    found, ours = _CAPS.get(index, (current, None))
    if ours is None or abs(current - ours) > 2:  # none of dpcs's (the fraction rounds), or the user set another
        found, ours = current, None
    cap = min(found, max(budget_bytes, ours or 0))
    if cap != current:
        torch.cuda.set_per_process_memory_fraction(cap / total, index)
    _CAPS[index] = (found, cap)
    return cap


def planning_target(budget_bytes: int) -> int:
    """The peak plans are held to: the budget less `WORKSPACE_FRACTION` of it."""
    return budget_bytes - int(budget_bytes * WORKSPACE_FRACTION)


# What a measured step may hold beyond its prediction and still count as predicted (measurement noise, and
# errors too small to plan again for): the larger of these (`measurement_tolerance`). The step recorder plans
# again only for more (`step/`); a plan that drops the fusion guard keeps this much to spare
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
