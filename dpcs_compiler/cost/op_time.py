"""How long one op takes, by roofline: a fixed per-op cost plus the larger of its compute and memory time.

compute time = FLOPs / the profile's matmul FLOP/s for the op's dtype; memory time = bytes read and written /
the device's copy bandwidth. An optional `Calibration` (see calibration.py) scales the two terms separately
and replaces the fixed cost. Pure functions of numbers, a dtype and a profile: no graph access here. This
module owns `Calibration`; calibration.py fits one from measured ops (it imports this module, never the
reverse).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from dpcs_compiler.cost.hardware import HardwareProfile
from dpcs_compiler.types import NodeCost

FALLBACK_DTYPE = "float32"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Scales for the roofline's compute and memory terms, and the per-op fixed cost.

    The default is the identity: scales 1 and overhead_s None, meaning the profile's launch overhead.
    """

    compute_scale: float = 1.0
    memory_scale: float = 1.0
    overhead_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("compute_scale", "memory_scale", "overhead_s"):
            value = getattr(self, name)
            if value is None and name == "overhead_s":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                also = " or None" if name == "overhead_s" else ""
                raise ValueError(f"calibration: {name} must be a finite number >= 0{also}, got {value!r}")
            object.__setattr__(self, name, float(value))  # a numpy scalar hashes and serializes as a float


def dtype_name(dtype: torch.dtype | str) -> str:
    """The profile's name for a dtype: torch.bfloat16 and "torch.bfloat16" are both "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def matmul_flops_for(dtype: torch.dtype | str, profile: HardwareProfile) -> float:
    """The profile's FLOP/s for `dtype`.

    A dtype the profile has no figure for uses the float32 figure (integer and float64 ops count few FLOPs
    in training graphs; float32 is the closest measured rate), except that any float8 variant uses the
    measured float8 figure when there is one.
    """
    name = dtype_name(dtype)
    if name in profile.matmul_flops:
        return profile.matmul_flops[name]
    if name.startswith("float8"):
        for measured, rate in sorted(profile.matmul_flops.items()):
            if measured.startswith("float8"):
                return rate
    return profile.matmul_flops[FALLBACK_DTYPE]


def _check_count(name: str, value: int | float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def compute_seconds(flops: int, dtype: torch.dtype | str, profile: HardwareProfile) -> float:
    """The roofline's compute term: FLOPs at the dtype's matmul rate."""
    _check_count("flops", flops)
    return flops / matmul_flops_for(dtype, profile)


def memory_seconds(bytes_moved: int, profile: HardwareProfile) -> float:
    """The roofline's memory term: bytes read plus written at the device's copy bandwidth."""
    _check_count("bytes_moved", bytes_moved)
    return bytes_moved / profile.memory_bandwidth


def combine_seconds(
    compute_s: float, memory_s: float, profile: HardwareProfile, calibration: Calibration | None = None
) -> float:
    """Fixed cost + max(compute, memory), each term scaled by the calibration when there is one."""
    if calibration is None:
        return profile.launch_overhead_s + max(compute_s, memory_s)
    overhead = profile.launch_overhead_s if calibration.overhead_s is None else calibration.overhead_s
    return overhead + max(calibration.compute_scale * compute_s, calibration.memory_scale * memory_s)


def roofline_seconds(
    flops: int,
    bytes_moved: int,
    dtype_name: torch.dtype | str,
    profile: HardwareProfile,
    calibration: Calibration | None = None,
) -> float:
    """Estimated seconds of one op: launch overhead + max(flops / FLOP/s[dtype], bytes / bandwidth).

    An unmeasured dtype uses the float32 rate (see `matmul_flops_for`); negative counts raise ValueError.
    """
    return combine_seconds(
        compute_seconds(flops, dtype_name, profile), memory_seconds(bytes_moved, profile), profile, calibration
    )


def roofline_terms(node_cost: NodeCost, dtype: torch.dtype | str, profile: HardwareProfile) -> tuple[float, float]:
    """One graph node's roofline terms, uncalibrated: (compute seconds, memory seconds of bytes read + written)."""
    return (
        compute_seconds(node_cost.flops, dtype, profile),
        memory_seconds(node_cost.bytes_read + node_cost.bytes_written, profile),
    )


def node_seconds(
    node_cost: NodeCost,
    dtype: torch.dtype | str,
    profile: HardwareProfile,
    calibration: Calibration | None = None,
) -> float:
    """Estimated seconds of one graph node from its op_cost entry; it moves bytes_read + bytes_written."""
    return combine_seconds(*roofline_terms(node_cost, dtype, profile), profile, calibration)


# Host seconds of one offloaded value's four ops where the profile has no measurement (a built-in profile, or
# one measured before format 3). Their CPU path, which makes no streams or events, measures 26-28 us per value
# on a 2-core AVX2 EPYC (torch 2.13; 78-116 us while they were `torch.library.custom_op`s); the CUDA path
# also switches streams and records and waits on events, three of each per value, and allocates pinned
# memory. Not measured on a GPU yet: 50 us stands for it until a profile measures it.
OFFLOAD_OPS_FLOOR_S = 50e-6


def offload_ops_seconds(profile: HardwareProfile) -> float:
    """Host seconds one offloaded value's ops add to a step, in full: the host issues them in line with the
    step's kernels, so unlike the copies themselves (`transfer_seconds`, hidden behind compute where the
    window allows) they are not hidden. The profile's measurement, else `OFFLOAD_OPS_FLOOR_S`.

    A CPU profile has no host link: ValueError.
    """
    if profile.host_to_device is None:
        raise ValueError(
            f"profile {profile.device_key!r} has no host link (a CPU device is its own host): no offload ops"
        )
    return profile.offload_ops_s if profile.offload_ops_s is not None else OFFLOAD_OPS_FLOOR_S


def transfer_seconds(nbytes: int, profile: HardwareProfile, *, to_host: bool = True) -> float:
    """Seconds to copy `nbytes` one way over the pinned host link (device to host, or back with to_host=False).

    A CPU profile has no host link: ValueError.
    """
    _check_count("nbytes", nbytes)
    bandwidth = profile.device_to_host if to_host else profile.host_to_device
    if bandwidth is None:
        raise ValueError(
            f"profile {profile.device_key!r} has no host link (a CPU device is its own host): no transfer time"
        )
    return profile.launch_overhead_s + nbytes / bandwidth
