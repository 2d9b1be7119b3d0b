"""What keeping an optimizer's state one way or another costs: bytes on the device and seconds added to a
step. Pure functions of counts and measured rates (`StateRates`), no optimizer inside.

A lever is a format for the state tensors an optimizer may store compressed (`model_states/state_codec.py`) and
whether they live in host memory between steps. Stored compressed, a state is decoded and encoded again
once per step (a chunk at a time); in host memory, it also crosses the host link both ways. Where the host
is the device's own memory (a CPU run), host levers save nothing and are not offered.

A block whose parameters are offloaded (`ParameterOffload`) costs its copies and its optimizer step on the host;
with `CompressedOptimizer(overlap=True)` that step runs beside the next forward and costs only the wait it
causes (`host_step_stall`), from when each block's forward starts (`block_forward_starts`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping, Sequence

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
    # Seconds per parameter element of that step on the device: what the device's own step no longer runs for
    # an offloaded block (the host step in full is host_step_seconds + this). 0: not measured, not credited.
    device_step_seconds: float = 0.0


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


def offload_link_seconds(parameter_bytes: int, gradient_bytes: int, rates: StateRates) -> float:
    """Seconds an offloaded block's copies take: its parameters cross the host link twice (before its forward
    and before its backward), its gradients once. Counted whole, as if no copy overlapped compute (they run on
    a side stream, so this is an upper bound)."""
    if rates.link_bytes_per_second is None:
        raise ValueError("offloading parameters on a device whose host is its own memory: nothing saved")
    return (2 * parameter_bytes + gradient_bytes) / rates.link_bytes_per_second


def offload_seconds(parameter_bytes: int, gradient_bytes: int, parameter_elements: int, rates: StateRates) -> float:
    """Seconds offloading a block's parameters adds to a step: its copies (`offload_link_seconds`), and its
    optimizer step, run on the host in the foreground, over what that step takes on the device."""
    return (offload_link_seconds(parameter_bytes, gradient_bytes, rates)
            + parameter_elements * rates.host_step_seconds)


def host_step_stall(host_seconds: Sequence[float], starts: Sequence[float]) -> float:
    """Seconds the next forward waits for optimizer steps run on a background thread while it goes on
    (`CompressedOptimizer(overlap=True)`, as ZeRO-Offload does): from the moment the step returns, the thread
    steps the blocks one after another in the order given (the forward's), block i taking `host_seconds[i]`;
    block i's forward would start `starts[i]` seconds after that moment and waits until its own step has
    ended. A wait delays every later block's forward alike, so the step ends
    max(0, max over i of (the steps of blocks 0..i) - starts[i]) later."""
    if len(host_seconds) != len(starts):
        raise ValueError(f"host_step_stall: {len(host_seconds)} host steps for {len(starts)} starts")
    if any(not (h >= 0) for h in host_seconds) or any(not (s >= 0) for s in starts):
        raise ValueError(f"host_step_stall: seconds must be >= 0; got {list(host_seconds)}, {list(starts)}")
    ended, stall = 0.0, 0.0
    for seconds, start in zip(host_seconds, starts):
        ended += seconds
        stall = max(stall, ended - start)
    return stall


def overlapped_host_step_seconds(elements: Sequence[int], starts: Sequence[float], rates: StateRates) -> float:
    """Seconds the host steps of offloaded blocks, overlapped with the next forward, add to a step: the wait
    they cause (`host_step_stall`, each block's host step in full), less what the device's own step no longer
    runs for them; never below nothing (a step hidden whole is credited no more than its cost)."""
    full = [n * (rates.host_step_seconds + rates.device_step_seconds) for n in elements]
    return max(0.0, host_step_stall(full, starts) - sum(elements) * rates.device_step_seconds)


def block_forward_starts(call_forward_seconds: Sequence[float], call_parameter_bytes: Sequence[int],
                         call_blocks: Sequence[Sequence[int]], block_bytes: Sequence[int]) -> list[float]:
    """When each block's forward starts, in seconds after the step's first forward starts, from the forward
    seconds of each call and the blocks each call takes (indices into `block_bytes`, in the order it runs them):
    at the start of the first call that takes it, plus the part of that call's forward that the blocks before
    it in the call take, in proportion to parameter bytes (a layer's forward is about its weights' bytes times
    the tokens). The call's other parameters (an embedding, a head) are placed after its blocks, so a block is
    never placed later than its share of the time allows: an estimate on the early side, which credits
    overlap least. A block no call takes starts at 0."""
    if not len(call_forward_seconds) == len(call_parameter_bytes) == len(call_blocks):
        raise ValueError("block_forward_starts: one forward time, parameter bytes and block list per call")
    starts: list[float | None] = [None] * len(block_bytes)
    begun = 0.0
    for seconds, parameter_bytes, taken in zip(call_forward_seconds, call_parameter_bytes, call_blocks):
        before = 0
        for index in taken:
            if starts[index] is None:
                share = before / max(parameter_bytes, before + block_bytes[index])
                starts[index] = begun + seconds * share
            before += block_bytes[index]
        begun += seconds
    return [0.0 if s is None else s for s in starts]


def levers(host_is_device: bool) -> list[StateLever]:
    """The levers worth offering: every format, and in host memory too where that is other memory."""
    on_device = [StateLever(fmt) for fmt in FORMATS]
    return on_device if host_is_device else on_device + [StateLever(fmt, True) for fmt in FORMATS]
