"""Compressed formats for optimizer state: pure encode/decode functions, no optimizer inside.

Formats (what one element costs, what it keeps):

| format | bytes | what is stored | error bound (per element, `a` = absmax of its block) |
|---|---|---|---|
| `fp32` | 4 | the values | none |
| `bf16` | 2 | the values rounded to bf16 | relative 2**-8 (0.4%) of the value; fp32's range |
| `fp16` | 2 + 4/block | value / `a`, rounded to fp16 | relative 2**-11 (0.05%) of the value while `value/a` >= 2**-14 (6e-5); absolute 2**-25 `a` below |
| `int8` | 1 + 4/block | the nearest of 256 levels of a dynamic map, times `a` | see below |

Blocks: a tensor of two or more dimensions is seen as rows (its first dimension) of `numel / rows` columns;
each row is cut into blocks of `block_size` columns (the last one shorter) with one fp32 scale each. A
one-dimensional tensor is one row. Blocks never cross a row, so splitting the first dimension between
ranks (FSDP2's `Shard(0)`) leaves every block, and so the stored precision, the same as on one rank.

`int8` uses the dynamic map of 8-bit optimizers (Dettmers et al., bitsandbytes; torchao uses the same): 256
levels, dense near 1 and sparser in each of the seven decades below, signed for states that take both signs
(momentum) and unsigned, with twice the levels per decade, for states that never go below zero (second
moments). Absolute error is at most 0.7% of `a` (signed; 0.35% unsigned). Relative to the value it grows as
the value falls below `a`; `int8_error_bound(signed)` gives the largest per decade of `|value| / a`, and the
tests hold decoded values to it:

| `|value| / a` in | [0.1, 1) | [1e-2, 0.1) | [1e-3, 1e-2) | [1e-4, 1e-3) | [1e-5, 1e-4) | below |
|---|---|---|---|---|---|---|
| signed | 6.2% | 11% | 18% | 28% | 47% | up to 100% (may store 0) |
| unsigned | 3.3% | 6.2% | 11% | 18% | 28% | up to 100% (may store 0) |

This is the trade 8-bit optimizers make: a block's large entries, which dominate its update, keep ~1%
precision, small ones keep their order of magnitude. A state that needs more keeps `fp16` or `fp32`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

FORMATS = ("fp32", "bf16", "fp16", "int8")
_STORED_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.uint8}
_SCALED = ("fp16", "int8")


@dataclass
class Encoded:
    """One state tensor in a stored format: `codes` has the tensor's shape; `scales` one fp32 per block."""

    format: str
    codes: torch.Tensor
    scales: torch.Tensor | None
    block_size: int
    signed: bool
    dtype: torch.dtype = torch.float32  # what decoding gives back

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + (self.scales.nbytes if self.scales is not None else 0)


def check_format(fmt: str, what: str = "format") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{what}={fmt!r} is not a state format; valid: {', '.join(FORMATS)}")
    return fmt


@functools.cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted levels in [-1, 1] (signed) or [0, 1] of 8-bit optimizers' dynamic quantization."""
    max_exponent_bits, non_sign_bits = 7, 7
    levels: list[float] = []
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float64)
        means = ((boundaries[:-1] + boundaries[1:]) / 2.0) * 10.0 ** (-(max_exponent_bits - 1) + i)
        levels += means.tolist()
        if signed:
            levels += (-means).tolist()
    levels += [0.0, 1.0]
    levels += [0.0] * (256 - len(levels))
    return torch.tensor(sorted(levels), dtype=torch.float32)


@functools.cache
def _midpoints(signed: bool) -> torch.Tensor:
    levels = dynamic_map(signed)
    return (levels[1:] + levels[:-1]) / 2


