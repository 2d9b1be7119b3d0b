"""Precision stage: decide each op's dtype and the fp8 linears of the Dynamo graph (`solve/precision.py`)
into the plan; the pre-autograd rewrites then carry it out."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpcs_compiler.cost.fp8 import linear_seconds
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.ops.fp8 import scaled_mm_supported
from dpcs_compiler.options import DpcsOptions
from dpcs_compiler.passes.analysis.op_sites import op_sites
from dpcs_compiler.passes.infra import Rewrite
from dpcs_compiler.passes.rewrite.fp8 import Fp8Regions
from dpcs_compiler.passes.rewrite.precision import DTYPES, PrecisionCasts
from dpcs_compiler.solve.precision import matching_pattern, plan_precision
from dpcs_compiler.stages.job import GraphJob, graph_device
from dpcs_compiler.types import OpSite

log = logging.getLogger("dpcs.pipeline")

# The rewrites of the Dynamo graph, in order (AOTAutograd traces the backward of what they insert).
PRE_AUTOGRAD_REWRITES: tuple[Rewrite, ...] = (Fp8Regions(), PrecisionCasts())


def plan_precision_stage(job: GraphJob, gm: fx.GraphModule) -> None:
    """Decide each op's dtype and the fp8 linears of the Dynamo graph (`solve/precision.py`) into the plan."""
    options = job.options
    job.record.precision = options.precision
    job.ctx.plan = dataclasses.replace(job.plan, precision=options.precision, detect_overflow=options.overflow_detected)
    if options.precision == "fp32" and options.fp8 is None:
        return  # keep_fp32 changes nothing when everything is fp32
    with job.ctx.instrumented("pre_autograd", "plan_precision"):
        sites = job.ctx.analyses.get(op_sites, gm)
        matmul = options.fp8.matmul if options.fp8 is not None else "scaled_mm"
        weight_grad_dtype = None
        if options.fp8 is not None and matmul == "auto":
            device = graph_device(gm)
            # Outputs in the region's dtype (forward, input gradient) and, for the weight gradient, the fp32
            # weight's, or else the region's and then cast.
            region = DTYPES[options.precision]
            matmul = "scaled_mm" if scaled_mm_supported(device, options.fp8.recipe, region) else "emulated"
            if matmul == "scaled_mm" and not scaled_mm_supported(device, options.fp8.recipe, torch.float32):
                weight_grad_dtype = options.precision
            if matmul == "emulated":
                warnings.warn(
                    f"torch._scaled_mm does not run the {options.fp8.recipe} fp8 recipe on {device}: dpcs emulates the "
                    "fp8 matmuls exactly in fp32 (same numerics, no speedup; fp8 matmuls need CUDA sm89 or newer)",
                    category=DpcsWarning, stacklevel=2,
                )
        select = None
        speed = None
        if options.fp8 is not None:
            select = options.fp8.select
            if select == "auto":  # emulation is for numerics: it is never faster
                select = "faster" if matmul == "scaled_mm" else "all"
            if select == "faster":
                profile = job.hardware_profile(graph_device(gm)).profile
                recipe, region = options.fp8.recipe, options.precision

                def speed(shape):
                    return linear_seconds(profile, max(1, shape.tokens), shape.in_features, shape.out_features,
                                          recipe=recipe, region=region)
        ops, linears = plan_precision(
            sites, precision=options.precision, keep_fp32=options.keep_fp32, fp8=options.fp8, fp8_matmul=matmul,
            fp8_weight_grad_dtype=weight_grad_dtype, fp8_speed=speed,
        )
        warn_unmatched_patterns(sites, options)
        job.ctx.plan = dataclasses.replace(job.plan, precision_ops=ops, fp8_linears=linears)
    job.record.cast_ops = sum(d.dtype != "fp8" for d in ops)
    job.record.fp8_linears = sum(d.fp8 for d in linears)
    job.record.fp8_matmul = matmul if options.fp8 is not None else None
    job.record.fp8_select = select
    job.record.fp8_slower = sum(d.speedup is not None and not d.fp8 for d in linears)
    eligible = [d for d in linears if d.fp8 or d.reason.startswith("stays ")]
    if select == "faster" and eligible and not job.record.fp8_linears:
        warnings.warn(
            f"fp8 was asked for, but none of this graph's {len(eligible)} eligible linears is faster in fp8 at its "
            f"shape on the hardware profile ({eligible[0].reason}); they stay {options.precision}. "
            "fp8={'select': 'all'} converts every eligible linear anyway (for numerics, not speed)",
            category=DpcsWarning, stacklevel=2,
        )
    log.info(
        "%s: precision %s, %d ops with a dtype decision, %d of %d linears in fp8%s",
        job.record.graph, options.precision, job.record.cast_ops, job.record.fp8_linears, len(linears),
        f" ({job.record.fp8_slower} slower in fp8 at their shape)" if job.record.fp8_slower else "",
    )


def warn_unmatched_patterns(sites: Sequence[OpSite], options: DpcsOptions) -> None:
    """A keep_fp32 or fp8 filter pattern that names no module of the graph is most likely a typo."""
    patterns = [("keep_fp32", p) for p in options.keep_fp32]
    if options.fp8 is not None:
        patterns += [("fp8.filter", p) for p in options.fp8.filter]
    modules = {m for site in sites for m in site.modules}
    for option, pattern in patterns:
        if matching_pattern(sorted(modules), [pattern]) is None:
            warnings.warn(
                f"dpcs option {option!r} pattern {pattern!r} matches no module of this graph; its modules are "
                f"named as model.named_modules() names them, e.g. {sorted(modules - {''})[:5]}",
                category=DpcsWarning, stacklevel=3,
            )
