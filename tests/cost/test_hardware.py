"""hardware: the measured profile, its JSON form, and the on-disk cache that measures once per device."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcs_testing import fake_profile
from dpcs_compiler.cost import hardware
from dpcs_compiler.cost.hardware import (
    BUSY_CPU_SHARE,
    FORMAT_VERSION,
    cache_path,
    device_key,
    measured_profile,
    measure_cpu_share,
    measure_hardware_profile,
    profile_from_json,
    profile_to_json,
)


@pytest.fixture
def counted_measure(monkeypatch):
    """Replaces the measurement with a fake that counts its calls; the memo starts and ends empty."""
    calls = []

    def measure(device):
        calls.append(device)
        return fake_profile(launch_overhead_s=1e-6 * len(calls))  # each measurement distinguishable

    monkeypatch.setattr(hardware, "measure_hardware_profile", measure)
    hardware.forget_memoized_profiles()
    yield calls
    hardware.forget_memoized_profiles()


def test_measuring_this_cpu_gives_positive_finite_figures_and_no_host_link():
    profile = measure_hardware_profile(torch.device("cpu"))
    assert profile.device_key == f"cpu:{hardware._cpu_model_name()}:{torch.get_num_threads()}"
    assert (profile.torch_version, profile.format_version) == (torch.__version__, FORMAT_VERSION)
    assert set(profile.matmul_flops) == {"float32", "bfloat16", "float16"}
    for rate in (*profile.matmul_flops.values(), profile.memory_bandwidth):
        assert math.isfinite(rate) and 1e6 < rate < 1e16
    assert 0 < profile.launch_overhead_s < 1e-3  # a 1-element add on a CPU
    assert profile.host_to_device is None and profile.device_to_host is None
    assert profile.offload_ops_s is None  # no offload on a CPU
    assert 0 < profile.cpu_share  # how busy the machine was is not the test's to decide
    assert profile.memory_bytes > 2**30


def test_the_offload_ops_timer_is_registered_by_the_ops_not_imported_here():
    """cost/ does not import the in-graph ops: the ops register how they are timed, and the layers that measure
    a profile (the backend's job, the runtime, `dpcs hardware`) import them first."""
    import dpcs_compiler.stages.job  # noqa: F401
    from dpcs_compiler.ops import offload_ops

    assert hardware._offload_ops_timer is offload_ops.host_seconds_per_value


def test_a_backend_measures_real_kernels_while_dynamos_fake_mode_is_active():
    """The partitioner, where plans are made, runs under a fake mode and the Python dispatcher: a matmul timed
    there returned at once (1.1e15 FLOP/s on a 2-core CPU), and a 1-element add cost 3x its eager time, every
    time. The launch overhead is microseconds, so the other pytest worker's load can double one reading
    (3.9 against 1.8 us was seen in CI): it is compared up to three times, and once under 2x is enough."""
    ratios = []
    for _ in range(3):
        real = measure_hardware_profile("cpu")
        with FakeTensorMode(), enable_python_dispatcher():
            in_partitioner = measure_hardware_profile("cpu")
        for name in ("float32", "bfloat16"):
            assert in_partitioner.matmul_flops[name] < 20 * real.matmul_flops[name]
        assert in_partitioner.memory_bandwidth < 20 * real.memory_bandwidth
        ratios.append(in_partitioner.launch_overhead_s / real.launch_overhead_s)
        if ratios[-1] < 2:
            break
    assert min(ratios) < 2, ratios


def idle_cpu_share(window_s: float = 30.0) -> float:
    """The share on this machine with nothing started by the test: the best reading within `window_s`, taken
    until one says not busy. The other pytest worker's test may run two rank processes for seconds at a time
    (one reading of 0.497 was seen while one did): a machine idle but for this test is one where that ends."""
    best, start = 0.0, time.monotonic()
    while best < BUSY_CPU_SHARE and time.monotonic() - start < window_s:
        best = max(best, measure_cpu_share())
        if best < BUSY_CPU_SHARE:
            time.sleep(0.2)
    return best


def test_an_idle_machine_is_not_busy():
    assert idle_cpu_share() >= BUSY_CPU_SHARE


def test_an_idle_machine_is_not_busy_when_its_matmuls_run_on_one_thread(monkeypatch, tmp_path):
    """A BLAS runs small matrices on one thread (AMX and AVX512-BF16 CPUs at the profile's first sizes):
    the share read during matmuls was 0.5 on an idle 2-core machine, and its profile was never cached."""
    real_mm = torch.mm

    def one_thread_mm(a, b):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return real_mm(a, b)
        finally:
            torch.set_num_threads(threads)

    monkeypatch.setattr(torch, "mm", one_thread_mm)
    profiles = [measure_hardware_profile("cpu") for _ in range(2)]
    monkeypatch.undo()
    assert any(not p.busy for p in profiles), [p.cpu_share for p in profiles]


@contextlib.contextmanager
def competing_processes(count: int):
    """`count` processes that spin on the CPU until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # started and spinning
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=30)


def test_a_machine_busy_with_other_processes_is_busy(tmp_path):
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with competing_processes(3 * cpus):  # 3 spinning processes per CPU: ~0.25 of it left to this process
        share = measure_cpu_share()
        profile = hardware.measured_profile("cpu", cache_dir=tmp_path)
    hardware.forget_memoized_profiles()
    assert share < BUSY_CPU_SHARE
    assert profile.profile.busy and "busy" in profile.source and "not cached" in profile.source
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "quota, expected", [("max 100000\n", None), ("150000 100000\n", 1.5), ("200000\n", 2.0)]
)
def test_a_cgroup2_cpu_quota_is_read(tmp_path, quota, expected):
    path = tmp_path / "cpu.max"
    path.write_text(quota)
    assert hardware._cgroup2_quota(path) == expected


def test_usable_cpus_never_exceed_torchs_threads():
    assert 1 <= hardware.usable_cpus() <= torch.get_num_threads()


def test_the_profile_is_measured_once_then_memoized(tmp_path, counted_measure):
    first = measured_profile("cpu", cache_dir=tmp_path)
    cache_path(device_key("cpu"), tmp_path).unlink()  # the memo alone must answer
    assert measured_profile(torch.device("cpu"), cache_dir=tmp_path) is first
    assert len(counted_measure) == 1


def test_a_new_process_reloads_the_cached_file_without_measuring(tmp_path, counted_measure):
    first = measured_profile("cpu", cache_dir=tmp_path)
    hardware.forget_memoized_profiles()  # as a fresh process would start
    assert measured_profile("cpu", cache_dir=tmp_path) == first
    assert len(counted_measure) == 1


def test_refresh_measures_again_and_overwrites_the_cache(tmp_path, counted_measure):
    measured_profile("cpu", cache_dir=tmp_path)
    refreshed = measured_profile("cpu", cache_dir=tmp_path, refresh=True)
    assert len(counted_measure) == 2
    hardware.forget_memoized_profiles()
    assert measured_profile("cpu", cache_dir=tmp_path) == refreshed
    assert len(counted_measure) == 2


@pytest.mark.parametrize(
    "bad_content",
    [
        "{not json",
        "",
        json.dumps([1, 2]),
        profile_to_json(fake_profile(device_key="cpu:Some Other CPU:64")),
        profile_to_json(fake_profile(format_version=FORMAT_VERSION + 1)),
        profile_to_json(fake_profile(torch_version="0.0.1")),
        profile_to_json(fake_profile()).replace("1e-06", "-1.0"),  # negative overhead
        profile_to_json(fake_profile()).replace('"float32"', '"float64"'),  # no float32 figure
        profile_to_json(fake_profile()).replace('"memory_bytes": 25769803776', '"memory_bytes": 0'),
    ],
    ids=["truncated", "empty", "not-an-object", "other-device", "other-format", "other-torch", "negative", "no-fp32",
         "no-memory"],
)
def test_a_corrupt_or_mismatched_cache_file_is_measured_again_and_overwritten(tmp_path, counted_measure, bad_content):
    path = cache_path(device_key("cpu"), tmp_path)
    path.write_text(bad_content)
    profile = measured_profile("cpu", cache_dir=tmp_path).profile
    assert len(counted_measure) == 1
    assert profile_from_json(path.read_text()) == profile


def test_a_profile_measured_on_a_busy_cpu_is_used_but_not_cached(tmp_path, monkeypatch):
    calls = []

    def measure(device):
        calls.append(device)
        return fake_profile(cpu_share=0.2)

    monkeypatch.setattr(hardware, "measure_hardware_profile", measure)
    hardware.forget_memoized_profiles()
    busy = measured_profile("cpu", cache_dir=tmp_path)
    assert busy.profile.busy and measured_profile("cpu", cache_dir=tmp_path) is busy
    assert list(tmp_path.iterdir()) == []
    hardware.forget_memoized_profiles()  # a later process measures again
    measured_profile("cpu", cache_dir=tmp_path)
    assert len(calls) == 2
    hardware.forget_memoized_profiles()


def test_the_default_cache_dir_follows_dpcs_cache_dir(tmp_path, monkeypatch, counted_measure):
    monkeypatch.setenv("DPCS_CACHE_DIR", str(tmp_path))
    measured_profile("cpu")
    assert [p.parent for p in tmp_path.rglob("*.json")] == [tmp_path / "hardware"]


def test_json_round_trips_a_cuda_like_profile():
    profile = fake_profile(device_key="cuda:NVIDIA H100 80GB HBM3:9.0", host_to_device=2.5e10, device_to_host=2.4e10,
                           matmul_flops={"float32": 5e13, "bfloat16": 7e14, "float8_e4m3fn": 1.4e15}, cpu_share=None,
                           offload_ops_s=1.5e-4)
    assert profile_from_json(profile_to_json(profile)) == profile
    assert profile_from_json(profile_to_json(profile)).offload_ops_s == 1.5e-4


def test_a_format_2_file_reads_with_the_offload_ops_unmeasured():
    """A profile pinned as a file before format 3 (perhaps measured on a GPU not here) still plans: its
    offload ops cost the floor."""
    profile = fake_profile(device_key="cuda:NVIDIA H200:9.0", host_to_device=5e10, device_to_host=5e10, cpu_share=None)
    old = ({k: v for k, v in json.loads(profile_to_json(profile)).items() if k not in ("offload_ops_s", "matmul_table")}
           | {"format_version": 2})
    assert profile_from_json(json.dumps(old)) == profile
    with pytest.raises(ValueError, match="format 2, this dpcs reads"):  # format 2 with a later field is no file of ours
        profile_from_json(json.dumps({**old, "offload_ops_s": 1e-4}))


def test_a_format_3_file_reads_without_a_matmul_table():
    profile = fake_profile(device_key="cuda:NVIDIA H200:9.0", host_to_device=5e10, device_to_host=5e10, cpu_share=None)
    old = {k: v for k, v in json.loads(profile_to_json(profile)).items() if k != "matmul_table"} | {"format_version": 3}
    assert profile_from_json(json.dumps(old)) == profile and profile.matmul_table is None


def test_a_matmul_table_round_trips_through_json_and_pickle():
    import pickle

    table = {"bfloat16": [[1024, 1024, 1024, 2e-5], [4096, 4096, 4096, 2e-4]], "float8_e4m3fn": [[1024, 1024, 1024, 3e-5]]}
    profile = fake_profile(device_key="cuda:NVIDIA H200:9.0", cpu_share=None, matmul_table=table)
    assert profile.matmul_table["bfloat16"][1] == (4096, 4096, 4096, 2e-4)
    assert profile_from_json(profile_to_json(profile)).matmul_table == profile.matmul_table
    assert pickle.loads(pickle.dumps(profile)).matmul_table == profile.matmul_table


@pytest.mark.parametrize("table, message", [
    ([1, 2], "must be a mapping"),
    ({"bfloat16": []}, "non-empty list"),
    ({"bfloat16": [[1024, 1024, 1024]]}, "is not \\[M, K, N, seconds\\]"),
    ({"bfloat16": [[1024, 0, 1024, 1e-5]]}, "positive int sizes"),
    ({"bfloat16": [[1024, 1024, 1024, -1.0]]}, "seconds must be positive"),
])
def test_a_bad_matmul_table_is_a_value_error_naming_it(table, message):
    with pytest.raises(ValueError, match=message):
        fake_profile(matmul_table=table)


@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan, True, "fast"])
def test_a_bad_offload_ops_time_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="offload_ops_s must be None or finite and >= 0"):
        fake_profile(offload_ops_s=value)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        json.dumps({k: v for k, v in json.loads(profile_to_json(fake_profile())).items() if k != "measured_at"}),
        json.dumps({**json.loads(profile_to_json(fake_profile())), "extra": 1}),
        json.dumps({**json.loads(profile_to_json(fake_profile())), "memory_bandwidth": "fast"}),
        json.dumps({**json.loads(profile_to_json(fake_profile())), "format_version": "1"}),
    ],
    ids=["list", "missing-field", "extra-field", "string-rate", "string-version"],
)
def test_from_json_rejects_anything_but_a_complete_valid_profile(text):
    with pytest.raises(ValueError, match="hardware profile"):
        profile_from_json(text)


def test_the_profile_is_immutable():
    profile = fake_profile()
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.memory_bandwidth = 1.0
    with pytest.raises(TypeError):
        profile.matmul_flops["float32"] = 1.0


def test_the_profile_survives_pickle_and_deepcopy():
    profile = fake_profile()
    assert pickle.loads(pickle.dumps(profile)) == profile
    assert copy.deepcopy(profile) == profile


@pytest.mark.parametrize("device", ["not-a-device", "meta", 3.5])
def test_a_bad_device_is_a_value_error_naming_it(tmp_path, device):
    with pytest.raises(ValueError, match=repr(device).replace(".", r"\.")):
        measured_profile(device, cache_dir=tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
def test_cuda_without_cuda_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="CUDA is not available"):
        measured_profile("cuda:0", cache_dir=tmp_path)


def test_a_profile_that_cannot_be_cached_says_so(tmp_path, counted_measure):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the cache folder would have to be made inside a file
    resolved = measured_profile("cpu", cache_dir=blocker)
    assert resolved.source.endswith(f"not cached (cannot write {cache_path(device_key('cpu'), blocker)})")


def test_a_matmul_table_times_each_kind_at_each_shape_and_drops_kinds_the_device_refuses():
    """The CUDA table's timing loop, run on CPU float32 matmuls at tiny sizes (the CUDA makers need a GPU)."""
    from dpcs_compiler.cost.hardware import _PLANS, measure_matmul_table

    def fp32(m, k, n):
        a, b = torch.randn(m, k), torch.randn(k, n)
        return lambda: torch.mm(a, b)

    def refused(m, k, n):
        raise RuntimeError("no such kernel here")

    table = measure_matmul_table({"float32": fp32, "float8_e4m3fn": refused}, ((8, 16), (8, 32)), lambda: None,
                                 _PLANS["cpu"], budget_s=30.0)
    assert list(table) == ["float32"]
    assert [row[:3] for row in table["float32"]] == [[m, k, n] for m in (8, 16) for k in (8, 32) for n in (8, 32)]
    assert all(row[3] > 0 for row in table["float32"])
    fake_profile(matmul_table=table)  # what it measures is a valid table
    assert measure_matmul_table({"float32": fp32}, ((8,), (8,)), lambda: None, _PLANS["cpu"], budget_s=0.0) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_table_times_bf16_and_the_fp8_matmuls_the_device_runs():
    from dpcs_compiler.cost.hardware import _PLANS, FP8_ROWWISE, FP8_TENSORWISE, _cuda_matmul_makers

    from dpcs_compiler.cost.hardware import measure_matmul_table

    table = measure_matmul_table(_cuda_matmul_makers(torch.device("cuda")), ((256,), (256, 512)),
                                 torch.cuda.synchronize, _PLANS["cuda"], budget_s=30.0)
    assert len(table["bfloat16"]) == 4
    if torch.cuda.get_device_capability() >= (8, 9):  # fp8 tensor cores
        assert len(table[FP8_TENSORWISE]) == 4 and FP8_ROWWISE in table
    fake_profile(matmul_table=table)
