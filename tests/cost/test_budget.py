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