@functools.cache
def _level_lookup(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A table from the top 16 bits of an fp32 value to the index of the nearest level of the lowest value with
    those bits, and the midpoints (with +inf after the last). Every such range of values holds at most one
    midpoint, so the nearest level of `x` is `table[bits] + (x > midpoints[table[bits]])`: `torch.bucketize`'s
    answer (tested) at a fraction of its time."""
    midpoints = _midpoints(signed)
    top = torch.arange(65536, dtype=torch.int32)
    negative = top >= 32768
    lowest = torch.where(negative, (top << 16) | 0xFFFF, top << 16).view(torch.float32).nan_to_num()
    highest = torch.where(negative, top << 16, (top << 16) | 0xFFFF).view(torch.float32).nan_to_num()
    table = torch.bucketize(lowest, midpoints, out_int32=True)
    within = lowest.abs() <= 1
    span = torch.bucketize(highest, midpoints, out_int32=True) - table
    if span[within].max() > 1:
        raise AssertionError("a range of values with the same top 16 bits holds two midpoints of the dynamic map")
    return table, torch.cat([midpoints, torch.tensor([float("inf")])])


def nearest_levels(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """The index (uint8) of the nearest level of the dynamic map to each value of `normalized` (in [-1, 1])."""
    table, midpoints = (t.to(normalized.device) for t in _level_lookup(signed))
    top = (normalized.view(torch.int32) >> 16) & 0xFFFF
    lower = table.index_select(0, top.reshape(-1)).view(normalized.shape)
    above = normalized > midpoints.index_select(0, lower.reshape(-1)).view(normalized.shape)
    return lower.add_(above).to(torch.uint8)


def int8_error_bound(signed: bool) -> list[tuple[float, float, float]]:
    """(low, high, bound) per decade of |value|/absmax: a value in [low, high) decodes within `bound * |value|`
    (`bound * low` absolute at the bottom decade, whose values may round to 0)."""
    levels = dynamic_map(signed).double()
    positive = torch.unique(levels[levels >= 0])
    bounds = []
    for decade in range(7):
        low, high = 10.0 ** (-7 + decade), 10.0 ** (-6 + decade)
        # The worst value in [low, high) is just below a midpoint between levels around it, or at an end.
        inside = positive[(positive >= low) & (positive < high)]
        below = positive[positive < low].max()
        above = positive[positive >= high].min()
        around = torch.cat([below.view(1), inside, above.view(1)])
        worst = 0.0
        for a, b in zip(around[:-1].tolist(), around[1:].tolist()):
            mid = (a + b) / 2
            for value in (max(low, a), min(high, mid), max(low, mid), min(high, b)):
                if low <= value <= high and value > 0:
                    nearest = a if value <= mid else b
                    worst = max(worst, abs(value - nearest) / value)
        bounds.append((low, high, worst))
    return bounds


def blocks_shape(shape: torch.Size | tuple[int, ...], block_size: int) -> tuple[int, int]:
    """(rows, blocks per row) of a tensor of `shape` cut into blocks of `block_size` columns."""
    rows = shape[0] if len(shape) >= 2 else 1
    cols = math.prod(shape) // rows if rows else 0
    return rows, max(1, -(-cols // block_size))


PIECE_ELEMENTS = 1 << 18  # elements encoded or decoded at once: bounds the temporaries of a large tensor


def _pieces(rows: int, cols: int, block_size: int) -> Iterator[tuple[slice, slice, slice]]:
    """(rows, columns, blocks) slices that tile a (rows, cols) matrix in pieces of about PIECE_ELEMENTS
    elements, cut at block boundaries."""
    if cols <= PIECE_ELEMENTS:
        row_step, col_step = max(1, PIECE_ELEMENTS // max(cols, 1)), max(cols, 1)
    else:
        row_step, col_step = 1, max(block_size, PIECE_ELEMENTS // block_size * block_size)
    for r in range(0, rows, row_step):
        for c in range(0, max(cols, 1), col_step):
            end = min(c + col_step, cols)
            yield (slice(r, r + row_step), slice(c, end),
                   slice(c // block_size, -(-end // block_size) if end > c else c // block_size + 1))


def region(encoded: Encoded, part: slice) -> Encoded:
    """The rows `part` of a stored tensor of two or more dimensions, or the elements `part` (starting at a
    multiple of the block size) of a one-dimensional one: views of its codes and scales."""
    codes = encoded.codes[part]
    scales = encoded.scales
    if scales is not None:
        if encoded.codes.dim() >= 2:
            scales = scales[part]
        else:
            start = part.start or 0
            if start % encoded.block_size:
                raise ValueError(f"a region of a 1-D stored tensor starts at a block: {start} is not a multiple "
                                 f"of {encoded.block_size}")
            first = start // encoded.block_size
            scales = scales[:, first:first + blocks_shape(codes.shape, encoded.block_size)[1]]
    return Encoded(encoded.format, codes, scales, encoded.block_size, encoded.signed, encoded.dtype)


def _blocked(piece: torch.Tensor, block_size: int) -> torch.Tensor:
    """A (rows, cols) piece as (rows, blocks, block_size), the last block padded with zeros."""
    blocks = max(1, -(-piece.shape[1] // block_size))
    padded = torch.nn.functional.pad(piece, (0, blocks * block_size - piece.shape[1]))
    return padded.view(piece.shape[0], blocks, block_size)


def fits(encoded: Encoded | None, values: torch.Tensor, fmt: str, block_size: int) -> bool:
    """Whether `encoded`'s buffers can hold `values` in format `fmt` (same shapes, dtypes and device)."""
    if encoded is None or encoded.format != fmt or encoded.block_size != block_size:
        return False
    scales_fit = (encoded.scales is None) == (fmt not in _SCALED) and (
        encoded.scales is None or tuple(encoded.scales.shape) == blocks_shape(values.shape, block_size))
    return encoded.codes.shape == values.shape and encoded.codes.device == values.device and scales_fit


def encode(values: torch.Tensor, fmt: str, *, block_size: int = 256, signed: bool = True,
           out: Encoded | None = None) -> Encoded:
    """`values` (a floating tensor of one or more dimensions) in format `fmt`, on the same device; written into
    `out`'s buffers when they fit (`fits`), so a state stored step after step keeps its memory."""
    check_format(fmt)
    reuse = out if fits(out, values, fmt, block_size) else None
    if fmt not in _SCALED:
        if reuse is not None:
            reuse.codes.copy_(values.detach())
            reuse.signed, reuse.dtype = signed, values.dtype
            return reuse
        codes = values.detach().to(_STORED_DTYPE[fmt], copy=True)
        return Encoded(fmt, codes, None, block_size, signed, values.dtype)
    rows, blocks = blocks_shape(values.shape, block_size)
    cols = values.numel() // rows if rows else 0
    flat = values.detach().reshape(rows, cols)
    if reuse is not None:
        assert reuse.scales is not None
        codes, scales = reuse.codes.view(rows, cols), reuse.scales
    else:
        codes = torch.empty((rows, cols), dtype=_STORED_DTYPE[fmt], device=values.device)
        scales = torch.empty((rows, blocks), dtype=torch.float32, device=values.device)
    for row, col, block in _pieces(rows, cols, block_size):
        blocked = _blocked(flat[row, col].float(), block_size)  # a copy: worked on in place
        absmax = torch.linalg.vector_norm(blocked, ord=float("inf"), dim=-1)
        scales[row, block] = absmax
        normalized = blocked.div_(absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
        if fmt == "fp16":
            stored = normalized.to(torch.float16)
        else:
            if not signed:
                normalized.clamp_(min=0)
            stored = nearest_levels(normalized, signed)
        width = col.stop - col.start
        codes[row, col] = stored.view(stored.shape[0], -1)[:, :width]
    if reuse is not None:
        reuse.signed, reuse.dtype = signed, values.dtype
        return reuse
    return Encoded(fmt, codes.view(values.shape), scales, block_size, signed, values.dtype)


def decode(encoded: Encoded, device: torch.device | str | None = None) -> torch.Tensor:
    """The values `encoded` stands for, as a new tensor of its original dtype (on `device`, if given)."""
    device = encoded.codes.device if device is None else torch.device(device)
    if encoded.format not in _SCALED:
        return encoded.codes.to(device=device, dtype=encoded.dtype, copy=True)
    assert encoded.scales is not None
    shape = encoded.codes.shape
    rows, _ = blocks_shape(shape, encoded.block_size)
    cols = encoded.codes.numel() // rows if rows else 0
    flat = encoded.codes.reshape(rows, cols)
    out = torch.empty((rows, cols), dtype=encoded.dtype, device=device)
    levels = dynamic_map(encoded.signed).to(device) if encoded.format == "int8" else None
    for row, col, block in _pieces(rows, cols, encoded.block_size):
        blocked = _blocked(flat[row, col].to(device, non_blocking=True), encoded.block_size)
        normalized = (blocked.float() if levels is None
                      else levels.index_select(0, blocked.reshape(-1).int()).view(blocked.shape))
        scale = encoded.scales[row, block].to(device, non_blocking=True)
        values = normalized.mul_(scale.unsqueeze(-1)).view(blocked.shape[0], -1)
        out[row, col] = values[:, : col.stop - col.start]
    return out.view(shape)
