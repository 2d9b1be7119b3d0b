"""The fp8 linear: `fp8_linear(x, weight, bias)` with dynamic scaling, traceable by AOTAutograd.

Recipe. Every operand is scaled just in time from its own current absolute maximum (dynamic scaling: no
amax history, no state): scale = finfo(fp8).max / amax / 2**margin, so the largest value lands on the top of
the fp8 range, less `margin` binades of headroom. The forward matmul takes x and weight in e4m3 (more
mantissa); the two backward matmuls take the output gradient in e5m2 (more range; `grad_dtype="e4m3"`
trades range for precision) against the weight or x in e4m3. Products accumulate in fp32 and the scales are
applied to the fp32 sum (`torch._scaled_mm`, or an fp32 emulation of it where that op is not available);
the result is cast to the output dtype.

Granularity. "tensorwise" uses one scale per tensor everywhere. "rowwise" uses one scale per row of the
contraction, so each operand is scaled along the axis its matmul reduces over: forward x and weight per row
(over K); grad_x = g @ w with g per row and w per column (over N); grad_w = g^T @ x with g and x per column
(over M). A backward operand thus needs a different scaling axis than its forward cast.

Saved for backward. Tensorwise casts x the same way in forward and backward, so it saves x's fp8 tensor and
its scale (1 byte an element instead of 2 or 4) and the high-precision weight, which is a resident parameter
anyway; the weight is cast again in backward, because an fp8 copy of it saved across the step would be an
extra N*K bytes per linear. Rowwise saves the high-precision x and weight, since backward casts them along
other axes. Under AOTAutograd this is what the joint graph's data flow says and what `default_partition`
keeps; the min-cut partitioner, which does not know that a parameter stays resident, instead moves the
backward casts into the forward and saves fp8 copies of the weight (and, for rowwise, of x): a partition
that should follow this recipe has to tag those casts for recomputation.

Compared with torchao's float8 training (`torchao.float8`, recipes "tensorwise" and "rowwise"): the scaling
formula (amax clamped below by 1e-12, saturating cast) and the e4m3 forward operands are the same. torchao's
rowwise recipe casts gradients to e4m3 as well and rounds scales down to powers of two; we keep e5m2 for
gradients in both recipes by default, with unrounded scales. torchao's autograd function saves the
high-precision input and re-casts it in backward, leaving it to the min-cut partitioner whether the fp8 copy is saved instead; we
save the fp8 copy explicitly for tensorwise. torchao can pad K and N to multiples of 16; we refuse them instead
(the rewrite should leave such linears in high precision).

Everything here is plain aten ops on tensors (no `.item()`, no data-dependent branches, no in-place updates
of inputs), so AOTAutograd traces forward and backward into the joint graph. `scaled_mm_supported` is the
one function that runs real kernels: a compile-time probe of what the device's `_scaled_mm` accepts.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dpcs_compiler.cost.hardware import FP8_DIM_MULTIPLE

RECIPES = ("tensorwise", "rowwise")
MATMULS = ("scaled_mm", "emulated")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The output gradient's fp8 format. e5m2 (the default) has the range gradients need; its 2-bit mantissa
# bounds the SQNR of a quantized Gaussian at about 25.6 dB (24.6 dB for the gradient matmuls). e4m3 gives
# about 28 dB with 2**15 less range, as torchao's rowwise recipe chooses.
GRAD_DTYPES = {"e5m2": E5M2, "e4m3": E4M3}

# Floor for amax, so that an all-zero tensor gets a finite scale (torchao's EPS): finfo(e5m2).max / 1e-12 is
# far below the fp32 maximum, while finfo(float32).tiny would overflow the scale to inf and give 0 * inf = NaN.
AMAX_FLOOR = 1e-12


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


def quantize(
    t: torch.Tensor, dtype: torch.dtype, *, dim: int | None = None, margin: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast `t` to fp8 `dtype` with a dynamic scale; returns (t_fp8, inv_scale) with t ~= t_fp8 * inv_scale.

    dim=None scales the whole tensor (inv_scale is a 0-dim fp32 tensor); an int scales each slice along
    `dim` (inv_scale keeps `dim` with size 1). `margin` lowers the scale by 2**margin, leaving headroom.
    """
    fp8_max = torch.finfo(dtype).max
    magnitude = t.abs()
    amax = (magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)).float()  # exact in t's dtype
    scale = (fp8_max / 2.0**margin) / torch.clamp(amax, min=AMAX_FLOOR)
    t_fp8 = torch.clamp(t.float() * scale, -fp8_max, fp8_max).to(dtype)
    return t_fp8, scale.reciprocal()


