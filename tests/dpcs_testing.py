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
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.cost.hardware import FORMAT_VERSION, HardwareProfile, device_key
from dpcs_compiler.measure import measure_training_step

COMPILERS = ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]


# Every test plans with this fixed profile unless it says otherwise, so a test that asserts a plan decision
# expects the same plan on every CPU CI runs on (AVX2-only, AVX512-BF16, AMX; 2 or more cores).
TEST_HARDWARE_PROFILE = "reference-cpu"


@pytest.fixture(autouse=True)
def fresh_compile_state(monkeypatch):
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", TEST_HARDWARE_PROFILE)
    monkeypatch.delenv("DPCS_OPTIONS", raising=False)  # a developer's own options change no test
    torch._dynamo.reset()
    clear_compile_records()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


# The verdict dpcs warns with when a compile asked for on_infeasible="best" under a budget no plan meets.
BEST_PLAN_VERDICT = r"memory_budget .* cannot be met .*compiling (that plan|it) \(on_infeasible='best'\)"


def expecting_best_plan():
    """Around a compile asked for on_infeasible="best" under a budget no plan meets: the DpcsWarning that says
    so is required (the suite makes every other dpcs warning an error, pyproject.toml)."""
    return pytest.warns(DpcsWarning, match=BEST_PLAN_VERDICT)


