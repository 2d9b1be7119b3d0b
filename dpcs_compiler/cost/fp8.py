"""Whether a linear trains faster as an fp8 linear than in its region's dtype, at its shape.

A linear of M tokens, K input and N output features takes three matmuls a step: the forward (M, K, N), the
input gradient (M, N, K) and the weight gradient (N, M, K), each an (rows x inner) @ (inner x cols) product.
In its region's dtype (bf16 or fp16 under `precision`, fp32 without) the fp32 weight is cast down in the
forward and its gradient cast up in the backward. As an fp8 linear (`ops/fp8.py`) each operand is scaled
and cast first, and `_scaled_mm` wants one operand row-major and the other column-major, so three operands
are copied to their layout in the backward:

    tensorwise  forward   amax and cast of x (2 reads, 1 fp8 write) and of the fp32 weight
                backward  amax and cast of the output gradient and of the weight again; copies of the fp8
                          weight, the fp8 gradient's transpose and the saved fp8 x
    rowwise     as tensorwise, but the backward scales the gradient twice (per row for the input gradient,
                per column for the weight gradient) and x again from the saved activation

Each pass is memory-bound: its bytes at the profile's bandwidth, plus one kernel launch (Inductor fuses an
amax and its cast into neighbouring kernels where it can, so this is an upper bound on the fp8 side).

A matmul's time comes from the profile's `matmul_table` when it times both kinds compared (the row nearest
in log M, log K, log N gives the rate achieved at that shape), else from the kinds' peak rates as a roofline.
Peaks say fp8 is twice bf16 at every size; the table says what a GPU achieves at the shape, which is where
fp8 loses on small matmuls (torchao measures 0.80x bf16 at M, K, N = 1024, 2048, 1024 and 1.39x at 4096,
8192, 16384). Pure functions of sizes and a profile.
"""

from __future__ import annotations

import dataclasses
import math

from dpcs_compiler.cost.hardware import FP8_ROWWISE, FP8_TENSORWISE, HardwareProfile
from dpcs_compiler.cost.op_time import memory_seconds, roofline_seconds

# The kind each fp8 recipe's matmuls are timed as in a profile.
FP8_KINDS = {"tensorwise": FP8_TENSORWISE, "rowwise": FP8_ROWWISE}
REGION_KINDS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
WEIGHT_BYTES = 4  # the fp32 master weight the region casts from


@dataclasses.dataclass(frozen=True)
class LinearSeconds:
    """One linear's step seconds (forward and backward) as an fp8 linear and in its region's dtype."""

    fp8_s: float | None  # None: the profile has no fp8 matmul speed
    region_s: float
    source: str  # "measured table" or "peak rates"

    @property
    def fp8_faster(self) -> bool:
        return self.fp8_s is not None and self.fp8_s < self.region_s

    @property
    def speedup(self) -> float | None:
        """Region seconds over fp8 seconds (> 1: fp8 is faster)."""
        return None if self.fp8_s is None else self.region_s / self.fp8_s


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def table_seconds(profile: HardwareProfile, kind: str, m: int, k: int, n: int) -> float | None:
    """An (m x k) @ (k x n) matmul of `kind` at the rate the profile's table measured at the nearest shape (in
    log sizes), or None if the table does not time `kind`."""
    rows = (profile.matmul_table or {}).get(kind)
    if not rows:
        return None
    point = (math.log(m), math.log(k), math.log(n))
    nearest = min(rows, key=lambda r: sum((a - math.log(b)) ** 2 for a, b in zip(point, r[:3])))
    rate = 2 * nearest[0] * nearest[1] * nearest[2] / nearest[3]
    return 2 * m * k * n / rate


