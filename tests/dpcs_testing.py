"""Shared test helpers (imported by tests) and the per-test fresh state fixture (re-exported by conftest)."""

from __future__ import annotations

import pytest
import torch

import contextlib
import importlib.util
import sys
import warnings
from pathlib import Path

from dpcs_compiler import clear_compile_records, compile_records
from dpcs_compiler.measure import measure_training_step

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


def dynamo_graph(model, *inputs) -> torch.fx.GraphModule:
    """The (single) graph Dynamo makes of `model(*inputs)`, as a backend receives it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return graphs[0]


def measured_step(w, compiler: str, **options):
    """Compile `w` afresh with these options and measure one step: (measurement, its compile record)."""
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(w.model, compiler, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on_infeasible="best" warns; the record says it
        result = measure_training_step(w.model, compiled, w.inputs, loss_fn=w.loss_fn, warmup=1, repeats=1)
    (record,) = [r for r in compile_records() if r.mode == "training"]
    return result, record


def reachable_range(w, compiler: str, **options) -> tuple[int, int]:
    """(smallest peak any plan reaches, peak of the plan that saves everything), as predicted."""
    _, lowest = measured_step(w, compiler, memory_budget=1, on_infeasible="best", **options)
    _, highest = measured_step(w, compiler, memory_budget="1TiB", **options)
    assert lowest.plan_feasible is False and highest.plan_feasible is True
    assert highest.recomputed_values == 0 and lowest.recomputed_values > 0
    return lowest.predicted_peak_bytes, highest.predicted_peak_bytes


@contextlib.contextmanager
def benchmark_script(name: str):
    """benchmarks/<name>.py of this checkout, loaded as a module (scripts, not part of the package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"dpcs_{name}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


class PrecisionToy(torch.nn.Module):
    """A linear, a norm, a matmul re-reading the linear's weight, a softmax, a head: casts in both directions."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.norm(self.proj(x))
        a = h @ self.proj.weight  # reads the weight the linear already cast
        return self.head(a.softmax(-1)) * 2.0


class WritesBetweenReads(torch.nn.Module):
    """A value read by a linear, written in place, and read by another linear."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = x * 1.0
        a = self.first(y)
        y.mul_(100.0)
        return a + self.second(y)
