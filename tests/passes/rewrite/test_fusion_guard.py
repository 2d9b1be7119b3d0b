"""PlannedFusionChoices: no fusion across allocations that makes outputs early, checked on generated code and measured
peak."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from dpcs_compiler.measure import measure_peak_memory
from dpcs_compiler.passes.rewrite.fusion_guard import planned_fusion_choices

N = 256
BUFFER = N * N * 4
# Sums of N float32 products, reduced in another order by Inductor's vectorized kernels.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-3}


def silu_backward_like(g, u, grad, w):
    # The shape of a SwiGLU backward with its product recomputed: h (recomputed for a weight gradient) and
    # grad_g (the silu backward) read the same inputs, so Inductor fuses them into one kernel that runs
    # before the weight-gradient matmul, and grad_g exists while that matmul's output is made. Kept
    # apart, grad_g is made after the weight gradient is reduced and freed.
    h = F.silu(g) * u
    weight_grad = (h.t() @ grad).sum(dim=0)
    sg = torch.sigmoid(g)
    grad_g = grad * u * sg * (1 + g * (1 - sg))
    return weight_grad, (grad_g @ w).sum(dim=0)


def compile_and_measure(guarded: bool):
    torch._dynamo.reset()
    inputs = [torch.randn(N, N) for _ in range(4)]
    compiled = torch.compile(silu_backward_like, backend="inductor", dynamic=False)
    # Inductor's caches key on the graph, not on the heuristics object: compile afresh each time.
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        with planned_fusion_choices() if guarded else contextlib.nullcontext() as guard:
            outputs, (code,) = run_and_get_code(compiled, *inputs)
        _, peak = measure_peak_memory(compiled, *inputs)
    return outputs, silu_backward_like(*inputs), code, peak.peak_increase_bytes, guard


@pytest.mark.inductor
def test_guard_keeps_siblings_apart_and_lowers_the_measured_peak():
    outputs, expected, code, guarded_peak, guard = compile_and_measure(guarded=True)
    torch.testing.assert_close(outputs, expected, **TOLERANCE)
    assert guard.refused >= 1
    # h's kernel, the weight-gradient matmul, then grad_g's kernel.
    FileCheck().check("cpp_fused_mul_silu").check("extern_kernels.mm").check("cpp_fused").check("sigmoid").check(
        "extern_kernels.mm"
    ).run(code)

    outputs, expected, code, plain_peak, _ = compile_and_measure(guarded=False)
    torch.testing.assert_close(outputs, expected, **TOLERANCE)
    FileCheck().check("sigmoid_silu").check("extern_kernels.mm").check("extern_kernels.mm").run(code)  # one kernel
    assert plain_peak - guarded_peak == pytest.approx(BUFFER, abs=4096)


@pytest.mark.inductor
def test_neighbouring_siblings_still_fuse():
    def neighbours(a, b):
        return (a.sin() * b).sum(dim=0), (a.cos() + b).sum(dim=0)

    torch._dynamo.reset()
    inputs = [torch.randn(N, N) for _ in range(2)]
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), planned_fusion_choices() as guard:
        outputs, (code,) = run_and_get_code(torch.compile(neighbours, backend="inductor"), *inputs)
    torch.testing.assert_close(outputs, neighbours(*inputs), **TOLERANCE)
    assert guard.refused == 0
    assert code.count("cpp_fused") - code.count("def cpp_fused") >= 1


def producer_read_early(a, b, w, v):
    # The shape of a Llama SwiGLU backward at its lowest plan: e (a recomputed product) is read by a matmul
    # (a weight gradient) and by a later pointwise kernel that also reads another matmul's output. Fused
    # with that consumer, e is made after the second matmul, and the first runs after both, with the
    # consumer's output and the second matmul's alive: 1 MB over the plan on the bench Llama.
    e = torch.relu(a * b)
    weight_grad = (e.t() @ w).sum(dim=0)
    d = b @ v
    consumer = d * e + 1
    return weight_grad, (consumer @ w).sum(dim=0)


@pytest.mark.inductor
def test_guard_keeps_a_producer_read_early_apart_from_its_later_consumer():
    inputs = [torch.randn(N, N) for _ in range(4)]
    peaks, refused, would = {}, {}, {}
    for guarded in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(producer_read_early, backend="inductor", dynamic=False)
        with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
            # Off (the default), the rule leaves producer/consumer fusions to Inductor.
            with planned_fusion_choices(keep_producers_apart=guarded, count_refusable=True) as guard:
                outputs, (code,) = run_and_get_code(compiled, *inputs)
            _, peak = measure_peak_memory(compiled, *inputs)
        torch.testing.assert_close(outputs, producer_read_early(*inputs), **TOLERANCE)
        peaks[guarded], refused[guarded] = peak.peak_increase_bytes, guard.refused_vertical
        would[guarded] = guard.would_refuse_vertical
        if guarded:  # e's kernel, the weight gradient's matmul, the second matmul, then the consumer's kernel
            FileCheck().check("cpp_fused_mul_relu").check("extern_kernels.mm").check("extern_kernels.mm").check(
                "cpp_fused").check("extern_kernels.mm").run(code)
        else:  # one kernel for e and the consumer, after the second matmul
            FileCheck().check("extern_kernels.mm").check("cpp_fused_add_mul_relu").check("extern_kernels.mm").run(code)
    assert refused[False] == 0 and refused[True] >= 1, refused
    # Off, the guard counts the fusions the rule would refuse (what tells dpcs the rule changes the schedule);
    # on, it refuses them instead.
    assert would[False] >= 1 and would[True] == 0, would
    assert peaks[False] - peaks[True] >= BUFFER - 4096, peaks