@contextlib.contextmanager
def allowing_best_plan():
    """Around code whose budgets may or may not be met, asked for on_infeasible="best" (a sweep of budgets, a
    Runtime tightening its plan): that verdict passes; any other dpcs warning still fails the test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=BEST_PLAN_VERDICT, category=DpcsWarning)
        yield


def budget_refusal(error: BaseException | None):
    """The BudgetInfeasibleError `error` is or wraps (Dynamo wraps a backend's errors), or None."""
    from dpcs_compiler.stages.job import BudgetInfeasibleError

    while error is not None and not isinstance(error, BudgetInfeasibleError):
        error = getattr(error, "inner_exception", None) or error.__cause__
    return error


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
    with allowing_best_plan():  # any other dpcs warning fails the test
        result = measure_training_step(w.model, compiled, w.inputs, loss_fn=w.loss_fn, warmup=1, repeats=1)
    (record,) = [r for r in compile_records() if r.mode == "training"]
    return result, record


def assert_gradients_match_eager(w, **options) -> None:
    """One step of `w` compiled through dpcs with `options` (strict) gives eager's gradients."""
    import copy

    eager = copy.deepcopy(w.model)
    torch._dynamo.reset()
    compiled = dpcs_compile(w.model, **options)
    for model, fn in ((w.model, compiled), (eager, eager)):
        model.zero_grad(set_to_none=True)
        with allowing_best_plan():  # any other dpcs warning fails the test
            w.loss_fn(fn(*w.inputs)).backward()
    for (name, p), q in zip(w.model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def reachable_range(w, compiler: str, **options) -> tuple[int, int]:
    """(smallest peak any plan reaches, peak of the plan that saves everything), as predicted (dpcs plans at
    a budget nothing presses: `keep_torch_plan=False`)."""
    _, lowest = measured_step(w, compiler, memory_budget=1, on_infeasible="best", **options)
    _, highest = measured_step(w, compiler, memory_budget="1TiB", keep_torch_plan=False, **options)
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


class SquaredLinearBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fast = torch.nn.Linear(d, d, bias=False)
        self.exact = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.fast(x)
        h = self.exact(h * h)
        return h * h


class SquaredLinears(torch.nn.Module):
    """Blocks of two linears, each output squared, so the backward reads each matmul's output itself. Compiled
    with `SQUARED_LINEARS_PRECISION`, `fast` computes in bf16 and `exact` in fp32: under a budget that makes
    some matmuls recompute, which ones shows how fast the hardware profile says each dtype is."""

    def __init__(self, d: int = 256, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[SquaredLinearBlock(d) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x).sum()


SQUARED_LINEARS_PRECISION = {"precision": "bf16", "keep_fp32": ["*.exact"]}


def fake_profile(**changes) -> HardwareProfile:
    """A valid profile of this CPU as `measure_hardware_profile` would return it, with `changes`."""
    fields = dict(
        device_key=device_key("cpu"),
        torch_version=torch.__version__,
        format_version=FORMAT_VERSION,
        matmul_flops={"float32": 1e11, "bfloat16": 2e11, "float16": 5e10},
        memory_bandwidth=2e10,
        host_to_device=None,
        device_to_host=None,
        launch_overhead_s=1e-6,
        measured_at="2026-01-01T00:00:00+00:00",
        cpu_share=0.95,
        memory_bytes=24 * 2**30,
    )
    return HardwareProfile(**{**fields, **changes})


def profile_with_matmul_rates(float32: float, bfloat16: float) -> HardwareProfile:
    """A CPU profile with these matmul FLOP/s (float16 as bfloat16) and fixed other figures."""
    return fake_profile(
        device_key="cpu:test profile:2", torch_version="test", measured_at="test", memory_bandwidth=5e10,
        matmul_flops={"float32": float32, "bfloat16": bfloat16, "float16": bfloat16},
    )


FP32_FAST = profile_with_matmul_rates(1e12, 1e10)  # an AVX2-only CPU: bf16 matmuls emulated, 100x slower
BF16_FAST = profile_with_matmul_rates(1e10, 1e12)  # bf16 matmul units (AMX, tensor cores) and slow fp32


def squared_linears_step(model, x, **options):
    """Compile afresh and run one step of `SquaredLinears` in bf16 with `fast`/`exact` matmuls: its record."""
    torch._dynamo.reset()
    clear_compile_records()
    compiled = dpcs_compile(model, "eager", **SQUARED_LINEARS_PRECISION, **options)
    with allowing_best_plan():  # any other dpcs warning fails the test
        compiled(x).backward()
    (record,) = [r for r in compile_records() if r.mode == "training"]
    return record


@contextlib.contextmanager
def recomputed_matmuls(monkeypatch):
    """Collects, for each graph partitioned by a plan, the dtypes of the forward matmuls its plan re-runs."""
    import dpcs_compiler.stages.partition as partition_stage
    from dpcs_compiler.plan import RECOMPUTE

    seen: list[list[torch.dtype]] = []
    real = partition_stage.partition_by_plan

    def spy(joint, joint_inputs, planning, decisions, **kwargs):
        rerun = {n for c, d in zip(planning.candidates, decisions) if d == RECOMPUTE for n in c.recompute_nodes}
        seen.append(sorted((n.meta["val"].dtype for n in rerun if n.target == torch.ops.aten.mm.default), key=str))
        return real(joint, joint_inputs, planning, decisions, **kwargs)

    monkeypatch.setattr(partition_stage, "partition_by_plan", spy)
    yield seen
    monkeypatch.setattr(partition_stage, "partition_by_plan", real)


@contextlib.contextmanager
def backward_lowerings(monkeypatch):
    """Counts Inductor's lowerings of backward graphs to its IR (`GraphLowering.run` inside a backward's
    compile_fx_inner): each candidate backward dpcs schedules, and the backward it compiles."""
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.graph import GraphLowering

    count, backward = [0], [False]
    real, run = compile_fx.compile_fx_inner, GraphLowering.run

    def counted(gm, example_inputs, *args, **kwargs):
        backward[0] = bool(kwargs.get("is_backward"))
        try:
            return real(gm, example_inputs, *args, **kwargs)
        finally:
            backward[0] = False

    def lowered(self, *args):
        count[0] += backward[0]
        return run(self, *args)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", counted)
    monkeypatch.setattr(GraphLowering, "run", lowered)
    yield count
    monkeypatch.setattr(compile_fx, "compile_fx_inner", real)
    monkeypatch.setattr(GraphLowering, "run", run)


def lowerings_expected(record) -> int:
    """The backward lowerings a plan over its budget costs (`PartCompiler.lowest_scheduled_backward`): one per
    order scheduled (both fusion rules are scheduled from one lowering), and one more for the compile unless
    the last order scheduled was the preferred, compiled as it was."""
    orders = list(dict.fromkeys(name.split(",")[0] for name in record.backward_order_scheduled))
    return len(orders) + (orders[-1] != record.backward_order)


RANK_TIMEOUT_S = 240  # a rank that waits longer is hung: the test fails instead of hanging
PEER_GRACE_S = 30  # once a rank failed, the others are given this long to finish or fail, then killed


def run_rank_processes(commands: list[list[str]], envs: list[dict[str, str]]) -> None:
    """Run one process per rank at once; fail naming what hung or what failed, with each failing rank's output.

    A rank killed by a signal is named by it (SIGABRT: abort(), e.g. an uncaught C++ exception, whose
    "terminate called ..." line and faulthandler stacks are in its output). Once a rank has failed the others
    get PEER_GRACE_S to fail too (a peer of a dead rank errors out of its next collective), then are killed;
    a rank about to be killed is first sent SIGUSR1, on which the rank workers print every thread's stack.
    Output goes to files, not pipes, so a rank never blocks on a full pipe and nothing is lost when one is killed.
    """
    import signal
    import subprocess
    import tempfile
    import time

    def describe(code: int | None) -> str:
        if code is None:
            return "killed by the test (still running)"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name} ({code})"
        return f"exit {code}"

    def excerpt(text: str, limit: int = 12000) -> str:
        # The head keeps a "terminate called ..." line that precedes a long stack dump; the tail keeps the end.
        if len(text) <= limit:
            return text
        return f"{text[: limit // 3]}\n[... {len(text) - limit} characters left out ...]\n{text[-2 * limit // 3:]}"

    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in commands]
        processes = [
            subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            for command, env, log in zip(commands, envs, logs)
        ]
        codes: list[int | None] = [None] * len(processes)
        deadline = time.monotonic() + RANK_TIMEOUT_S
        hung = False
        try:
            while any(c is None for c in codes):
                codes = [p.poll() for p in processes]
                if any(c not in (None, 0) for c in codes):
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                if time.monotonic() > deadline:
                    hung = all(c in (None, 0) for c in codes)
                    break
                time.sleep(0.1)
        finally:
            running = [p for p in processes if p.poll() is None]
            for p in running:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGUSR1)
            if running:
                time.sleep(2)  # let the stacks be written
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read().decode(errors="replace"))
    reports = [f"rank {rank} ({describe(code)}):\n{excerpt(out)}" for rank, (code, out) in enumerate(zip(codes, outputs))
               if code != 0]
    if hung:
        pytest.fail(f"a rank did not finish within {RANK_TIMEOUT_S} s (hung in a collective?):\n\n" + "\n\n".join(reports))
    assert not reports, "\n\n".join(reports)


STEP_RANK_WORKER = Path(__file__).resolve().parent / "runtime" / "step_rank_worker.py"


def run_step_ranks(tmp_path: Path, scenario: str, budget: int | str, world: int = 2) -> list:
    """`world` ranks of a gloo job running `runtime/step_rank_worker.py`'s `scenario` under `budget` (its
    argument as written), one thread each: what each rank saved."""
    import os

    store = tmp_path / "store"
    results = [tmp_path / f"result{rank}.pt" for rank in range(world)]
    commands = [[sys.executable, str(STEP_RANK_WORKER), str(rank), str(world), str(store), scenario, str(budget),
                 str(results[rank])] for rank in range(world)]
    run_rank_processes(commands, [os.environ | {"OMP_NUM_THREADS": "1"}] * world)
    return [torch.load(r) for r in results]


def load_benchmark(name: str):
    """The module of `benchmarks/<name>.py`, loaded as a script is (the folder is not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
