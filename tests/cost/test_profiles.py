"""profiles: which hardware profile a plan is costed with (measured, built-in, a file, given in code)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpcs_compiler.cost import hardware
from dpcs_compiler.cost.hardware import FORMAT_VERSION, device_key, profile_to_json
from dpcs_compiler.cost.profiles import BUILTIN_PROFILES, MEASURE, parse_profile_spec, resolve_profile
from dpcs_testing import fake_profile

GPUS = ["h100", "a100", "l4", "rtx4090"]


def test_the_built_in_profiles_are_the_gpus_people_train_on_and_a_reference_cpu():
    assert set(BUILTIN_PROFILES) == {*GPUS, "reference-cpu"}


@pytest.mark.parametrize("name", GPUS)
def test_a_gpu_profile_has_a_host_link_its_memory_and_a_real_devices_key(name):
    _, profile = BUILTIN_PROFILES[name]
    assert profile.device_type == "cuda" and profile.format_version == FORMAT_VERSION
    # named as device_key() names the real GPU, so the profile describes the device it runs on there
    assert profile.device_key.startswith("cuda:NVIDIA ") and profile.device_key.rsplit(":", 1)[1] in ("8.0", "8.9", "9.0")
    assert profile.host_to_device == profile.device_to_host and 16e9 <= profile.host_to_device <= 64e9
    assert profile.memory_bytes in (24 * 2**30, 80 * 2**30)
    # tensor cores: low precision at least 2x faster than fp32; fp8 twice bf16 where the GPU has it (not A100)
    assert profile.matmul_flops["bfloat16"] >= 2 * profile.matmul_flops["float32"]
    assert ("float8_e4m3fn" in profile.matmul_flops) == (name != "a100")
    if name != "a100":
        assert profile.matmul_flops["float8_e4m3fn"] == pytest.approx(2 * profile.matmul_flops["bfloat16"], rel=0.01)


def test_the_reference_cpu_has_slow_bf16_and_no_host_link():
    _, profile = BUILTIN_PROFILES["reference-cpu"]
    assert profile.device_type == "cpu" and profile.host_to_device is None
    assert profile.matmul_flops["bfloat16"] * 50 < profile.matmul_flops["float32"]


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_a_built_in_profile_resolves_the_same_on_any_device(name):
    resolved = resolve_profile(parse_profile_spec(name, source="test"), "cpu")
    assert resolved.profile is BUILTIN_PROFILES[name][1]
    assert resolved.source.startswith(f"built-in {name!r} (")
    assert resolved.describe() == f"{resolved.source} #{resolved.hash}" and len(resolved.hash) == 12


def test_the_hashes_of_the_built_in_profiles_are_stable():
    """The short hash names a profile in records and dumps across processes and machines."""
    assert resolve_profile("h100", "cpu").hash == resolve_profile("h100", "cpu").hash
    assert len({resolve_profile(name, "cpu").hash for name in BUILTIN_PROFILES}) == len(BUILTIN_PROFILES)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("measure", "measure"),
        (" h100 ", "h100"),
        ("reference-cpu", "reference-cpu"),
        ("profile.json", Path("profile.json")),
        ("profiles/gpu", Path("profiles/gpu")),
        (Path("x"), Path("x")),
    ],
)
def test_spec_forms(value, expected):
    assert parse_profile_spec(value, source="test") == expected


@pytest.mark.parametrize("value", ["h200", "H100", "", 3, None, ["h100"]])
def test_a_bad_spec_names_itself_where_it_came_from_and_the_choices(value):
    with pytest.raises(ValueError) as error:
        parse_profile_spec(value, source="environment variable DPCS_HARDWARE_PROFILE")
    message = str(error.value)
    assert message.startswith(f"environment variable DPCS_HARDWARE_PROFILE={value!r} is not valid")
    assert "'measure'" in message and "'h100', 'a100', 'l4', 'rtx4090', 'reference-cpu'" in message


def test_a_profile_given_in_code_is_used_as_it_is():
    profile = fake_profile()
    resolved = resolve_profile(parse_profile_spec(profile, source="test"), "cpu")
    assert resolved.profile is profile and resolved.source == "given in code"


def test_a_profile_file_round_trips_with_the_same_hash(tmp_path):
    _, h100 = BUILTIN_PROFILES["h100"]
    path = tmp_path / "gpu.json"
    path.write_text(profile_to_json(h100))
    resolved = resolve_profile(parse_profile_spec(str(path), source="test"), "cpu")
    assert resolved.profile == h100 and resolved.hash == resolve_profile("h100", "cpu").hash
    assert resolved.source == f"file {path.resolve()}"


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot be read"),
        ("{not json", "not JSON"),
        (json.dumps({**json.loads(profile_to_json(fake_profile())), "format_version": 1}), "format 1, this dpcs reads"),
        (json.dumps({**json.loads(profile_to_json(fake_profile())), "memory_bandwidth": -1}), "memory_bandwidth"),
    ],
    ids=["missing", "not-json", "old-format", "invalid"],
)
def test_a_bad_profile_file_is_an_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        resolve_profile(path, "cpu")
    assert str(path) in str(error.value)


def test_measure_is_the_devices_own_profile_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []

    def measure(device):
        calls.append(device)
        return fake_profile()

    monkeypatch.setattr(hardware, "measure_hardware_profile", measure)
    hardware.forget_memoized_profiles()
    try:
        first = resolve_profile(MEASURE, "cpu", cache_dir=tmp_path)
        hardware.forget_memoized_profiles()  # as a new process
        again = resolve_profile(MEASURE, torch.device("cpu"), cache_dir=tmp_path)
    finally:
        hardware.forget_memoized_profiles()
    assert len(calls) == 1 and first.hash == again.hash
    cached = hardware.cache_path(device_key("cpu"), tmp_path)
    assert first.source.startswith("measured 2026-01-01T00:00:00+00:00, cached at") and str(cached) in first.source
    assert again.source == first.source


def test_refresh_is_only_for_a_measured_profile():
    with pytest.raises(ValueError, match="'h100' is not measured"):
        resolve_profile("h100", "cpu", refresh=True)