def scaled_matmul(
    a_fp8: torch.Tensor,
    a_inv: torch.Tensor,
    b_fp8: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    matmul: str,
) -> torch.Tensor:
    """out[m, n] = a_inv[m] * b_inv[n] * sum_k a[m, k] b[k, n], accumulated in fp32, cast to `out_dtype`.

    a is [M, K] and b is [K, N] in fp8 (any strides: they are copied to the row-major a and column-major b
    that `_scaled_mm` needs on CUDA, which are no-ops when already so). Scales are fp32: both 0-dim
    (tensorwise), or a_inv [M, 1] and b_inv [1, N] (rowwise). matmul="emulated" computes the same in fp32
    with plain aten ops, for devices without fp8 matmuls.
    """
    _check_choice("matmul", matmul, MATMULS)
    if matmul == "emulated":
        accumulated = a_fp8.float() @ b_fp8.float()
        return (accumulated * (a_inv * b_inv)).to(out_dtype)
    a_row_major = a_fp8.contiguous()
    b_column_major = b_fp8.t().contiguous().t()
    return torch._scaled_mm(a_row_major, b_column_major, a_inv, b_inv, out_dtype=out_dtype)


def _as_column(inv_scale: torch.Tensor) -> torch.Tensor:
    """A [1, n] or [n, 1] rowwise scale as a contiguous [n, 1] (_scaled_mm checks scale strides)."""
    return inv_scale.reshape(-1, 1)


def _as_row(inv_scale: torch.Tensor) -> torch.Tensor:
    """A [1, n] or [n, 1] rowwise scale as a contiguous [1, n]."""
    return inv_scale.reshape(1, -1)


class Fp8Linear(torch.autograd.Function):
    """y = x @ weight^T + bias with fp8 operands; see the module docstring for what each matmul casts."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, margin, matmul, out_dtype, grad_dtype=E5M2, weight_grad_dtype=None):
        in_features = weight.shape[1]
        x2d = x.reshape(-1, in_features)
        if recipe == "tensorwise":
            x_fp8, x_inv = quantize(x2d, E4M3, margin=margin)
            w_fp8, w_inv = quantize(weight, E4M3, margin=margin)
        else:
            x_fp8, x_inv = quantize(x2d, E4M3, dim=-1, margin=margin)
            w_fp8, w_inv = quantize(weight, E4M3, dim=-1, margin=margin)
            w_inv = _as_row(w_inv)
        out = scaled_matmul(x_fp8, x_inv, w_fp8.t(), w_inv, out_dtype, matmul)
        if bias is not None:
            out = out + bias.to(out_dtype)

        needs_grad_x, needs_grad_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if recipe == "tensorwise":
            saved_x = (x_fp8, x_inv) if needs_grad_w else (None, None)
        else:
            saved_x = (x2d, None) if needs_grad_w else (None, None)
        ctx.save_for_backward(*saved_x, weight if needs_grad_x else None)
        ctx.recipe, ctx.margin, ctx.matmul, ctx.grad_dtype = recipe, margin, matmul, grad_dtype
        ctx.weight_grad_dtype = weight_grad_dtype or weight.dtype
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        saved_x, saved_x_inv, weight = ctx.saved_tensors
        needs_grad_x, needs_grad_w, needs_grad_b = ctx.needs_input_grad[:3]
        recipe, margin, matmul = ctx.recipe, ctx.margin, ctx.matmul
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None

        if recipe == "tensorwise":
            if needs_grad_x or needs_grad_w:
                g_fp8, g_inv = quantize(g, ctx.grad_dtype, margin=margin)
            if needs_grad_x:
                w_fp8, w_inv = quantize(weight, E4M3, margin=margin)
                grad_x = scaled_matmul(g_fp8, g_inv, w_fp8, w_inv, ctx.x_dtype, matmul)
            if needs_grad_w:
                grad_w = scaled_matmul(g_fp8.t(), g_inv, saved_x, saved_x_inv, ctx.weight_grad_dtype, matmul)
        else:
            if needs_grad_x:
                g_fp8, g_inv = quantize(g, ctx.grad_dtype, dim=-1, margin=margin)  # [M, 1]
                w_fp8, w_inv = quantize(weight, E4M3, dim=0, margin=margin)  # [1, K]
                grad_x = scaled_matmul(g_fp8, g_inv, w_fp8, w_inv, ctx.x_dtype, matmul)
            if needs_grad_w:
                g_fp8, g_inv = quantize(g, ctx.grad_dtype, dim=0, margin=margin)  # [1, N]
                x_fp8, x_inv = quantize(saved_x, E4M3, dim=0, margin=margin)  # [1, K]
                grad_w = scaled_matmul(g_fp8.t(), _as_column(g_inv), x_fp8, x_inv, ctx.weight_grad_dtype, matmul)

        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weight_dtype)
        if needs_grad_b:
            grad_b = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: str = "tensorwise",
    margin: float = 0.0,
    matmul: str = "scaled_mm",
    out_dtype: torch.dtype | None = None,
    grad_dtype: str = "e5m2",
    weight_grad_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with fp8 matmuls in forward and backward; x [..., K], weight [N, K].

    The output is in `out_dtype` (default x.dtype), the gradients in the dtypes of x, weight and bias.
    `weight_grad_dtype` is what the weight-gradient matmul outputs before the cast to the weight's dtype
    (default the weight's: CUDA's `_scaled_mm` gives rowwise results only in bf16 on most builds).
    K and N must be multiples of 16.
    """
    _check_choice("recipe", recipe, RECIPES)
    _check_choice("matmul", matmul, MATMULS)
    _check_choice("grad_dtype", grad_dtype, tuple(GRAD_DTYPES))
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear needs x [..., K] and weight [N, K]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    if in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
        raise ValueError(
            f"fp8_linear needs in_features (K={in_features}) and out_features (N={out_features}) to be "
            f"multiples of {FP8_DIM_MULTIPLE}, as torch._scaled_mm does on CUDA"
        )
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"fp8_linear needs bias [N={out_features}]; got {tuple(bias.shape)}")
    return Fp8Linear.apply(
        x, weight, bias, recipe, float(margin), matmul, out_dtype or x.dtype, GRAD_DTYPES[grad_dtype], weight_grad_dtype
    )


