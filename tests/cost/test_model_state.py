"""Optimizer-state levers in counts: bytes on the device, the step's transient, seconds added."""

from __future__ import annotations

import pytest

from dpcs_compiler.cost.model_state import (
    OptimizerStateShape,
    StateLever,
    StateRates,
    added_seconds,
    block_forward_starts,
    codec_rates,
    device_bytes,
    estimated_step_transient,
    host_step_stall,
    levers,
    offload_seconds,
    overlapped_host_step_seconds,
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


def test_a_host_step_beside_the_forward_costs_the_longest_wait_of_a_block_for_its_step():
    # The thread steps blocks of 1 s each; their forwards start at 0.5, 1.0, 1.5 s: block 2's step ends at 3 s,
    # 1.5 s after its forward would start (the earlier blocks wait 0.5 and 1 s; the waits do not add up).
    assert host_step_stall([1.0, 1.0, 1.0], [0.5, 1.0, 1.5]) == pytest.approx(1.5)
    assert host_step_stall([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) == 0.0  # each step ends as its forward starts
    assert host_step_stall([0.1, 0.1, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(0.0)  # hidden behind the forward
    assert host_step_stall([3.0, 0.1], [0.0, 5.0]) == pytest.approx(3.0)  # the first forward waits for its step
    assert host_step_stall([], []) == 0.0
    with pytest.raises(ValueError, match="2 host steps for 1 starts"):
        host_step_stall([1.0, 1.0], [0.0])
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        host_step_stall([-1.0], [0.0])


def test_an_overlapped_host_step_is_credited_what_the_forward_hides_and_what_the_device_no_longer_steps():
    rates = StateRates(RATES.encode_seconds, RATES.decode_seconds, 20e9, host_step_seconds=1e-9,
                       device_step_seconds=1e-10)
    elements = [1_000_000, 1_000_000]  # 1.1 ms each in full on the host, 0.1 ms on the device
    whole = sum(offload_seconds(0, 0, n, rates) for n in elements)
    assert whole == pytest.approx(2e-3)
    # Nothing hides it (both forwards start at once): it waits for the whole host step, less the device's.
    assert overlapped_host_step_seconds(elements, [0.0, 0.0], rates) == pytest.approx(2.2e-3 - 0.2e-3)
    # The first block's forward takes 1 ms: the second waits 1.2 ms in all.
    assert overlapped_host_step_seconds(elements, [0.0, 1e-3], rates) == pytest.approx(1.2e-3 - 0.2e-3)
    assert overlapped_host_step_seconds(elements, [5e-3, 6e-3], rates) == 0.0  # hidden whole, credited no more


def test_a_blocks_forward_starts_at_its_calls_start_plus_the_share_of_the_blocks_before_it():
    # Call 0 (1 s) takes blocks 0 and 1 and an embedding as large as a block; call 1 (2 s) takes block 2.
    starts = block_forward_starts([1.0, 2.0], [300, 100], [[0, 1], [2]], [100, 100, 100])
    assert starts == pytest.approx([0.0, 1.0 / 3, 1.0])  # the embedding's share placed after the blocks
    # A block taken again by a later call keeps its first start; one no call takes starts at 0.
    assert block_forward_starts([1.0, 1.0], [100, 100], [[0], [0]], [100, 50]) == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match="one forward time"):
        block_forward_starts([1.0], [], [[0]], [1])


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
