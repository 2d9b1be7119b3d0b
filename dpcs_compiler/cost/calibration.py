"""Optional calibration of the roofline, kept structural: from ops timed one by one, or from measured steps.

A single global scale factor learned on one configuration does not carry over to another (a step dominated
by matmuls and one dominated by pointwise ops are off by different factors). So the fit keeps the roofline's
structure, seconds = overhead + max(compute_scale * compute_s, memory_scale * memory_s), and learns the two
scales and the per-op overhead separately by non-negative least squares.

Two sources of samples:
- `fit_calibration`: per-op samples (`measure_op_samples`: the graph run op by op under an interpreter).
- `fit_step_calibration`: measured steps of several plans of one workload (`StepSample`). What differs between
  the plans is what they recompute, so their step times tell what a recomputation costs in the compiled step
  as it really runs (fused, scheduled, without per-op instrumentation), per regime: the seconds per unit of
  the compute term of compute-bound ops, per unit of the memory term of memory-bound ops, and per op.
"""

from __future__ import annotations

import dataclasses
import itertools
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

__all__ = ["Calibration", "OpSample", "StepFit", "StepSample", "fit_calibration", "fit_step_calibration",
           "measure_op_samples", "recompute_terms"]


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


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One plan of a workload, measured: the roofline terms of what it recomputes per step, and its step time.

    compute_s: the compute term (FLOPs / FLOP/s) summed over the recomputed ops the profile's roofline calls
    compute-bound; memory_s: the memory term (bytes / bandwidth) summed over the others; ops: how many ops it
    recomputes (`CompileRecord.recompute_terms`, summed over the graphs of the step). measured_s: its
    measured step time (the median of steady steps, no instrumentation).
    """

    compute_s: float
    memory_s: float
    ops: int
    measured_s: float

    @classmethod
    def of(cls, recompute_terms: Sequence[dict[str, float]], measured_s: float) -> StepSample:
        """The sample of a step whose graphs recompute `recompute_terms` (each graph's
        `CompileRecord.recompute_terms`, its latest plan's) and that measured `measured_s`."""
        return cls(
            compute_s=sum(t["compute_s"] for t in recompute_terms),
            memory_s=sum(t["memory_s"] for t in recompute_terms),
            ops=int(sum(t["ops"] for t in recompute_terms)),
            measured_s=measured_s,
        )

    def __post_init__(self) -> None:
        for name in ("compute_s", "memory_s", "ops", "measured_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"StepSample: {name} must be finite and >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class StepFit:
    """What `fit_step_calibration` learned: the calibration to plan with, the fitted step time with nothing
    recomputed, which terms it fitted (the others keep the profile's value), the root-mean-square residual of
    the samples, and the leave-one-out error of the terms chosen against that of the profile's roofline."""

    calibration: Calibration
    base_s: float
    fitted: tuple[str, ...]
    samples: int
    residual_s: float
    held_out_s: float | None  # leave-one-out RMS error of the chosen terms (None: too few samples to hold one out)
    roofline_held_out_s: float | None  # the same with no term fitted (the profile's roofline and a base time)

    def to_json(self) -> dict[str, object]:
        return {**dataclasses.asdict(self.calibration), "base_s": self.base_s, "fitted": list(self.fitted),
                "samples": self.samples, "residual_s": self.residual_s, "held_out_s": self.held_out_s,
                "roofline_held_out_s": self.roofline_held_out_s}


STEP_TERMS = ("compute_scale", "memory_scale", "overhead_s")
MARGIN = 0.02  # a subset with more terms is chosen only if its held-out error is this much lower (relative; and 1 ns)


def _separable(terms: np.ndarray, columns: Sequence[int]) -> list[int]:
    """The columns the rows tell apart from a base time and from the columns before them (rank of the
    centred terms, each column scaled to unit size so seconds and op counts compare)."""
    centred = terms - terms.mean(axis=0)
    norms = np.linalg.norm(centred, axis=0)
    free: list[int] = []
    for k in columns:
        if norms[k] <= 1e-12 * max(1.0, float(np.abs(terms[:, k]).max())):
            continue
        trial = centred[:, free + [k]] / norms[free + [k]]
        if np.linalg.matrix_rank(trial, tol=1e-6) == len(free) + 1:
            free.append(k)
    return free


def _fit_terms(terms: np.ndarray, measured: np.ndarray, identity: np.ndarray, columns: Sequence[int]
               ) -> tuple[np.ndarray, float, list[int]]:
    """NNLS of the base time and the separable `columns`, the others at `identity`: (values, base, free)."""
    free = _separable(terms, columns)
    pinned = [k for k in range(3) if k not in free]
    target = measured - terms[:, pinned] @ identity[pinned]
    coef = _nnls(np.column_stack([terms[:, free], np.ones(len(measured))]), target)
    values = identity.copy()
    values[free] = coef[:-1]
    return values, float(coef[-1]), free


def _held_out(terms: np.ndarray, measured: np.ndarray, identity: np.ndarray, columns: Sequence[int]) -> float | None:
    """Leave-one-out RMS error of fitting `columns` (None: with one sample held out, fewer samples left than
    the columns plus the base time, or a column the remaining samples cannot tell apart)."""
    n = len(measured)
    if n - 1 < len(columns) + 1:
        return None
    errors = []
    for i in range(n):
        keep = np.arange(n) != i
        values, base, free = _fit_terms(terms[keep], measured[keep], identity, columns)
        if len(free) != len(columns):
            return None
        errors.append(base + terms[i] @ values - measured[i])
    return float(np.sqrt(np.mean(np.square(errors))))


def fit_step_calibration(samples: Sequence[StepSample], *, launch_overhead_s: float) -> StepFit:
    """Scales and per-op cost that explain the measured step times of plans that recompute differently.

    The model: measured_s = base_s + compute_scale * compute_s + memory_scale * memory_s + overhead_s * ops,
    with base_s (the step with nothing recomputed) and every coefficient >= 0, fitted by non-negative least
    squares in seconds. A coefficient of 0 is kept: a regime the measured steps show as free (pointwise
    recomputation Inductor fuses into the kernel that reads it) is planned as free.

    Which terms are fitted is chosen by how well they predict a plan they were not fitted to: every subset of
    the three terms the samples can tell apart (a term constant over them, or one that moves only in step with
    the terms before it, cannot be) is scored by its leave-one-out error, the empty subset (the profile's
    roofline, only base_s fitted) included. The fewest terms within MARGIN of the lowest error win, so a term
    is fitted only where it predicts held-out plans clearly better. A term not fitted keeps the profile's value
    (scale 1; the overhead None, the profile's own). A few noisy steps of plans whose terms rise together thus
    keep the roofline instead of a fit that explains them and mispredicts the next plan. Holding one sample
    out, fitting k terms takes k + 2 samples: with two samples the roofline is kept.

    At least two samples that recompute differently are needed: fewer is a ValueError, as is a negative or
    non-finite launch overhead (the profile's, used for the per-op term while it is not fitted).
    """
    if not 0 <= launch_overhead_s < float("inf"):
        raise ValueError(f"fit_step_calibration: launch_overhead_s must be finite and >= 0, got {launch_overhead_s}")
    distinct = len({(s.compute_s, s.memory_s, s.ops) for s in samples})
    if distinct < 2:
        raise ValueError(
            f"fit_step_calibration: needs measured steps of at least two plans that recompute differently, got "
            f"{len(samples)} sample(s) with {distinct} distinct"
        )
    terms = np.array([[s.compute_s, s.memory_s, float(s.ops)] for s in samples], dtype=np.float64)
    measured = np.array([s.measured_s for s in samples], dtype=np.float64)
    identity = np.array([1.0, 1.0, launch_overhead_s])
    separable = _separable(terms, range(3))
    subsets = [list(c) for size in range(len(separable) + 1) for c in itertools.combinations(separable, size)]
    # Two distinct samples give the empty subset a score: `scored` is never empty.
    scored = [(error, c) for c in subsets if (error := _held_out(terms, measured, identity, c)) is not None]
    roofline = next(e for e, c in scored if not c)
    best = min(e for e, _ in scored)
    held_out, chosen = min(((e, c) for e, c in scored if e <= best * (1 + MARGIN) + 1e-9), key=lambda t: (len(t[1]), t[0]))
    values, base, free = _fit_terms(terms, measured, identity, chosen)
    residual = measured - base - terms @ values
    return StepFit(
        calibration=Calibration(float(values[0]), float(values[1]), float(values[2]) if 2 in free else None),
        base_s=base,
        fitted=tuple(STEP_TERMS[k] for k in free),
        samples=len(samples),
        residual_s=float(np.sqrt(np.mean(residual**2))),
        held_out_s=held_out,
        roofline_held_out_s=roofline,
    )


def recompute_terms(node_terms: Sequence[tuple[float, float]]) -> dict[str, float]:
    """What a plan recomputes, as a `StepSample` counts it: the (compute, memory) roofline terms of each
    recomputed op, summed by the term that bounds the op under the profile's roofline, and the op count."""
    compute = sum(c for c, m in node_terms if c >= m)
    memory = sum(m for c, m in node_terms if c < m)
    return {"compute_s": compute, "memory_s": memory, "ops": len(node_terms)}
