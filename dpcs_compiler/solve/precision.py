"""The precision planner: which dtype each op of a Dynamo graph computes in, and which linears run in fp8.

A pure function of the graph's `OpSite`s and the options. The reference is torch.autocast's CUDA op
lists (torch.amp docs, "CUDA Ops that can autocast to float16 / float32"): ops on the lower-precision list
run in the low dtype (their floating inputs are cast to it), ops on the fp32 list run in fp32 (their
low-precision inputs are cast up), ops on the promote list (cat, stack, addcmul, dot, grid_sample...) get
their floating inputs cast to the widest of them, and every other op runs in the dtype its inputs promote
to (or, for ops that do not promote, in its inputs' dtype). Where dpcs differs, and why:

- One list on every device. CPU autocast keeps other lists (it runs layer_norm in bf16, for one); a
  plan means the same numerics on the machine that tests it and the one that trains.
- Norms all run in fp32: batch_norm, instance_norm and rms_norm join layer_norm and group_norm. Autocast
  hands batch_norm low-precision input (cuDNN accumulates in fp32 inside); dpcs keeps every norm's
  statistics and affine step in fp32, as the issue asks, at the cost of an fp32 input saved for backward.
- Mean, var and std reductions run in fp32 with sum and prod (autocast leaves them in the low dtype,
  accumulating in fp32 inside but rounding the result).
- binary_cross_entropy runs in fp32 instead of raising (autocast refuses it as unsafe under fp16).
- lerp promotes its operands like the promote list (it needs one dtype; autocast lists it nowhere).
- `keep_fp32` patterns keep whole modules in fp32 (autocast can only be switched off in code).
- A linear on the fp8 list (`Fp8Options`) runs as an fp8 matmul with its output in the region's dtype;
  with `select="faster"`, only where the hardware profile says fp8 is faster at its shape (`cost/fp8.py`).
- Python code that branches on a tensor's dtype (`if x.dtype == torch.float16: x = x.clamp(...)`,
  `torch.finfo(x.dtype)`, `x.to(y.dtype)`) was traced by Dynamo with the model's own dtypes and is baked
  into the graph as such; under autocast it sees the low dtype.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from dpcs_compiler.cost.fp8 import LinearSeconds
from dpcs_compiler.cost.hardware import FP8_DIM_MULTIPLE
from dpcs_compiler.options import Fp8Options
from dpcs_compiler.plan import Fp8Decision, PrecisionDecision
from dpcs_compiler.types import LinearShape, OpSite

# torch.autocast's CUDA lower-precision list, as torch-level names.
LOWER_PRECISION_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "chain_matmul",
    "multi_dot", "vecdot", "einsum", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "scaled_dot_product_attention",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "linalg_vecdot", "linalg_multi_dot",
})
# torch.autocast's CUDA fp32 list.
AUTOCAST_FP32_OPS = frozenset({
    "pow", "rpow", "rtruediv", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "exp", "expm1", "log", "log10",
    "log1p", "log2", "reciprocal", "rsqrt", "softplus", "softmax", "softmin", "log_softmax", "cumprod", "cumsum",
    "prod", "sum", "logsumexp", "norm", "normalize", "renorm", "dist", "cdist", "pdist", "cosine_similarity",
    "layer_norm", "group_norm", "binary_cross_entropy_with_logits", "cross_entropy", "nll_loss", "mse_loss",
    "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "vector_norm", "matrix_norm", "linalg_vector_norm",
    "linalg_matrix_norm", "special_logsumexp", "special_expm1", "special_log1p", "special_softmax",
    "special_log_softmax",
})
# torch.autocast's CUDA promote list (floating inputs are cast to the widest of them), and lerp, which
# needs its operands in one dtype and is on no autocast list.
PROMOTE_OPS = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "linalg_cross", "dot", "vdot", "grid_sample",
    "grid_sampler", "index_put", "scatter_add", "tensordot", "cat", "concat", "concatenate", "stack", "lerp",
})
# Where dpcs keeps fp32 beyond autocast (see the module docstring).
DPCS_FP32_OPS = frozenset({
    "batch_norm", "instance_norm", "rms_norm", "mean", "var", "std", "var_mean", "std_mean", "binary_cross_entropy",
})
FP32_OPS = AUTOCAST_FP32_OPS | DPCS_FP32_OPS
FP8_ALIGNMENT = FP8_DIM_MULTIPLE  # torch._scaled_mm needs every matmul dimension to be a multiple of 16
WIDEST = "widest"  # a decision's dtype for promote ops: the widest of the op's floating inputs


def matching_pattern(modules: Sequence[str], patterns: Sequence[str]) -> str | None:
    """The first pattern that names one of the modules (fnmatch, case-sensitive; "" is the root module,
    which "*" matches), or None."""
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(module, pattern) for module in modules):
            return pattern
    return None


def fp8_eligibility(site: OpSite, fp8: Fp8Options, kept: str | None) -> str | None:
    """Why this linear cannot be an fp8 region, or None if it can."""
    shape = site.linear
    if kept is not None:
        return f"kept in fp32 by keep_fp32 {kept!r}"
    if matching_pattern(site.modules, fp8.filter) is None:
        return f"module {site.module!r} matches no fp8 filter pattern {list(fp8.filter)}"
    if shape is None:
        return "weight is not a 2-D tensor"
    dims = {"in_features": shape.in_features, "out_features": shape.out_features, "tokens": shape.tokens}
    unaligned = [f"{k}={v}" for k, v in dims.items() if v % FP8_ALIGNMENT]
    if unaligned:
        return f"{', '.join(unaligned)} not a multiple of {FP8_ALIGNMENT}"
    if min(shape.in_features, shape.out_features) < fp8.min_size:
        return f"{shape.in_features}x{shape.out_features} is below min_size {fp8.min_size}"
    return None


def _faster(seconds: LinearSeconds, shape: LinearShape, fp8: Fp8Options, precision: str,
            matmul: str) -> tuple[str | None, str, float | None]:
    """(why it stays in the region's dtype or None, why it is fp8, the predicted speedup) for one linear."""
    at = f"M, K, N = {shape.tokens}, {shape.in_features}, {shape.out_features}"
    if seconds.fp8_s is None:
        return f"stays {precision}: the hardware profile has no fp8 matmul speed", "", None
    speedup = seconds.speedup
    times = (f"{seconds.fp8_s * 1e6:.1f} us against {seconds.region_s * 1e6:.1f} us a step at {at}, "
             f"casts and scales counted ({seconds.source})")
    if not seconds.fp8_faster:
        return f"stays {precision}: {fp8.recipe} fp8 would be {speedup:.2f}x as fast ({times})", "", speedup
    return None, f"{fp8.recipe} fp8 linear ({matmul}), {speedup:.2f}x as fast as {precision} ({times})", speedup


def plan_precision(
    sites: Sequence[OpSite],
    *,
    precision: str,
    keep_fp32: Sequence[str] = (),
    fp8: Fp8Options | None = None,
    fp8_matmul: str = "scaled_mm",
    fp8_weight_grad_dtype: str | None = None,
    fp8_speed: Callable[[LinearShape], LinearSeconds] | None = None,
) -> tuple[tuple[PrecisionDecision, ...], tuple[Fp8Decision, ...]]:
    """Per-op dtype decisions (only for ops that need casts) and one decision per linear when fp8 is on.

    `fp8_matmul` is how the device runs fp8 matmuls ("scaled_mm" or "emulated", decided by a probe), and
    `fp8_weight_grad_dtype` the dtype its weight-gradient matmuls output when the weight's is not available.
    `fp8_speed` (fp8's `select="faster"`): a linear's step seconds in fp8 and in the region's dtype at its
    shape; an eligible linear runs in fp8 only where that is faster.
    """
    ops: list[PrecisionDecision] = []
    linears: list[Fp8Decision] = []
    for site in sites:
        kept = matching_pattern(site.modules, keep_fp32)
        if fp8 is not None and site.op == "linear":
            why_not = fp8_eligibility(site, fp8, kept)
            shape = site.linear
            reason, speedup = f"{fp8.recipe} fp8 linear ({fp8_matmul})", None
            if why_not is None and fp8_speed is not None:
                assert shape is not None  # eligible linears have one
                why_not, reason, speedup = _faster(fp8_speed(shape), shape, fp8, precision, fp8_matmul)
            linears.append(Fp8Decision(
                node=site.node, module=site.module,
                in_features=shape.in_features if shape else 0, out_features=shape.out_features if shape else 0,
                tokens=shape.tokens if shape else 0, fp8=why_not is None,
                reason=why_not or reason,
                recipe=fp8.recipe if why_not is None else None, matmul=fp8_matmul if why_not is None else None,
                margin=fp8.margin, grad_dtype=fp8.grad_dtype if why_not is None else None,
                weight_grad_dtype=fp8_weight_grad_dtype if why_not is None else None, speedup=speedup,
            ))
            if why_not is None:
                ops.append(PrecisionDecision(site.node, site.module, site.op, "fp8", "fp8 region"))
                continue
        if precision == "fp32":
            continue  # everything already is (an fp8 region's output included)
        if kept is not None:
            ops.append(PrecisionDecision(site.node, site.module, site.op, "fp32", f"keep_fp32 {kept!r}"))
        elif site.op in LOWER_PRECISION_OPS:
            ops.append(PrecisionDecision(site.node, site.module, site.op, precision, "autocast lower-precision op"))
        elif site.op in AUTOCAST_FP32_OPS:
            ops.append(PrecisionDecision(site.node, site.module, site.op, "fp32", "autocast fp32 op"))
        elif site.op in DPCS_FP32_OPS:
            ops.append(PrecisionDecision(site.node, site.module, site.op, "fp32", "dpcs fp32 op"))
        elif site.op in PROMOTE_OPS:
            ops.append(PrecisionDecision(site.node, site.module, site.op, WIDEST, "autocast promote op"))
    return tuple(ops), tuple(linears)
