"""memory_budget forms resolved to bytes for a device."""

from __future__ import annotations

import pytest
import torch

from dpcs_compiler.cost import budget as budget_module
from dpcs_compiler.cost.budget import AUTO_MARGIN_FRACTION, DeviceMemory, device_memory, resolve_budget


@pytest.fixture
def fake_memory(monkeypatch):
    monkeypatch.setattr(budget_module, "device_memory", lambda device: DeviceMemory(total_bytes=1000, free_bytes=600))


def test_bytes_pass_through(fake_memory):
    assert resolve_budget(12345, torch.device("cpu"), resident_bytes=10) == 12345


def test_fraction_is_of_total_memory(fake_memory):
    assert resolve_budget(0.25, torch.device("cpu"), resident_bytes=10) == 250


def test_auto_is_free_plus_resident_less_margin(fake_memory):
    assert resolve_budget("auto", torch.device("cpu"), resident_bytes=100) == 600 + 100 - int(AUTO_MARGIN_FRACTION * 1000)


def test_host_memory_is_read_for_cpu():
    memory = device_memory(torch.device("cpu"))
    assert 0 < memory.free_bytes <= memory.total_bytes


def test_unsupported_device_is_named():
    with pytest.raises(ValueError, match="device meta is not supported"):
        device_memory(torch.device("meta"))


class _FakeCudaCap:
    """torch.cuda's per-process cap on one 1000-byte device, as `cap_reserved` reads and sets it."""

    def __init__(self, monkeypatch, fraction: float = 1.0):
        self.fraction, self.sets = fraction, []
        props = type("Props", (), {"total_memory": 1000})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: self.fraction)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set)
        monkeypatch.setattr(budget_module, "_CAPS", {})

    def set(self, fraction, index):
        self.fraction = fraction
        self.sets.append(round(fraction * 1000))


def test_cap_is_lowered_to_the_budget(monkeypatch):
    cuda = _FakeCudaCap(monkeypatch)
    assert budget_module.cap_reserved(600, torch.device("cuda", 0)) == 600
    assert cuda.sets == [600]
    # a second budget in the process: the larger bounds both steps; a smaller one leaves the cap as it is
    assert budget_module.cap_reserved(700, torch.device("cuda", 0)) == 700
    assert budget_module.cap_reserved(500, torch.device("cuda", 0)) == 700
    assert cuda.sets == [600, 700]


def test_a_users_cap_below_the_budget_stays(monkeypatch):
    cuda = _FakeCudaCap(monkeypatch, fraction=0.5)
    assert budget_module.cap_reserved(600, torch.device("cuda", 0)) == 500
    assert cuda.sets == []
    # and a later budget never lifts the cap above the one the process had
    assert budget_module.cap_reserved(900, torch.device("cuda", 0)) == 500


def test_a_cap_the_user_sets_after_dpcs_is_theirs(monkeypatch):
    cuda = _FakeCudaCap(monkeypatch)
    budget_module.cap_reserved(600, torch.device("cuda", 0))
    cuda.fraction = 1.0  # the user lifts it
    assert budget_module.cap_reserved(600, torch.device("cuda", 0)) == 600  # a new budget: capped again
    cuda.fraction = 0.4  # the user lowers it below the budget: it stays
    assert budget_module.cap_reserved(600, torch.device("cuda", 0)) == 400


def test_predicted_reserved_is_within_the_cap():
    expected = 1000 + int(budget_module.EXPANDABLE_EXPECTED_FRACTION * 1000)
    assert budget_module.predicted_reserved(1000, 0, expandable=True) == expected
    assert budget_module.predicted_reserved(1000, 0, expandable=True, cap=expected - 5) == expected - 5
    assert budget_module.predicted_reserved(1000, 1100, expandable=True) == 1100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's cap is CUDA's")
def test_cap_reserved_bounds_what_the_caching_allocator_takes_on_cuda(monkeypatch):
    monkeypatch.setattr(budget_module, "_CAPS", {})
    device = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.get_per_process_memory_fraction(device)
    try:
        torch.cuda.empty_cache()  # the segments left hold live tensors
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        cap = budget_module.cap_reserved(reserved + (64 << 20), device)
        assert cap == reserved + (64 << 20)
        with pytest.raises(torch.OutOfMemoryError):  # more than the cached space and the room under the cap
            torch.empty(reserved - allocated + (256 << 20), dtype=torch.uint8, device=device)
        block = torch.empty(32 << 20, dtype=torch.uint8, device=device)  # within the cap
        del block
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)
