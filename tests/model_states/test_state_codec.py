"""Optimizer-state formats: shapes and dtypes kept, errors within the documented bounds, blocks that never
cross a row (so a tensor split along its first dimension stores exactly what the whole does), large tensors
encoded in pieces with the same result."""

from __future__ import annotations

import pytest
import torch

from dpcs_compiler.model_states import state_codec
from dpcs_compiler.model_states.state_codec import FORMATS, blocks_shape, decode, dynamic_map, encode, int8_error_bound

SHAPES = [(5,), (1000,), (3, 700), (2, 3, 5), (64, 256)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_decoding_gives_back_the_shape_and_dtype(fmt, shape):
    values = torch.randn(shape)
    encoded = encode(values, fmt, block_size=64)
    decoded = decode(encoded)
    assert decoded.shape == values.shape and decoded.dtype == torch.float32
    assert encoded.codes.shape == values.shape
    stored = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.uint8}[fmt]
    assert encoded.codes.dtype == stored
    if fmt in ("fp16", "int8"):
        assert tuple(encoded.scales.shape) == blocks_shape(shape, 64)
    else:
        assert encoded.scales is None


def test_bytes_per_element():
    values = torch.randn(64, 1024)
    per_element = {fmt: encode(values, fmt, block_size=256).nbytes / values.numel() for fmt in FORMATS}
    assert per_element == {"fp32": 4.0, "bf16": 2.0, "fp16": 2 + 4 / 256, "int8": 1 + 4 / 256}


def test_fp32_is_exact_and_bf16_fp16_hold_their_relative_bounds():
    values = torch.randn(16, 512) * torch.logspace(-3, 3, 512)
    assert torch.equal(decode(encode(values, "fp32")), values)
    assert ((decode(encode(values, "bf16")) - values).abs() <= values.abs() * 2**-8).all()
    fp16 = decode(encode(values, "fp16", block_size=32))
    absmax = values.view(16, 16, 32).abs().amax(-1, keepdim=True).expand(16, 16, 32).reshape(16, 512)
    bound = torch.maximum(values.abs() * 2**-11, absmax * 2**-25)
    assert ((fp16 - values).abs() <= bound * 1.0001).all()


@pytest.mark.parametrize("signed", [True, False])
def test_int8_errors_stay_within_the_documented_bound_per_decade(signed):
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 0, 4000)[torch.randperm(4000, generator=generator)]
    signs = torch.where(torch.rand(4000, generator=generator) < 0.5, -1.0, 1.0) if signed else 1.0
    values = (magnitudes * signs).view(10, 400)
    values[:, 0] = 1.0  # each row's absmax is 1: |value| / absmax is |value|
    decoded = decode(encode(values, "int8", block_size=400, signed=signed))
    relative = ((decoded - values).abs() / values.abs()).flatten()
    ratio = values.abs().flatten()
    for low, high, bound in int8_error_bound(signed):
        inside = (ratio >= low) & (ratio < high)
        if inside.any():
            assert relative[inside].max() <= bound + 1e-6, (low, high)
    assert (decoded - values).abs().max() <= (0.0071 if signed else 0.0036)
    # The documented table (state_codec's docstring) is this function's output, rounded.
    top = {round(low, 7): bound for low, high, bound in int8_error_bound(signed)}
    assert top[0.1] == pytest.approx(0.062 if signed else 0.033, abs=0.001)
    assert top[0.01] == pytest.approx(0.110 if signed else 0.062, abs=0.001)


def test_dynamic_maps_are_256_sorted_levels():
    for signed in (True, False):
        levels = dynamic_map(signed)
        assert levels.numel() == 256 and torch.all(levels[1:] >= levels[:-1])
        assert levels.max() == 1.0 and (levels.min() < -0.99 if signed else levels.min() == 0.0)


@pytest.mark.parametrize("fmt", ["int8", "fp16"])
def test_rows_split_between_ranks_store_what_the_whole_tensor_stores(fmt):
    values = torch.randn(10, 3, 50)  # 150 columns per row, blocks of 64: the last block of each row is short
    whole = encode(values, fmt, block_size=64)
    for rows in (slice(0, 5), slice(5, 10), slice(3, 4)):
        part = encode(values[rows], fmt, block_size=64)
        assert torch.equal(part.codes, whole.codes[rows])
        assert torch.equal(part.scales, whole.scales[rows])


@pytest.mark.parametrize("fmt", ["int8", "fp16"])
@pytest.mark.parametrize("shape", [(4000,), (9, 700)])
def test_large_tensors_in_pieces_encode_the_same(fmt, shape, monkeypatch):
    values = torch.randn(shape)
    whole = encode(values, fmt, block_size=64)
    monkeypatch.setattr(state_codec, "PIECE_ELEMENTS", 300)
    pieces = encode(values, fmt, block_size=64)
    assert torch.equal(pieces.codes, whole.codes) and torch.equal(pieces.scales, whole.scales)
    assert torch.equal(decode(pieces), decode(whole))


def test_zero_blocks_decode_to_zero_and_unsigned_states_never_go_negative():
    values = torch.zeros(4, 128)
    values[1] = torch.rand(128)
    assert torch.equal(decode(encode(values, "int8", block_size=32, signed=False))[0], torch.zeros(128))
    assert (decode(encode(values, "int8", block_size=32, signed=False)) >= 0).all()


def test_an_unknown_format_names_the_valid_ones():
    with pytest.raises(ValueError, match="'int4'.*fp32, bf16, fp16, int8"):
        encode(torch.ones(3), "int4")


@pytest.mark.parametrize("signed", [True, False])
def test_the_nearest_level_lookup_agrees_with_bucketize(signed):
    from dpcs_compiler.model_states.state_codec import _midpoints, nearest_levels

    midpoints = _midpoints(signed)
    generator = torch.Generator().manual_seed(0)
    low = -1.0 if signed else 0.0
    values = torch.cat([
        torch.rand(200_000, generator=generator) * (1 - low) + low,
        (torch.rand(20_000, generator=generator) * (1 - low) + low) * 1e-5,
        midpoints, torch.nextafter(midpoints, torch.tensor(2.0)), torch.nextafter(midpoints, torch.tensor(-2.0)),
        torch.tensor([0.0, -0.0, 1.0, 1e-40, -1e-40, -1.0 if signed else 0.5]),
    ]).clamp(low, 1.0)
    expected = torch.bucketize(values, midpoints)
    assert torch.equal(nearest_levels(values, signed).long(), expected)
