"""Optional calibration of the roofline from one measured step, kept structural.

A single global scale factor learned on one configuration does not carry over to another (a step dominated
by matmuls and one dominated by pointwise ops are off by different factors). So the fit keeps the roofline's
structure, seconds = overhead + max(compute_scale * compute_s, memory_scale * memory_s), and learns the two
scales and the per-op overhead separately by non-negative least squares over per-op samples.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from dpcs_compiler.cost.hardware import HardwareProfile
from dpcs_compiler.cost.op_time import FALLBACK_DTYPE, Calibration, compute_seconds, dtype_name, memory_seconds
from dpcs_compiler.types import NodeCost

__all__ = ["Calibration", "OpSample", "fit_calibration", "measure_op_samples"]


@dataclasses.dataclass(frozen=True)
class OpSample:
    """One op's roofline terms as the uncalibrated model predicts them, and its measured seconds."""

    name: str
    compute_s: float
    memory_s: float
    measured_s: float


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls  # scipy is needed only to fit

    return nnls(a, b)[0]


def _fit_classes(
    compute: np.ndarray, memory: np.ndarray, measured: np.ndarray, compute_bound: np.ndarray
) -> tuple[float, float, float]:
    """NNLS for fixed bound classes: (compute_scale, memory_scale, overhead).

    A term no sample is bound by keeps scale 1; so does a term NNLS puts at zero (the samples cannot tell it
    from the fixed overhead, and no op takes zero time per FLOP or byte), the others then refitted.
    """
    columns = [np.where(compute_bound, compute, 0.0), np.where(compute_bound, 0.0, memory)]
    scales = [1.0, 1.0]
    free = [k for k in (0, 1) if columns[k].any()]
    while True:
        pinned = sum((columns[k] for k in (0, 1) if k not in free), np.zeros_like(measured))
        a = np.column_stack([columns[k] for k in free] + [np.ones_like(measured)])
        coef = _nnls(a, measured - pinned)
        zero = [k for k, c in zip(free, coef) if c <= 0.0]
        if not zero:
            for k, c in zip(free, coef):
                scales[k] = float(c)
            return scales[0], scales[1], float(coef[-1])
        free = [k for k in free if k not in zero]


def fit_calibration(samples: Sequence[OpSample], *, max_rounds: int = 20) -> Calibration:
    """Least-squares (in seconds, so long ops weigh most) scales and overhead that best explain the samples.

    Which term bounds each op depends on the scales, so the fit alternates: classify each sample by the
    larger scaled term, fit, and repeat until the classes no longer change.
    """
    if not samples:
        raise ValueError("fit_calibration: no samples")
    compute = np.array([s.compute_s for s in samples], dtype=np.float64)
    memory = np.array([s.memory_s for s in samples], dtype=np.float64)
    measured = np.array([s.measured_s for s in samples], dtype=np.float64)
    values = np.concatenate([compute, memory, measured])
    if not (np.isfinite(values).all() and (values >= 0).all()):
        raise ValueError("fit_calibration: sample times must be finite and >= 0")
    compute_scale, memory_scale, overhead = 1.0, 1.0, 0.0
    compute_bound = None
    for _ in range(max_rounds):
        classes = compute_scale * compute >= memory_scale * memory
        if compute_bound is not None and np.array_equal(classes, compute_bound):
            break
        compute_bound = classes
        compute_scale, memory_scale, overhead = _fit_classes(compute, memory, measured, compute_bound)
    return Calibration(compute_scale, memory_scale, overhead)


def _synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for every CUDA device these tensors live on, so the clock brackets the op's device work."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


class _TimingInterpreter(fx.Interpreter):
    """Runs the graph node by node, timing each call of a chosen node and noting its dtype."""

    def __init__(self, gm: fx.GraphModule, timed: set[fx.Node]):
        super().__init__(gm)
        self.timed = timed
        self.times: dict[fx.Node, list[float]] = {n: [] for n in timed}
        self.dtypes: dict[fx.Node, str] = {}
        self._node: fx.Node | None = None

    def run_node(self, n: fx.Node):
        self._node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        node = self._node
        if node not in self.timed:
            return super().call_function(target, args, kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if node not in self.dtypes:
            floats = [t for t in tensors if t.is_floating_point()]
            self.dtypes[node] = dtype_name(floats[0].dtype) if floats else FALLBACK_DTYPE
        _synchronize(tensors)
        start = time.perf_counter()
        result = super().call_function(target, args, kwargs)
        _synchronize(tensors + [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)])
        self.times[node].append(time.perf_counter() - start)
        return result


def measure_op_samples(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    profile: HardwareProfile,
    node_costs: dict[fx.Node, NodeCost],
    *,
    repeats: int = 3,
    warmup: int = 1,
) -> list[OpSample]:
    """One sample per costed call_function node (flops or bytes > 0): its roofline terms and median time.

    The graph runs warmup + repeats times under torch.fx.Interpreter with real inputs on the profile's device,
    synchronizing the CUDA devices of its tensors around every timed node. Per-node timing through an
    interpreter inflates small ops (Python dispatch, synchronization, no overlap between ops), so the fitted
    overhead is an upper bound and calibration is best taken on a step whose ops are large. In-place ops in
    the graph mutate the inputs on every run. Nodes whose cost is zero (views, getitem) are skipped.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"measure_op_samples: need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    timed = {
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n in node_costs
        and (node_costs[n].flops or node_costs[n].bytes_read or node_costs[n].bytes_written)
    }
    interpreter = _TimingInterpreter(gm, timed)
    with torch.no_grad():
        for _ in range(warmup):
            interpreter.run(*example_inputs)
        for times in interpreter.times.values():
            times.clear()
        for _ in range(repeats):
            interpreter.run(*example_inputs)
    samples = []
    for node in gm.graph.nodes:
        if node in timed:
            cost = node_costs[node]
            samples.append(
                OpSample(
                    name=node.name,
                    compute_s=compute_seconds(cost.flops, interpreter.dtypes[node], profile),
                    memory_s=memory_seconds(cost.bytes_read + cost.bytes_written, profile),
                    measured_s=statistics.median(interpreter.times[node]),
                )
            )
    return samples
