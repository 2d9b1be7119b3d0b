"""Shared test helpers (imported by tests) and the per-test fresh state fixture (re-exported by conftest)."""

from __future__ import annotations

import pytest
import torch

from dpcs_compiler import clear_compile_records

COMPILERS = ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    clear_compile_records()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def dpcs_compile(model, compiler: str = "eager", **options):
    """torch.compile through dpcs; the test suite runs strict so a dpcs failure is a test failure."""
    return torch.compile(model, backend="dpcs", options={"compiler": compiler, "strict": True, **options})
