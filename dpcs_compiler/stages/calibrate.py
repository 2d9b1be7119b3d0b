"""Calibrated costs (option `calibrate`): the roofline a graph is planned with, fitted to its own ops' times.

The hardware profile's roofline prices an op as overhead + max(FLOPs / FLOP/s, bytes / bandwidth). How far
that is from what the ops of one graph take depends on the graph: a step of large matmuls and one of many
small pointwise ops are off by different factors (LESSONS.md: a factor learned on one configuration did not
carry over to another). So each graph is calibrated on itself, structurally: its joint graph (forward and
backward) runs once op by op with real inputs of its shapes, and `cost/calibration.fit_calibration` fits the
compute scale, the memory scale and the per-op cost to those times. The graph's plan is then costed with
that fit; the regime is the graph's own op mix.

The fit is kept per graph (its Dynamo fingerprint and sizes) for the process, so runtime variants, step
variants and re-plans of the graph reuse it. In a distributed job rank 0 measures and every rank plans with
its fit (the plans must agree). A graph with dynamic shapes, or one whose ops cannot run on made-up inputs,
is planned with the profile's roofline, with a warning naming why.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import torch
import torch.fx as fx

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.calibration import fit_calibration, measure_op_samples
from dpcs_compiler.cost.hardware import HardwareProfile, _plain_dispatch
from dpcs_compiler.cost.op_time import Calibration
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.stages.job import GraphJob, has_symbolic_shapes
from dpcs_compiler.types import NodeCost

log = logging.getLogger("dpcs.pipeline")

REPEATS, WARMUP = 2, 1  # runs of the joint graph timed, and run before them
_FITS: dict[tuple, "CalibrationFit"] = {}


@dataclasses.dataclass(frozen=True)
class CalibrationFit:
    calibration: Calibration
    samples: int
    seconds: float  # spent measuring and fitting

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.calibration), "samples": self.samples, "seconds": round(self.seconds, 3)}


def graph_calibration(
    job: GraphJob, joint: fx.GraphModule, costs: dict[fx.Node, NodeCost], profile: HardwareProfile, profile_hash: str
) -> Calibration | None:
    """The calibration `joint` is planned with (None: the profile's roofline, and why is warned)."""
    if has_symbolic_shapes(joint):
        warnings.warn(f"dpcs calibrate: {job.record.graph} has dynamic shapes; planned with the profile's roofline",
                      category=DpcsWarning, stacklevel=3)
        return None
    key = (job.graph_fingerprint, profile_hash, job.options.size_hints)
    if key not in _FITS:
        def measure() -> CalibrationFit:
            return _measure(joint, costs, profile)

        try:
            _FITS[key] = rank_agreement.from_rank_zero(measure, "calibration") if job.agreeing_ranks else measure()
        except Exception as error:  # noqa: BLE001 - an op that cannot run on made-up inputs: plan uncalibrated
            warnings.warn(
                f"dpcs calibrate: could not time the ops of {job.record.graph} ({type(error).__name__}: {error}); "
                "planned with the profile's roofline",
                category=DpcsWarning, stacklevel=3,
            )
            return None
    fit = _FITS[key]
    job.record.calibration = fit.to_json()
    return fit.calibration


def _measure(joint: fx.GraphModule, costs: dict[fx.Node, NodeCost], profile: HardwareProfile) -> CalibrationFit:
    started = time.perf_counter()
    with _plain_dispatch():
        inputs = [_made_up(n) for n in joint.graph.find_nodes(op="placeholder")]
        samples = measure_op_samples(joint, inputs, profile, costs, repeats=REPEATS, warmup=WARMUP)
    if not samples:
        raise ValueError("no op with a cost to time")
    fit = CalibrationFit(fit_calibration(samples), len(samples), time.perf_counter() - started)
    log.info("calibrated on %d ops in %.2f s: %s", fit.samples, fit.seconds, fit.calibration)
    return fit


def _made_up(node: fx.Node) -> Any:
    """A real input like the placeholder's example value: small random floats, zeros for integers (indices
    within any range), False for booleans."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return value
    shape, dtype = tuple(int(s) for s in value.shape), value.dtype
    device = torch.device(value.device.type, value.device.index) if value.device.type != "meta" else torch.device("cpu")
    if dtype.is_floating_point:
        return (torch.randn(shape, device=device) * 0.02).to(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def clear_calibrations() -> None:
    """Forget the fits (tests)."""
    _FITS.clear()
