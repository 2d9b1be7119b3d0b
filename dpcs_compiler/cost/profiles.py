"""Which hardware profile a plan is costed with: measured, built-in, or read from a file.

`parse_profile_spec` validates what a user gives (the `hardware_profile` option or DPCS_HARDWARE_PROFILE):
"measure" (the device's own profile, measured once and cached, `cost/hardware.py`), the name of a built-in
profile, a path to a profile JSON file, or a `HardwareProfile`. `resolve_profile` turns a spec into the
profile and where it came from.

Built-in profiles are datasheet figures for the GPUs people train on, and a fixed reference CPU. With one of
these a plan does not depend on the machine that compiles it: plan on a laptop for the GPU the job will run
on (`hardware_profile="h100"`), or plan the same on every CI machine (`"reference-cpu"`).

GPU figures are the vendors' dense peak rates (no structured sparsity) with FP32 accumulation, as torch's
matmuls accumulate: float32 is the non-tensor-core FP32 rate, what torch runs at its default float32 matmul
precision ("highest"; TF32 needs `torch.set_float32_matmul_precision("high")`). The host link is one
direction of the PCIe slot (half the bidirectional figure the datasheets quote). Kernels reach 60-80% of
these peaks, about alike for every op, so the plan's choices (which depend on ratios of costs) hold while
its absolute time estimates are optimistic. `launch_overhead_s` is not a datasheet figure: 5 us is a
typical eager CUDA kernel launch. Nor is the host time of an offload's ops, which these profiles leave
unmeasured: each offloaded value costs `cost.op_time.OFFLOAD_OPS_FLOOR_S` (a floor; a measured profile of the
GPU itself has its own figure).

Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB); NVIDIA A100 datasheet (SXM4 80GB); NVIDIA L4
datasheet; NVIDIA Ada GPU architecture whitepaper, appendix (GeForce RTX 4090).

The reference CPU is a 2-core x86 server CPU with AVX2 and no bf16/fp16 matmul units (the figures are those
`measure_hardware_profile` gave on such a machine, rounded): bf16 and fp16 matmuls are ~70x slower than fp32
there, as on CI's AVX2-only machines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch

from dpcs_compiler.cost.hardware import (
    FORMAT_VERSION,
    HardwareProfile,
    ResolvedProfile,
    measured_profile,
    profile_from_json,
)

MEASURE = "measure"

DATASHEET = "datasheet"  # measured_at and torch_version of a built-in profile
GPU_LAUNCH_OVERHEAD_S = 5e-6
GiB = 2**30


def _gpu(name: str, capability: str, *, fp32: float, bf16: float, fp16: float, fp8: float | None,
         bandwidth: float, pcie: float, memory_gib: int) -> HardwareProfile:
    flops = {"float32": fp32, "bfloat16": bf16, "float16": fp16}
    if fp8 is not None:
        flops["float8_e4m3fn"] = fp8
    return HardwareProfile(
        device_key=f"cuda:{name}:{capability}",  # as device_key() names the real device
        torch_version=DATASHEET,
        format_version=FORMAT_VERSION,
        matmul_flops=flops,
        memory_bandwidth=bandwidth,
        host_to_device=pcie,
        device_to_host=pcie,
        launch_overhead_s=GPU_LAUNCH_OVERHEAD_S,
        measured_at=DATASHEET,
        memory_bytes=memory_gib * GiB,
    )


# name -> (what it is, profile)
BUILTIN_PROFILES: dict[str, tuple[str, HardwareProfile]] = {
    "h100": (
        "NVIDIA H100 SXM5 80GB, datasheet",
        _gpu("NVIDIA H100 80GB HBM3", "9.0", fp32=67e12, bf16=989.4e12, fp16=989.4e12, fp8=1978.9e12,
             bandwidth=3.35e12, pcie=64e9, memory_gib=80),
    ),
    "a100": (
        "NVIDIA A100 SXM4 80GB, datasheet",
        _gpu("NVIDIA A100-SXM4-80GB", "8.0", fp32=19.5e12, bf16=312e12, fp16=312e12, fp8=None,
             bandwidth=2.039e12, pcie=32e9, memory_gib=80),
    ),
    "l4": (
        "NVIDIA L4 24GB, datasheet",
        _gpu("NVIDIA L4", "8.9", fp32=30.3e12, bf16=121e12, fp16=121e12, fp8=242.5e12,
             bandwidth=300e9, pcie=32e9, memory_gib=24),
    ),
    "rtx4090": (
        "NVIDIA GeForce RTX 4090 24GB, Ada whitepaper (FP32 accumulate)",
        _gpu("NVIDIA GeForce RTX 4090", "8.9", fp32=82.6e12, bf16=165.2e12, fp16=165.2e12, fp8=330.3e12,
             bandwidth=1008e9, pcie=32e9, memory_gib=24),
    ),
    "reference-cpu": (
        "dpcs's fixed reference CPU: 2 cores, AVX2, no bf16/fp16 matmul units",
        HardwareProfile(
            device_key="cpu:dpcs reference CPU (2-core AVX2):2",
            torch_version=DATASHEET,
            format_version=FORMAT_VERSION,
            matmul_flops={"float32": 2e11, "bfloat16": 3e9, "float16": 3e9},
            memory_bandwidth=3.5e10,
            host_to_device=None,
            device_to_host=None,
            launch_overhead_s=1.5e-6,
            measured_at=DATASHEET,
            memory_bytes=24 * GiB,
        ),
    ),
}


ProfileSpec = Union[str, Path, HardwareProfile]  # "measure", a built-in name, a file, or a profile


def profile_choices() -> str:
    """The valid forms of a profile spec, as errors list them."""
    names = ", ".join(repr(n) for n in BUILTIN_PROFILES)
    return f"{MEASURE!r} (measured on this device, cached), a built-in profile ({names}), a path to a profile JSON file"


def parse_profile_spec(value: object, *, source: str) -> ProfileSpec:
    """Validate a profile spec; `source` names where it came from in errors ("dpcs option 'hardware_profile'").

    A string is a file path if it ends with .json or holds a path separator; any other string must be
    "measure" or a built-in name, so a misspelt name is an error, not a missing file.
    """
    if isinstance(value, HardwareProfile):
        return value
    if isinstance(value, os.PathLike):
        return Path(value)
    if isinstance(value, str):
        text = value.strip()
        if text == MEASURE or text in BUILTIN_PROFILES:
            return text
        if text.lower().endswith(".json") or "/" in text or os.sep in text:
            return Path(text).expanduser()
    raise ValueError(f"{source}={value!r} is not valid; valid choices: {profile_choices()}, or a HardwareProfile")


def resolve_profile(
    spec: ProfileSpec, device: torch.device | str, *, cache_dir: str | os.PathLike[str] | None = None,
    refresh: bool = False,
) -> ResolvedProfile:
    """The profile a spec names, and where it came from. "measure" measures `device` (once, cached);
    `refresh` measures again and is only valid with "measure"."""
    if refresh and spec != MEASURE:
        raise ValueError(f"refresh re-measures the device; the profile {_spec_text(spec)} is not measured")
    if isinstance(spec, HardwareProfile):
        return ResolvedProfile(spec, "given in code")
    if spec == MEASURE:
        return measured_profile(device, cache_dir=cache_dir, refresh=refresh)
    if isinstance(spec, str):
        description, profile = BUILTIN_PROFILES[spec]
        return ResolvedProfile(profile, f"built-in {spec!r} ({description})")
    try:
        text = Path(spec).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"hardware profile file {str(spec)!r} cannot be read ({e}); valid choices: {profile_choices()}") from e
    try:
        profile = profile_from_json(text)
    except ValueError as e:
        raise ValueError(f"hardware profile file {str(spec)!r}: {e} (`dpcs hardware --json` writes a valid one)") from e
    return ResolvedProfile(profile, f"file {Path(spec).resolve()}")


def _spec_text(spec: ProfileSpec) -> str:
    return "given in code" if isinstance(spec, HardwareProfile) else repr(str(spec))
