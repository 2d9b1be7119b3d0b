"""What keeping an optimizer's state one way or another costs: bytes on the device and seconds added to a
step. Pure functions of counts and measured rates (`StateRates`), no optimizer inside.

A lever is a format for the state tensors an optimizer may store compressed (`model_states/state_codec.py`) and
whether they live in host memory between steps. Stored compressed, a state is decoded and encoded again
once per step (a chunk at a time); in host memory, it also crosses the host link both ways. Where the host
is the device's own memory (a CPU run), host levers save nothing and are not offered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping

FORMATS = ("fp32", "bf16", "fp16", "int8")
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
_SCALED = ("fp16", "int8")


# Bytes of memory traffic per element that encoding and decoding a state in each format amount to, as
# `model_states/state_codec.py` does it with torch's eager kernels: a plain copy reads and writes each element once;
# the scaled formats' block scales, normalisation and level search take many passes. Those two were calibrated
# on CPU (AMD EPYC, 2 threads, torch 2.13: measured seconds per element times the measured profile's memory
# bandwidth, 34 GB/s; fp16 67/11-12, int8 133-162/30-31, rounded up). Costs are then a function of the planning
# profile alone, the same on every machine that plans with it; on a GPU, where each pass is bandwidth-bound,
# the scaled formats are likely overestimated (they are chosen only where the others do not fit anyway).
CODEC_TRAFFIC_BYTES = {"fp32": (8.0, 8.0), "bf16": (6.0, 6.0), "fp16": (72.0, 12.0), "int8": (168.0, 32.0)}


def codec_rates(memory_bandwidth: float) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per element to encode and to decode each format on a device of this memory bandwidth (bytes
    per second), from `CODEC_TRAFFIC_BYTES`."""
    if not memory_bandwidth > 0:
        raise ValueError(f"codec_rates: memory_bandwidth={memory_bandwidth!r} is not valid: bytes per second > 0")
    return ({fmt: e / memory_bandwidth for fmt, (e, _) in CODEC_TRAFFIC_BYTES.items()},
            {fmt: d / memory_bandwidth for fmt, (_, d) in CODEC_TRAFFIC_BYTES.items()})


@dataclasses.dataclass(frozen=True)
class StateLever:
    """How an optimizer's storable state is kept between steps."""

    format: str = "fp32"
    on_host: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"StateLever.format={self.format!r} is not a state format; valid: {', '.join(FORMATS)}")

    def describe(self) -> str:
        return f"{self.format}{' in host memory' if self.on_host else ''}"


@dataclasses.dataclass(frozen=True)
class OptimizerStateShape:
    """An optimizer's state in counts: the elements of the state tensors a lever may store (per parameter, its
    elements times its storable states), the bytes that stay as they are whatever the lever (tensors below the
    small-tensor bypass, step counts), the stored blocks' size, and the full-precision elements decoded at a
    time inside the step (the chunk)."""

    stored_elements: int
    kept_bytes: int = 0
    block_size: int = 256
    chunk_elements: int = 1 << 24
    blocks: int | None = None  # scaled blocks of the stored state (blocks never cross a row); None: elements / size

    def __post_init__(self) -> None:
        for name in ("stored_elements", "kept_bytes", "block_size", "chunk_elements", "blocks"):
            value = getattr(self, name)
            if name == "blocks" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "block_size" else 0):
                raise ValueError(f"OptimizerStateShape.{name}={value!r} is not valid: an int >= "
                                 f"{1 if name == 'block_size' else 0}")


@dataclasses.dataclass(frozen=True)
class StateRates:
    """Measured on the device the state is used on: seconds per element to encode and to decode each format,
    and the host link's bytes per second each way (None: the host is the device's memory)."""

    encode_seconds: Mapping[str, float]
    decode_seconds: Mapping[str, float]
    link_bytes_per_second: float | None
    # Seconds per parameter element that stepping the optimizer on the host adds over stepping it on the device
    # (a block whose parameters are offloaded is stepped where they live); 0 where the host is the device.
    host_step_seconds: float = 0.0


def stored_bytes(shape: OptimizerStateShape, fmt: str) -> int:
    """Bytes of the storable state in format `fmt`: the elements, and one fp32 scale per block when scaled."""
    blocks = math.ceil(shape.stored_elements / shape.block_size) if shape.blocks is None else shape.blocks
    scales = 4 * blocks if fmt in _SCALED else 0
    return shape.stored_elements * _ELEMENT_BYTES[fmt] + scales


def device_bytes(shape: OptimizerStateShape, lever: StateLever) -> int:
    """The state's bytes on the device between steps (and through forward and backward)."""
    return shape.kept_bytes + (0 if lever.on_host else stored_bytes(shape, lever.format))


def step_transient_bytes(shape: OptimizerStateShape, lever: StateLever) -> int:
    """Full-precision state decoded at once inside the optimizer step (a chunk); nothing when kept as is."""
    if lever == StateLever():
        return 0
    return 4 * min(shape.chunk_elements, shape.stored_elements)


def estimated_step_transient(measured: Mapping[Hashable, int], regime: Hashable,
                             decoded: Callable[[Hashable], int]) -> int | None:
    """The bytes an optimizer step allocates beyond its start and end (its temporaries) when the model state is
    kept as `regime` says (any hashable: a lever and the blocks offloaded), from those `measured` under other
    regimes: as measured under `regime` itself; else the most measured under any other, plus what `regime`
    decodes at once beyond it (`decoded`: a regime's full-precision chunk bytes). An estimate on the high
    side: a regime that decodes less is not credited for it until it is measured. None: nothing measured."""
    if not measured:
        return None
    if regime in measured:
        return measured[regime]
    return max(nbytes + max(0, decoded(regime) - decoded(other)) for other, nbytes in measured.items())


def added_seconds(shape: OptimizerStateShape, lever: StateLever, rates: StateRates) -> float:
    """Seconds the lever adds to a step: decoding and encoding the stored state, and moving it over the host
    link both ways when it lives there."""
    if lever == StateLever():
        return 0.0
    codec = shape.stored_elements * (rates.encode_seconds[lever.format] + rates.decode_seconds[lever.format])
    if not lever.on_host:
        return codec
    if rates.link_bytes_per_second is None:
        raise ValueError("a host lever on a device whose host is its own memory: nothing to move, nothing saved")
    return codec + 2 * stored_bytes(shape, lever.format) / rates.link_bytes_per_second


def offload_seconds(parameter_bytes: int, gradient_bytes: int, parameter_elements: int, rates: StateRates) -> float:
    """Seconds offloading a block's parameters adds to a step: they cross the host link twice (before its
    forward and before its backward), its gradients once, and its optimizer step runs on the host. Counted
    whole, as if no copy overlapped compute (they run on a side stream, so this is an upper bound)."""
    if rates.link_bytes_per_second is None:
        raise ValueError("offloading parameters on a device whose host is its own memory: nothing saved")
    return ((2 * parameter_bytes + gradient_bytes) / rates.link_bytes_per_second
            + parameter_elements * rates.host_step_seconds)


def levers(host_is_device: bool) -> list[StateLever]:
    """The levers worth offering: every format, and in host memory too where that is other memory."""
    on_device = [StateLever(fmt) for fmt in FORMATS]
    return on_device if host_is_device else on_device + [StateLever(fmt, True) for fmt in FORMATS]