def peak_seconds(profile: HardwareProfile, kind: str, m: int, k: int, n: int) -> float | None:
    """An (m x k) @ (k x n) matmul of `kind` by roofline at the profile's peak rates (the fp8 kinds at its
    float8 figure, operands of one byte, output bf16), or None if it has no figure for `kind`."""
    dtype = kind.partition(":")[0]
    if dtype not in profile.matmul_flops:  # op_time would cost it at float32's rate: here, no figure is none
        return None
    element = 1 if dtype.startswith("float8") else _ELEMENT_BYTES[dtype]
    out = 2 if dtype.startswith("float8") else element
    return roofline_seconds(2 * m * k * n, element * (m * k + k * n) + out * m * n, dtype, profile)


def _passes_seconds(profile: HardwareProfile, nbytes: int, kernels: int) -> float:
    return memory_seconds(nbytes, profile) + kernels * profile.launch_overhead_s


def fp8_cast_bytes(recipe: str, m: int, k: int, n: int, activation_bytes: int) -> tuple[float, int]:
    """Bytes the fp8 linear's scaling, casting and layout passes move in a step, and how many kernels they are
    (see the module docstring)."""
    a = activation_bytes
    cast = lambda elements, width: elements * (2 * width + 1)  # noqa: E731  (amax read, cast read, fp8 write)
    weight = 2 * cast(k * n, WEIGHT_BYTES)  # forward and backward
    copies = 2 * (k * n + m * n + m * k)  # the fp8 weight, gradient transpose and x, read and written
    if recipe == "tensorwise":
        return cast(m * k, a) + cast(m * n, a) + weight + copies, 4 + 4 + 3
    if recipe == "rowwise":
        return 2 * cast(m * k, a) + 2 * cast(m * n, a) + weight + copies, 4 + 8 + 3
    raise ValueError(f"recipe={recipe!r} is not valid; valid choices: {', '.join(map(repr, FP8_KINDS))}")


def linear_seconds(profile: HardwareProfile, m: int, k: int, n: int, *, recipe: str, region: str) -> LinearSeconds:
    """A linear of `m` tokens, `k` in and `n` out features, forward and backward: as an fp8 linear of
    `recipe`, and in `region` ("bf16", "fp16" or "fp32")."""
    _check_sizes(tokens=m, in_features=k, out_features=n)
    if recipe not in FP8_KINDS:
        raise ValueError(f"recipe={recipe!r} is not valid; valid choices: {', '.join(map(repr, FP8_KINDS))}")
    if region not in REGION_KINDS:
        raise ValueError(f"region={region!r} is not valid; valid choices: {', '.join(map(repr, REGION_KINDS))}")
    fp8_kind, region_kind = FP8_KINDS[recipe], REGION_KINDS[region]
    shapes = ((m, k, n), (m, n, k), (n, m, k))  # forward, input gradient, weight gradient
    table = profile.matmul_table or {}
    timed = fp8_kind in table and region_kind in table  # one source for both sides, never one of each
    matmul = table_seconds if timed else peak_seconds
    region_matmuls = [matmul(profile, region_kind, *shape) for shape in shapes]
    if None in region_matmuls:  # no figure for the region's dtype: float32's, as op_time does
        region_matmuls = [peak_seconds(profile, "float32", *shape) for shape in shapes]
    region_s = sum(region_matmuls)  # type: ignore[arg-type]
    if region != "fp32":  # the weight cast down in the forward, its gradient cast up in the backward
        region_s += _passes_seconds(profile, 2 * k * n * (WEIGHT_BYTES + _ELEMENT_BYTES[region_kind]), 2)
    fp8_matmuls = [matmul(profile, fp8_kind, *shape) for shape in shapes]
    fp8_s = None
    if None not in fp8_matmuls:
        nbytes, kernels = fp8_cast_bytes(recipe, m, k, n, _ELEMENT_BYTES[region_kind])
        fp8_s = sum(fp8_matmuls) + _passes_seconds(profile, nbytes, kernels)  # type: ignore[arg-type]
    return LinearSeconds(fp8_s, region_s, "measured table" if timed else "peak rates")
