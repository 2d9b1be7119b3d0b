"""cost/fp8.py: a linear's step time as an fp8 linear against its region's dtype, from a profile's peak rates or
its measured matmul table; pinned profiles, no graphs."""

from __future__ import annotations

import dataclasses

import pytest

from dpcs_compiler.cost.fp8 import fp8_cast_bytes, linear_seconds, peak_seconds, table_seconds
from dpcs_compiler.cost.hardware import FP8_ROWWISE, FP8_TENSORWISE
from dpcs_compiler.cost.profiles import BUILTIN_PROFILES

H100 = BUILTIN_PROFILES["h100"][1]
A100 = BUILTIN_PROFILES["a100"][1]

SMALL, MEDIUM, LLAMA_FFN, LARGE = (2048, 1024, 1024), (4096, 2048, 2048), (8192, 2048, 5632), (16384, 4096, 14336)


def rows(rate_at: dict[tuple[int, int, int], float]) -> list[list[float]]:
    return [[m, k, n, 2 * m * k * n / rate] for (m, k, n), rate in rate_at.items()]


def with_table(**kinds: dict[tuple[int, int, int], float]):
    table = {kind.replace("_rowwise", ":rowwise"): rows(rate_at) for kind, rate_at in kinds.items()}
    return dataclasses.replace(H100, matmul_table=table)


def test_at_peak_rates_fp8_loses_on_small_linears_and_wins_on_large_ones():
    speedups = [linear_seconds(H100, *shape, recipe="tensorwise", region="bf16").speedup
                for shape in (SMALL, MEDIUM, LLAMA_FFN, LARGE)]
    assert speedups == sorted(speedups)  # grows with the matmuls' size
    assert speedups[0] < 0.6 and speedups[1] < 1 < speedups[2] and speedups[3] > 1.4
    small = linear_seconds(H100, *SMALL, recipe="tensorwise", region="bf16")
    assert not small.fp8_faster and small.source == "peak rates"


def test_rowwise_pays_more_scaling_than_tensorwise():
    for shape in (SMALL, LARGE):
        tensorwise = linear_seconds(H100, *shape, recipe="tensorwise", region="bf16")
        rowwise = linear_seconds(H100, *shape, recipe="rowwise", region="bf16")
        assert rowwise.region_s == tensorwise.region_s and rowwise.fp8_s > tensorwise.fp8_s


def test_scaling_passes_are_counted_as_the_module_docstring_says():
    # M = K = N = 16 with bf16 activations: each cast reads twice (2 bytes) and writes once (1 byte)
    cast = 16 * 16 * (2 * 2 + 1)
    weight = 2 * 16 * 16 * (2 * 4 + 1)
    copies = 2 * 3 * 16 * 16
    assert fp8_cast_bytes("tensorwise", 16, 16, 16, 2) == (2 * cast + weight + copies, 11)
    assert fp8_cast_bytes("rowwise", 16, 16, 16, 2) == (4 * cast + weight + copies, 15)


def test_a_measured_table_overrides_the_peaks():
    """A GPU whose fp8 matmuls reach only bf16's rate: fp8 never pays, even where the peaks say 1.5x."""
    same = {shape: 600e12 for shape in (SMALL, LARGE)}
    profile = with_table(bfloat16=same, float8_e4m3fn=same)
    large = linear_seconds(profile, *LARGE, recipe="tensorwise", region="bf16")
    assert large.source == "measured table" and not large.fp8_faster
    assert linear_seconds(H100, *LARGE, recipe="tensorwise", region="bf16").fp8_faster


def test_the_table_gives_the_rate_of_the_nearest_measured_shape():
    profile = with_table(bfloat16={SMALL: 300e12, LARGE: 800e12})
    m, k, n = SMALL
    assert table_seconds(profile, "bfloat16", m, k, n) == pytest.approx(2 * m * k * n / 300e12)
    assert table_seconds(profile, "bfloat16", 2 * m, k, n) == pytest.approx(2 * 2 * m * k * n / 300e12)
    assert table_seconds(profile, "bfloat16", *LARGE) == pytest.approx(2 * 16384 * 4096 * 14336 / 800e12)
    assert table_seconds(profile, FP8_TENSORWISE, m, k, n) is None


def test_a_table_times_both_kinds_or_the_peaks_cost_both():
    """bf16 measured but fp8 not: comparing a measured rate with a peak would favour fp8, so both use peaks."""
    profile = with_table(bfloat16={SMALL: 100e12})
    assert linear_seconds(profile, *SMALL, recipe="tensorwise", region="bf16") == \
        linear_seconds(H100, *SMALL, recipe="tensorwise", region="bf16")
    rowwise_only = with_table(bfloat16={SMALL: 100e12}, float8_e4m3fn_rowwise={SMALL: 150e12})
    assert linear_seconds(rowwise_only, *SMALL, recipe="rowwise", region="bf16").source == "measured table"
    assert linear_seconds(rowwise_only, *SMALL, recipe="tensorwise", region="bf16").source == "peak rates"
    assert FP8_ROWWISE in rowwise_only.matmul_table


def test_a_table_where_fp8_gains_with_size_picks_the_large_linears():
    """Rates as torchao measures them on an H100: fp8 below bf16 on small matmuls, well above on large ones."""
    profile = with_table(bfloat16={SMALL: 350e12, LARGE: 750e12}, float8_e4m3fn={SMALL: 300e12, LARGE: 1400e12})
    assert not linear_seconds(profile, *SMALL, recipe="tensorwise", region="bf16").fp8_faster
    assert linear_seconds(profile, *LARGE, recipe="tensorwise", region="bf16").fp8_faster


def test_without_an_fp8_rate_fp8_is_never_faster():
    seconds = linear_seconds(A100, *LARGE, recipe="tensorwise", region="bf16")
    assert seconds.fp8_s is None and seconds.speedup is None and not seconds.fp8_faster
    assert peak_seconds(A100, FP8_TENSORWISE, *LARGE) is None


def test_an_fp32_region_compares_against_fp32_matmuls_without_casts():
    fp32 = linear_seconds(H100, *SMALL, recipe="tensorwise", region="fp32")
    assert fp32.region_s == pytest.approx(sum(peak_seconds(H100, "float32", *s) for s in
                                              ((2048, 1024, 1024), (2048, 1024, 1024), (1024, 2048, 1024))))
    assert fp32.fp8_faster  # fp32 matmuls run at a fifteenth of bf16's rate on an H100


@pytest.mark.parametrize("kwargs, message", [
    ({"recipe": "blockwise", "region": "bf16"}, "recipe='blockwise' is not valid"),
    ({"recipe": "tensorwise", "region": "fp64"}, "region='fp64' is not valid"),
])
def test_bad_choices_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        linear_seconds(H100, *SMALL, **kwargs)


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="tokens must be a positive int, got 0"):
        linear_seconds(H100, 0, 1024, 1024, recipe="tensorwise", region="bf16")
