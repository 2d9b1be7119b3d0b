"""Optimizer-state levers in counts: bytes on the device, the step's transient, seconds added."""

from __future__ import annotations

import pytest

from dpcs_compiler.cost.model_state import (
    OptimizerStateShape,
    StateLever,
    StateRates,
    added_seconds,
    codec_rates,
    device_bytes,
    estimated_step_transient,
    levers,
    offload_seconds,
    step_transient_bytes,
    stored_bytes,
)

SHAPE = OptimizerStateShape(stored_elements=2 * 1_000_000, kept_bytes=8_000, block_size=256, chunk_elements=250_000)
RATES = StateRates(encode_seconds={"fp32": 1e-10, "bf16": 2e-10, "fp16": 1e-9, "int8": 3e-9},
                   decode_seconds={"fp32": 1e-10, "bf16": 2e-10, "fp16": 5e-10, "int8": 1e-9},
                   link_bytes_per_second=20e9)


def test_stored_bytes_count_elements_and_one_scale_per_block():
    assert stored_bytes(SHAPE, "fp32") == 8_000_000
    assert stored_bytes(SHAPE, "bf16") == 4_000_000
    assert stored_bytes(SHAPE, "fp16") == 4_000_000 + 4 * 7813
    assert stored_bytes(SHAPE, "int8") == 2_000_000 + 4 * 7813


def test_device_bytes_keep_the_small_tensors_and_drop_what_lives_on_the_host():
    assert device_bytes(SHAPE, StateLever()) == 8_008_000
    assert device_bytes(SHAPE, StateLever("int8")) == 2_000_000 + 4 * 7813 + 8_000
    assert device_bytes(SHAPE, StateLever("int8", on_host=True)) == 8_000


def test_the_plain_lever_costs_nothing_and_others_decode_a_chunk():
    assert step_transient_bytes(SHAPE, StateLever()) == 0 and added_seconds(SHAPE, StateLever(), RATES) == 0
    assert step_transient_bytes(SHAPE, StateLever("int8")) == 4 * 250_000
    assert added_seconds(SHAPE, StateLever("int8"), RATES) == pytest.approx(2e6 * 4e-9)
    host = added_seconds(SHAPE, StateLever("int8", True), RATES)
    assert host == pytest.approx(2e6 * 4e-9 + 2 * stored_bytes(SHAPE, "int8") / 20e9)
    assert added_seconds(SHAPE, StateLever("fp32", True), RATES) == pytest.approx(2e6 * 2e-10 + 2 * 8e6 / 20e9)


def test_host_levers_are_offered_only_where_the_host_is_other_memory():
    assert all(not lever.on_host for lever in levers(host_is_device=True))
    assert len(levers(host_is_device=False)) == 8
    with pytest.raises(ValueError, match="host is its own memory"):
        added_seconds(SHAPE, StateLever("int8", True), StateRates(RATES.encode_seconds, RATES.decode_seconds, None))


def test_an_offloaded_block_crosses_the_link_twice_its_gradients_once_and_steps_on_the_host():
    rates = StateRates(RATES.encode_seconds, RATES.decode_seconds, 20e9, host_step_seconds=1e-9)
    assert offload_seconds(4_000_000, 4_000_000, 1_000_000, rates) == pytest.approx(12e6 / 20e9 + 1e-3)
    with pytest.raises(ValueError, match="host is its own memory"):
        offload_seconds(1, 1, 1, StateRates(RATES.encode_seconds, RATES.decode_seconds, None))


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="'int4' is not a state format; valid: fp32, bf16, fp16, int8"):
        StateLever("int4")
    with pytest.raises(ValueError, match="block_size=0"):
        OptimizerStateShape(stored_elements=1, block_size=0)


def test_an_optimizer_steps_temporaries_are_estimated_high_from_other_regimes():
    decoded = {"fp32": 0, "bf16": 1000, "int8": 1000, "int8 in host memory": 1500}.__getitem__
    assert estimated_step_transient({}, "fp32", decoded) is None
    measured = {"bf16": 1200, "fp32": 300}
    assert estimated_step_transient(measured, "fp32", decoded) == 300  # measured there
    # int8 decodes as much as bf16 (1200 measured) and 1000 B more than fp32 (300 + 1000): the larger
    assert estimated_step_transient(measured, "int8", decoded) == 1300
    # decoding 500 B more than bf16 and 1500 B more than fp32: the larger of 1200 + 500 and 300 + 1500
    assert estimated_step_transient(measured, "int8 in host memory", decoded) == 1800


def test_codec_costs_follow_the_profiles_bandwidth_and_order_the_formats():
    encode, decode = codec_rates(35e9)
    assert set(encode) == set(decode) == {"fp32", "bf16", "fp16", "int8"}
    assert encode["fp32"] == 8 / 35e9 and decode["bf16"] == 6 / 35e9
    # cheapest first: a plain copy, a narrowing copy, then the scaled formats, int8's level search dearest
    assert encode["bf16"] < encode["fp32"] < encode["fp16"] < encode["int8"]
    assert codec_rates(70e9)[0]["int8"] == encode["int8"] / 2  # twice the bandwidth, half the time
    with pytest.raises(ValueError, match="memory_bandwidth"):
        codec_rates(0.0)