def scaled_mm_supported(device: torch.device | str, recipe: str, out_dtype: torch.dtype) -> bool:
    """Whether `torch._scaled_mm` runs on `device` for `recipe`'s scale shapes and `out_dtype`.

    Tries both operand pairs fp8_linear uses (e4m3 x e4m3 forward, e5m2 x e4m3 backward) once on tiny real
    tensors, outside any fake or tracing mode, so a torch.compile backend can call it; cached per arguments.
    """
    _check_choice("recipe", recipe, RECIPES)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _probe_scaled_mm(device, recipe, out_dtype)


@functools.cache
def _probe_scaled_mm(device: torch.device, recipe: str, out_dtype: torch.dtype) -> bool:
    m, k, n = 16, 32, 16
    try:
        with _disable_current_modes(), torch.no_grad():
            # Deterministic data: the probe must not draw from the global RNG.
            a = torch.ones(m, k, device=device)
            b_t = torch.ones(n, k, device=device)
            if recipe == "tensorwise":
                a_inv = torch.tensor(0.5, device=device)
                b_inv = torch.tensor(0.25, device=device)
            else:
                a_inv = torch.full((m, 1), 0.5, device=device)
                b_inv = torch.full((1, n), 0.25, device=device)
            expected = torch.full((m, n), k * 0.5 * 0.25, device=device)
            for a_dtype, b_dtype in ((E4M3, E4M3), (E5M2, E4M3)):
                out = torch._scaled_mm(a.to(a_dtype), b_t.to(b_dtype).t(), a_inv, b_inv, out_dtype=out_dtype)
                if out.dtype != out_dtype or not torch.equal(out.float(), expected):
                    return False
    except Exception:  # any refusal (dtype, scale shape, architecture, build) means "not supported"
        return False
    return True


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `test` against `reference` in dB, computed in fp64 (inf if equal)."""
    reference64 = reference.detach().double()
    signal = reference64.square().sum().item()
    noise = (reference64 - test.detach().double()).square().sum().item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
