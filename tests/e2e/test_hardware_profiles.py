"""A plan is a pure function of (graph, options, hardware profile): pinned profiles give the plan they imply
on any machine, a GPU's profile plans for that GPU from a CPU, and fresh processes plan alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from dpcs_testing import (
    BF16_FAST,
    FP32_FAST,
    SquaredLinears,
    dpcs_compile,
    expecting_best_plan,
    measured_step,
    reachable_range,
    recomputed_matmuls,
    squared_linears_step,
)
from dpcs_compiler.cost.profiles import BUILTIN_PROFILES
from dpcs_compiler.models import workload

H100_KEY = BUILTIN_PROFILES["h100"][1].device_key


def test_each_profile_gives_the_plan_it_implies(monkeypatch):
    """Same graph, same budget: a profile with fast fp32 matmuls recomputes fp32 matmuls only, one with fast
    bf16 matmuls bf16 ones only (a recomputation costs its FLOPs at its dtype's rate)."""
    model, x = SquaredLinears(), torch.randn(1024, 256) * 0.3
    low = squared_linears_step(model, x, memory_budget=1, on_infeasible="best", hardware_profile=FP32_FAST)
    high = squared_linears_step(model, x, memory_budget="1TiB", keep_torch_plan=False, hardware_profile=FP32_FAST)
    budget = int(low.predicted_peak_bytes + 0.1 * (high.predicted_peak_bytes - low.predicted_peak_bytes))
    with recomputed_matmuls(monkeypatch) as rerun:
        fp32_fast = squared_linears_step(model, x, memory_budget=budget, hardware_profile=FP32_FAST)
        bf16_fast = squared_linears_step(model, x, memory_budget=budget, hardware_profile=BF16_FAST)
    assert fp32_fast.plan_feasible and bf16_fast.plan_feasible
    assert rerun[0] and set(rerun[0]) == {torch.float32}, rerun
    assert rerun[1] and set(rerun[1]) == {torch.bfloat16}, rerun
    assert fp32_fast.plan_hash != bf16_fast.plan_hash
    assert fp32_fast.hardware_profile == f"cpu:test profile:2: given in code #{FP32_FAST.short_hash()}"


def test_a_gpu_profile_plans_for_that_gpu_from_a_cpu():
    """Offloads over the GPU's host link where they pay, a fraction of its memory, and a record that says the
    peak is that GPU's prediction; the graphs still run here, with the eager step's numerics.

    On this small GPT every value recomputes on an H100 in about a launch (5 us), less than the host time of an
    offload's four ops (the built-in profile's 50 us floor): at a budget recomputation meets, nothing is
    offloaded; the lowest peak needs a value out beyond what recomputation frees, and offloads it."""
    w = workload("gpt", 4)
    low, high = reachable_range(w, "eager", hardware_profile="h100")
    result, record = measured_step(w, "eager", memory_budget=(low + high) // 2, hardware_profile="h100")
    assert record.plan_feasible and record.offloaded_values == 0 and record.recomputed_values > 0
    assert record.planned_for == H100_KEY
    assert record.hardware_profile.startswith(f"{H100_KEY}: built-in 'h100' (NVIDIA H100 SXM5 80GB, datasheet) #")
    _, lowest = measured_step(w, "eager", memory_budget=1, on_infeasible="best", hardware_profile="h100")
    assert lowest.offloaded_values > 0 and lowest.predicted_peak_bytes == low  # the CPU profile has no host link: never
    _, fraction = measured_step(w, "eager", memory_budget=0.5, hardware_profile="h100")
    assert fraction.budget_bytes == 40 * 2**30  # of the H100's 80 GiB, not of this machine's RAM

    torch.manual_seed(0)
    reference = workload("gpt", 4)
    eager_loss = reference.loss_fn(reference.model(*reference.inputs))
    eager_loss.backward()
    torch._dynamo.reset()
    planned = dpcs_compile(w.model, "eager", memory_budget=1, on_infeasible="best", hardware_profile="h100")
    w.model.zero_grad(set_to_none=True)
    with expecting_best_plan():
        loss = w.loss_fn(planned(*w.inputs))
    loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for got, expected in zip(w.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


def test_a_cpu_profile_plans_no_offload_and_names_no_other_device():
    w = workload("gpt", 4)
    low, high = reachable_range(w, "eager")  # the suite's pinned reference CPU profile
    _, record = measured_step(w, "eager", memory_budget=(low + high) // 2)
    assert record.offloaded_values == 0 and record.planned_for is None
    assert record.hardware_profile.startswith("cpu:dpcs reference CPU (2-core AVX2):2: built-in 'reference-cpu'")


PLAN_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from dpcs_compiler import compile_records
    from dpcs_compiler.models import workload
    w = workload("gpt", 2)
    compiled = torch.compile(w.model, backend="dpcs", options={"compiler": "eager", "strict": True,
                                                               "memory_budget": int(sys.argv[1])})
    w.loss_fn(compiled(*w.inputs)).backward()
    (record,) = compile_records()
    print(json.dumps({"plan_hash": record.plan_hash, "hardware_profile": record.hardware_profile,
                      "recomputed": record.recomputed_values}))
    """
)


def test_fresh_processes_plan_alike_with_the_measured_profile(tmp_path):
    """The default, "measure": the first process measures and caches, the second reads the cache; both
    compile the same plan. (A CPU with a core free is never reported busy, so the profile is cached: each
    process runs one thread, as the suite's other worker may hold the other core.)"""
    w = workload("gpt", 2)
    low, high = reachable_range(w, "eager")
    env = {k: v for k, v in os.environ.items() if k != "DPCS_HARDWARE_PROFILE"} | {
        "DPCS_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
    }
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", PLAN_SCRIPT, str((low + high) // 2)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    assert runs[0] == runs[1] and runs[0]["recomputed"] > 0
    assert " cached at " in runs[0]["hardware_profile"] and str(tmp_path) in runs[0]["hardware_profile"]
    assert "USDT" not in done.stderr and "busy" not in done.stderr
