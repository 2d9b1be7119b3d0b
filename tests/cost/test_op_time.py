"""op_time: roofline seconds per op, node and host transfer from a profile's figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dpcs_compiler.cost.calibration import Calibration
from dpcs_compiler.cost.hardware import FORMAT_VERSION, HardwareProfile
from dpcs_compiler.cost.op_time import (
    OFFLOAD_OPS_FLOOR_S,
    node_seconds,
    offload_ops_seconds,
    roofline_seconds,
    transfer_seconds,
)
from dpcs_compiler.types import NodeCost

OVERHEAD = 1e-6


def profile(**changes) -> HardwareProfile:
    """Round figures: 1 TFLOP/s float32, 4 TFLOP/s bfloat16, 100 GB/s memory, no host link."""
    fields = dict(
        device_key="cpu:test:1",
        torch_version=torch.__version__,
        format_version=FORMAT_VERSION,
        matmul_flops={"float32": 1e12, "bfloat16": 4e12},
        memory_bandwidth=1e11,
        host_to_device=None,
        device_to_host=None,
        launch_overhead_s=OVERHEAD,
        measured_at="2026-01-01T00:00:00+00:00",
    )
    return HardwareProfile(**{**fields, **changes})


@pytest.mark.parametrize(
    ("flops", "nbytes", "expected"),
    [
        (10**9, 10**6, OVERHEAD + 1e-3),  # compute-bound: 1 ms of FLOPs, 10 us of bytes
        (10**6, 10**9, OVERHEAD + 1e-2),  # memory-bound: 1 us of FLOPs, 10 ms of bytes
        (0, 10**9, OVERHEAD + 1e-2),  # pointwise: no FLOPs
        (0, 0, OVERHEAD),  # a view: only the fixed cost
    ],
    ids=["compute-bound", "memory-bound", "pointwise", "nothing"],
)
def test_roofline_takes_the_larger_term_plus_the_overhead(flops, nbytes, expected):
    assert roofline_seconds(flops, nbytes, "float32", profile()) == pytest.approx(expected, rel=1e-12)


def test_each_dtype_uses_its_own_matmul_rate():
    assert roofline_seconds(4 * 10**9, 0, "bfloat16", profile()) == pytest.approx(OVERHEAD + 1e-3)
    assert roofline_seconds(4 * 10**9, 0, torch.bfloat16, profile()) == pytest.approx(OVERHEAD + 1e-3)


@pytest.mark.parametrize("dtype", ["float64", "int64", torch.float16])
def test_an_unmeasured_dtype_falls_back_to_the_float32_rate(dtype):
    assert roofline_seconds(10**9, 0, dtype, profile()) == pytest.approx(OVERHEAD + 1e-3)


def test_every_float8_variant_uses_the_measured_float8_rate():
    p = profile(matmul_flops={"float32": 1e12, "float8_e4m3fn": 1e13})
    assert roofline_seconds(10**10, 0, torch.float8_e5m2, p) == pytest.approx(OVERHEAD + 1e-3)


@pytest.mark.parametrize(("flops", "nbytes"), [(-1, 0), (0, -1)])
def test_negative_counts_are_rejected(flops, nbytes):
    with pytest.raises(ValueError, match="must be >= 0"):
        roofline_seconds(flops, nbytes, "float32", profile())


def test_a_node_moves_the_bytes_it_reads_plus_the_bytes_it_writes():
    cost = NodeCost(flops=0, bytes_read=3 * 10**8, bytes_written=10**8)
    assert node_seconds(cost, torch.float32, profile()) == pytest.approx(OVERHEAD + 4e-3)


def test_a_calibration_scales_each_term_separately_and_replaces_the_overhead():
    calibration = Calibration(compute_scale=2.0, memory_scale=0.5, overhead_s=5e-6)
    assert roofline_seconds(10**9, 10**6, "float32", profile(), calibration) == pytest.approx(5e-6 + 2e-3)
    assert roofline_seconds(10**6, 10**9, "float32", profile(), calibration) == pytest.approx(5e-6 + 5e-3)
    # scaling can change which term bounds the op: 1 ms of FLOPs vs 1.5 ms of bytes, scaled to 1 ms vs 3 ms
    flipped = Calibration(compute_scale=1.0, memory_scale=2.0)
    assert node_seconds(NodeCost(10**9, 10**8, 5 * 10**7), "float32", profile(), flipped) == pytest.approx(
        OVERHEAD + 3e-3
    )


def test_the_identity_calibration_changes_nothing():
    for flops, nbytes in [(10**9, 10**6), (10**6, 10**9), (0, 0)]:
        assert roofline_seconds(flops, nbytes, "float32", profile(), Calibration()) == roofline_seconds(
            flops, nbytes, "float32", profile()
        )


def test_transfers_use_the_host_link_of_their_direction():
    p = profile(device_key="cuda:test:9.0", device_to_host=2e10, host_to_device=4e10)
    assert transfer_seconds(2 * 10**9, p) == pytest.approx(OVERHEAD + 0.1)
    assert transfer_seconds(2 * 10**9, p, to_host=False) == pytest.approx(OVERHEAD + 0.05)
    with pytest.raises(ValueError, match="must be >= 0"):
        transfer_seconds(-1, p)


def test_a_cpu_profile_has_no_transfer_time():
    with pytest.raises(ValueError, match="no host link"):
        transfer_seconds(1024, profile())


def test_the_offload_ops_cost_the_profiles_measurement_else_a_floor():
    gpu = profile(device_key="cuda:test:9.0", device_to_host=2e10, host_to_device=4e10)
    assert offload_ops_seconds(gpu) == OFFLOAD_OPS_FLOOR_S  # a built-in profile, or one measured before format 3
    assert offload_ops_seconds(dataclasses.replace(gpu, offload_ops_s=1.5e-4)) == 1.5e-4
    assert offload_ops_seconds(dataclasses.replace(gpu, offload_ops_s=0.0)) == 0.0  # measured as nothing: nothing
    with pytest.raises(ValueError, match="no host link"):
        offload_ops_seconds(profile())
