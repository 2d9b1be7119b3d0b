"""What the device can do: matmul FLOP/s per dtype, memory and host-link bandwidth, per-op fixed cost.

A plan is a pure function of (graph, options, hardware profile), so the profile is something a user can
see, pin and share (`profiles.resolve_profile`, the `hardware_profile` option, `dpcs hardware`):

- "measure" (the default): `measure_hardware_profile` times a few small benchmarks (median of repetitions
  after warm-up; matrix sizes grow until one call is long enough to time or a per-dtype time box runs out,
  so the whole measurement stays within a few seconds even where a dtype is emulated slowly), always on
  real tensors, outside any fake or tracing mode (a backend measures while Dynamo's fake mode is active).
  `measured_profile` measures once per device and caches the result on disk as JSON, keyed by device,
  format version and torch version, plus an in-process memo. A cached file that does not parse or
  describes another device, format or torch is re-measured and overwritten, never trusted.
- a built-in profile from datasheet figures (`cost/profiles.py`): plan on a laptop for the GPU
  the job will train on, or on the fixed reference CPU so a plan is the same on every machine;
- a profile JSON file (`dpcs hardware --json` writes one), or a `HardwareProfile` given in code.

Figures are measured under the process's current settings (thread count, which is part of the CPU key, and
torch's float32 matmul precision, which is not): pass `refresh=True` after changing the latter.

On a shared CPU, other processes competing for the cores slow multithreaded kernels by up to 1000x (threads
wait at barriers for descheduled siblings). The profile records the share of CPU time the process got while
a kernel that runs on every thread (`measure_cpu_share`: an elementwise op split over all of torch's
threads; not a matmul, which a BLAS may run on one thread at small sizes) ran, per CPU it may use (torch's
threads, the CPU affinity and the cgroup quota); a profile measured below `BUSY_CPU_SHARE` is used but not
written to disk, so a quieter process measures again instead of inheriting pessimistic figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import re
import statistics
import time
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dpcs_compiler.cost.budget import device_memory
from dpcs_compiler.files import write_text_atomic

log = logging.getLogger(__name__)

# 2: memory_bytes added; cpu_share measured on a kernel that runs on every thread (1 measured it on a matmul).
FORMAT_VERSION = 4  # 3: offload_ops_s; 4: matmul_table

BUSY_CPU_SHARE = 0.5  # a quiet CPU gives ~1 while a kernel runs on every thread; 2 competitors per CPU ~0.33

_CACHE_ENV = "DPCS_CACHE_DIR"

# torch._scaled_mm on CUDA needs the contraction and output widths of an fp8 matmul to be multiples of 16.
FP8_DIM_MULTIPLE = 16

# The matmul kinds a profile's `matmul_table` may time: a dtype's plain matmul, and fp8 scaled matmuls with
# one scale per tensor or per row (bf16 output). `cost/fp8.py` reads them.
FP8_TENSORWISE = "float8_e4m3fn"
FP8_ROWWISE = "float8_e4m3fn:rowwise"
# The (M, K, N) a CUDA profile times each kind at: the token counts of a step (M) by the widths of
# transformer linears, from a 1024-wide model's projections to an 8B model's FFN.
MATMUL_TABLE_SIZES = ((1024, 4096, 16384), (1024, 4096, 14336))


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Speeds of one device; all rates per second, `launch_overhead_s` the fixed cost of one op.

    matmul_flops maps torch dtype names ("float32", "bfloat16", ...) to FLOP/s; float32 is always present.
    host_to_device / device_to_host are pinned-memory copy bandwidths, None on CPU where there is no host link.
    measured_at: when it was measured (ISO 8601), or "datasheet" for a built-in profile.
    cpu_share: CPU time the process got / (wall time x usable CPUs) while a kernel ran on every thread
        (`measure_cpu_share`); None on CUDA and for built-in profiles.
    memory_bytes: the device's total memory (host RAM for a CPU), what a fractional or "auto" memory_budget
        is of when a graph is planned for this device from another kind of device; None if unknown.
    offload_ops_s: host seconds to issue the four ops that move one value out and back (`dpcs.offload`,
        `wait_offload`, `reload`, `wait_tensor`: Python custom ops with streams and events), measured on the
        device without waiting for it; None where not measured (CPU, built-in profiles): then
        `cost.op_time.offload_ops_seconds` gives a floor.
    matmul_table: measured matmul times by shape, per kind ("bfloat16", `FP8_TENSORWISE`, `FP8_ROWWISE`):
        (M, K, N, seconds) rows, an (M x K) @ (K x N) product each; None where not measured (CPU, datasheet
        profiles): then a matmul is costed at the kind's peak rate (`cost/fp8.py`).
    """

    device_key: str
    torch_version: str
    format_version: int
    matmul_flops: Mapping[str, float] = dataclasses.field(hash=False)
    memory_bandwidth: float
    host_to_device: float | None
    device_to_host: float | None
    launch_overhead_s: float
    measured_at: str
    cpu_share: float | None = None
    memory_bytes: int | None = None
    offload_ops_s: float | None = None
    matmul_table: Mapping[str, tuple[tuple[int, int, int, float], ...]] | None = dataclasses.field(
        default=None, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "matmul_flops", types.MappingProxyType(dict(self.matmul_flops)))
        if self.matmul_table is not None:
            object.__setattr__(self, "matmul_table", _checked_table(self.matmul_table))
        for name in ("device_key", "torch_version", "measured_at"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"hardware profile: {name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.format_version, int) or isinstance(self.format_version, bool):
            raise ValueError(f"hardware profile: format_version must be an int, got {self.format_version!r}")
        if "float32" not in self.matmul_flops:
            raise ValueError("hardware profile: matmul_flops needs a float32 figure (the fallback for other dtypes)")
        for dtype, rate in self.matmul_flops.items():
            if not isinstance(dtype, str):
                raise ValueError(f"hardware profile: matmul_flops keys are dtype names, got {dtype!r}")
            _check_rate(f"matmul_flops[{dtype!r}]", rate)
        _check_rate("memory_bandwidth", self.memory_bandwidth)
        for name in ("host_to_device", "device_to_host"):
            if getattr(self, name) is not None:
                _check_rate(name, getattr(self, name))
        if not _is_real(self.launch_overhead_s) or not 0 <= self.launch_overhead_s < math.inf:
            raise ValueError(
                f"hardware profile: launch_overhead_s must be finite and >= 0, got {self.launch_overhead_s!r}"
            )
        if self.cpu_share is not None and (not _is_real(self.cpu_share) or not 0 <= self.cpu_share < math.inf):
            raise ValueError(f"hardware profile: cpu_share must be None or finite and >= 0, got {self.cpu_share!r}")
        if self.offload_ops_s is not None and (
            not _is_real(self.offload_ops_s) or not 0 <= self.offload_ops_s < math.inf
        ):
            raise ValueError(
                f"hardware profile: offload_ops_s must be None or finite and >= 0, got {self.offload_ops_s!r}"
            )
        if self.memory_bytes is not None and (
            not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes <= 0
        ):
            raise ValueError(f"hardware profile: memory_bytes must be None or an int > 0, got {self.memory_bytes!r}")

    @property
    def device_type(self) -> str:
        """"cpu" or "cuda": the kind of device the figures describe (the device key's first part)."""
        return self.device_key.partition(":")[0]

    def short_hash(self) -> str:
        """12 hex digits of the profile's JSON: two plans made with one profile name the same hash."""
        return hashlib.sha256(profile_to_json(self).encode()).hexdigest()[:12]

    @property
    def busy(self) -> bool:
        """Whether other processes held the CPU while this was measured (its figures are then pessimistic)."""
        return self.cpu_share is not None and self.cpu_share < BUSY_CPU_SHARE

    def __reduce__(self):
        """Pickle and deepcopy through the constructor (a read-only mapping proxy cannot be pickled itself)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        table = None if self.matmul_table is None else dict(self.matmul_table)
        return _rebuild_profile, (fields | {"matmul_flops": dict(self.matmul_flops), "matmul_table": table},)


def _rebuild_profile(fields: dict[str, object]) -> HardwareProfile:
    return HardwareProfile(**fields)


def _checked_table(table: object) -> Mapping[str, tuple[tuple[int, int, int, float], ...]]:
    """A matmul table, validated, as a read-only mapping of tuples (rows from JSON come as lists)."""
    if not isinstance(table, Mapping):
        raise ValueError(f"hardware profile: matmul_table must be a mapping of kind to rows, got {table!r}")
    out = {}
    for kind, rows in table.items():
        if not isinstance(kind, str) or not isinstance(rows, (list, tuple)) or not rows:
            raise ValueError(f"hardware profile: matmul_table[{kind!r}] must be a non-empty list of "
                             f"[M, K, N, seconds] rows")
        checked = []
        for row in rows:
            if (not isinstance(row, (list, tuple)) or len(row) != 4
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in row[:3])):
                raise ValueError(f"hardware profile: matmul_table[{kind!r}] row {row!r} is not [M, K, N, seconds] "
                                 "with positive int sizes")
            _check_rate(f"matmul_table[{kind!r}] seconds", row[3])
            checked.append((row[0], row[1], row[2], float(row[3])))
        out[kind] = tuple(checked)
    return types.MappingProxyType(out)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rate(name: str, value: object) -> None:
    if not _is_real(value) or not 0 < value < math.inf:
        raise ValueError(f"hardware profile: {name} must be positive and finite, got {value!r}")


# ----------------------------------------------------------------------------------------------- JSON


def profile_to_json(profile: HardwareProfile) -> str:
    """The profile as a JSON object (the cache file's content)."""
    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}
    fields["matmul_flops"] = dict(profile.matmul_flops)
    if profile.matmul_table is not None:
        fields["matmul_table"] = {kind: [list(row) for row in rows] for kind, rows in profile.matmul_table.items()}
    return json.dumps(fields, indent=2, sort_keys=True)


def profile_from_json(text: str) -> HardwareProfile:
    """Parse `profile_to_json`'s output; ValueError for anything that is not a complete, valid profile."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"hardware profile: not JSON ({e})") from e
    names = {f.name for f in dataclasses.fields(HardwareProfile)}
    if isinstance(data, dict) and data.get("format_version") == 2 and "offload_ops_s" not in data:
        # Format 2 lacked the offload ops' time: a file pinned then (perhaps measured on a GPU not here) is
        # read with it unmeasured, which costs the ops at the floor (`cost.op_time.offload_ops_seconds`).
        data = {**data, "format_version": 3, "offload_ops_s": None}
    if isinstance(data, dict) and data.get("format_version") == 3 and "matmul_table" not in data:
        # Format 3 lacked the matmul table: matmuls are costed at the peak rates, as for a datasheet profile.
        data = {**data, "format_version": FORMAT_VERSION, "matmul_table": None}
    if isinstance(data, dict) and data.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise ValueError(f"hardware profile: format {data['format_version']!r}, this dpcs reads format {FORMAT_VERSION}")
    if not isinstance(data, dict) or set(data) != names:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"hardware profile: expected the fields {sorted(names)}, got {got}")
    if not isinstance(data["matmul_flops"], dict):
        raise ValueError(f"hardware profile: matmul_flops must be an object, got {data['matmul_flops']!r}")
    return HardwareProfile(**data)


# ----------------------------------------------------------------------------------------------- devices


def _resolve_device(device: torch.device | str) -> torch.device:
    """A concrete cpu or cuda:<index> device; ValueError naming the value for anything else."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"not a device: {device!r} ({e})") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available in this process")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"device {device!r}: no such CUDA device (count {torch.cuda.device_count()})")
        return torch.device("cuda", index)
    raise ValueError(f"device {device!r}: only cpu and cuda devices have a hardware profile")


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_key(device: torch.device | str) -> str:
    """Normalized identity of the hardware: "cpu:<model>:<threads>" or "cuda:<name>:<major.minor>"."""
    dev = _resolve_device(device)
    if dev.type == "cpu":
        name, detail = _cpu_model_name(), str(torch.get_num_threads())
    else:
        name = torch.cuda.get_device_name(dev)
        detail = "{}.{}".format(*torch.cuda.get_device_capability(dev))
    return f"{dev.type}:{' '.join(name.split())}:{detail}"


# ----------------------------------------------------------------------------------------------- measuring


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Benchmark sizes for one device type, chosen so the whole measurement takes a few seconds."""

    matmul_start: int  # first square size tried
    matmul_max: int  # largest square size tried
    matmul_target_s: float  # a matmul this long is timed reliably: stop growing
    matmul_budget_s: float  # time box per dtype
    copy_bytes: int  # per buffer; well beyond the caches
    transfer_bytes: int
    min_batch_s: float  # calls are repeated between clock reads until a batch lasts this long
    repeats: int = 5


_PLANS = {
    "cpu": _Plan(128, 4096, 0.02, 0.6, 256 << 20, 0, 1e-3),
    # CUDA: about 1.5 GiB of device memory at most (three 8192^2 float32 matrices), as a profile is often
    # measured at compile time with the model already resident; 256 MiB is well beyond any L2.
    "cuda": _Plan(1024, 8192, 2e-3, 1.0, 256 << 20, 128 << 20, 2e-3),
}


def _median_seconds(fn: Callable[[], object], sync: Callable[[], None], plan: _Plan) -> float:
    """Median seconds of one call to `fn`: two warm-up calls, then `plan.repeats` timed batches."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    estimate = time.perf_counter() - start
    inner = max(1, min(10_000, math.ceil(plan.min_batch_s / max(estimate, 1e-9))))
    times = []
    for _ in range(plan.repeats):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _matmul_flops(device: torch.device, dtype: torch.dtype, sync: Callable[[], None], plan: _Plan) -> float:
    """FLOP/s of square matmuls, sizes growing until one call is long enough to time.

    The rate is the best over the sizes tried: a larger size only runs faster when undisturbed, so the best
    is the least disturbed. Growth stops early when the next size would overrun the per-dtype time box.
    """
    deadline = time.perf_counter() + plan.matmul_budget_s
    n, best = plan.matmul_start, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _median_seconds(lambda: torch.mm(a, b), sync, plan)
        best = max(best, 2 * n**3 / seconds)
        next_cost = 8 * max(seconds, plan.min_batch_s) * (plan.repeats + 2)
        if seconds >= plan.matmul_target_s or 2 * n > plan.matmul_max or time.perf_counter() + next_cost > deadline:
            return best


def usable_cpus() -> float:
    """How many CPUs this process's threads can run on at once: torch's thread count, bounded by the CPU
    affinity mask and by a cgroup CPU quota (a container limited to 2 CPUs of a 64-core host)."""
    limits = [float(torch.get_num_threads())]
    if hasattr(os, "sched_getaffinity"):
        limits.append(float(len(os.sched_getaffinity(0))))
    for path, parse in (("/sys/fs/cgroup/cpu.max", _cgroup2_quota), ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", _cgroup1_quota)):
        try:
            quota = parse(Path(path))
        except (OSError, ValueError):
            continue
        if quota is not None:
            limits.append(quota)
            break
    return max(1.0, min(limits))


def _cgroup2_quota(path: Path) -> float | None:
    """cgroup v2's cpu.max: "max 100000" (no limit) or "<quota> <period>" in microseconds."""
    fields = path.read_text().split()
    if not fields or fields[0] == "max":
        return None
    return int(fields[0]) / (int(fields[1]) if len(fields) > 1 else 100_000)


def _cgroup1_quota(path: Path) -> float | None:
    quota = int(path.read_text())
    period = int((path.parent / "cpu.cfs_period_us").read_text())
    return None if quota <= 0 else quota / period


@contextlib.contextmanager
def _plain_dispatch() -> Iterator[None]:
    """Real tensors and kernels, dispatched as in eager code, whatever mode the caller runs under.

    A backend plans inside AOTAutograd's partitioner: under Dynamo's fake mode a matmul returns at once
    (the profile read 1.1e15 FLOP/s on a 2-core CPU), and the Python dispatcher left on there makes a
    1-element add cost 3.9 us instead of 1.2 us.
    """
    python_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.PythonTLSSnapshot
    )
    with _disable_current_modes(), torch._C._DisablePythonDispatcher(), torch._C._ExcludeDispatchKeyGuard(python_keys):
        yield


def measure_cpu_share(seconds: float = 0.1) -> float:
    """Share of the CPUs this process may use that it got while a kernel ran on every one of torch's threads.

    The kernel is an elementwise sine over 16 MiB, which ATen splits over all its threads whatever the CPU
    (a matmul is not: a BLAS runs small matrices on one thread, and that read as "half the CPU taken by
    others" on an idle 2-core machine). An idle machine gives ~1; other processes competing for the cores
    deschedule the threads and lower it (2 busy processes per CPU: ~0.33).
    """
    with _plain_dispatch(), torch.no_grad():
        x = torch.randn(1 << 22)
        out = torch.empty_like(x)
        torch.sin(x, out=out)  # warm-up: the thread pool starts
        wall, cpu = time.perf_counter(), time.process_time()
        calls = 0
        while calls < 3 or time.perf_counter() - wall < seconds:
            torch.sin(x, out=out)
            calls += 1
        elapsed = time.perf_counter() - wall
        return (time.process_time() - cpu) / (elapsed * usable_cpus())


def _float8_flops(device: torch.device, sync: Callable[[], None], plan: _Plan) -> float | None:
    """FLOP/s of torch._scaled_mm in float8_e4m3fn on CUDA, or None where it does not run."""
    try:
        n = plan.matmul_max
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm needs
        one = torch.ones((), device=device, dtype=torch.float32)
        seconds = _median_seconds(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), sync, plan)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError) as e:
        log.info("float8 matmul not measured on %s: %s", device, e)
        return None
    return 2 * n**3 / seconds


MatmulMaker = Callable[[int, int, int], Callable[[], object]]


def measure_matmul_table(makers: Mapping[str, MatmulMaker], sizes: tuple[tuple[int, ...], tuple[int, ...]],
                         sync: Callable[[], None], plan: _Plan, budget_s: float) -> dict[str, list[list[float]]]:
    """Seconds of each kind's matmul at every (M, K, N) of `sizes` (Ms, widths: K and N both from the widths):
    `makers[kind](m, k, n)` makes the operands and returns the call to time. A kind whose maker or call
    raises at a shape is dropped (the device does not run it); shapes left when `budget_s` runs out are
    not timed (each kind keeps what it has)."""
    deadline = time.perf_counter() + budget_s
    table: dict[str, list[list[float]]] = {}
    for kind, make in makers.items():
        rows = []
        try:
            for m in sizes[0]:
                for k in sizes[1]:
                    for n in sizes[1]:
                        if time.perf_counter() > deadline:
                            break
                        call = make(m, k, n)
                        rows.append([m, k, n, _median_seconds(call, sync, plan)])
                        del call
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as e:
            log.info("%s matmuls not timed: %s", kind, e)
            continue
        if rows:
            table[kind] = rows
    return table


def _cuda_matmul_makers(device: torch.device) -> dict[str, MatmulMaker]:
    """bf16 matmuls and fp8 scaled matmuls (tensorwise and rowwise scales, bf16 output) on a CUDA device."""

    def operands(m: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16).to(dtype)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16).to(dtype).t()  # column-major, as _scaled_mm needs
        return a, b

    def bf16(m: int, k: int, n: int) -> Callable[[], object]:
        a, b = operands(m, k, n, torch.bfloat16)
        return lambda: torch.mm(a, b)

    def fp8(rowwise: bool) -> MatmulMaker:
        def make(m: int, k: int, n: int) -> Callable[[], object]:
            a, b = operands(m, k, n, torch.float8_e4m3fn)
            shapes = ((m, 1), (1, n)) if rowwise else ((), ())
            sa, sb = (torch.ones(shape, device=device, dtype=torch.float32) for shape in shapes)
            return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        return make

    return {"bfloat16": bf16, FP8_TENSORWISE: fp8(False), FP8_ROWWISE: fp8(True)}


def measure_hardware_profile(device: torch.device | str) -> HardwareProfile:
    """Measure the device now (a few seconds): matmul FLOP/s per dtype, copy bandwidths, fixed per-op cost."""
    dev = _resolve_device(device)
    plan = _PLANS[dev.type]
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    with _plain_dispatch(), torch.no_grad(), (torch.cuda.device(dev) if cuda else contextlib.nullcontext()):
        shares = [] if cuda else [measure_cpu_share()]
        flops = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            flops[str(dtype).removeprefix("torch.")] = _matmul_flops(dev, dtype, sync, plan)
        if cuda and (rate := _float8_flops(dev, sync, plan)) is not None:
            flops["float8_e4m3fn"] = rate
        # By shape, for the fp8 choice (`cost/fp8.py`): where a GPU's rates fall below its peaks matters.
        table = (measure_matmul_table(_cuda_matmul_makers(dev), MATMUL_TABLE_SIZES, sync, plan, budget_s=8.0) or None
                 if cuda else None)

        src = torch.ones(plan.copy_bytes // 4, device=dev)
        dst = torch.empty_like(src)
        memory_bandwidth = 2 * src.nbytes / _median_seconds(lambda: dst.copy_(src), sync, plan)  # read + write
        del src, dst

        h2d = d2h = None
        if cuda:
            host = torch.ones(plan.transfer_bytes, dtype=torch.uint8, pin_memory=True)
            on_device = torch.empty(plan.transfer_bytes, dtype=torch.uint8, device=dev)
            h2d = host.nbytes / _median_seconds(lambda: on_device.copy_(host, non_blocking=True), sync, plan)
            d2h = host.nbytes / _median_seconds(lambda: host.copy_(on_device, non_blocking=True), sync, plan)
            del host, on_device

        tiny = torch.ones(1, device=dev)
        launch = _median_seconds(lambda: torch.add(tiny, tiny), sync, plan)
        offload_ops = _offload_ops_timer(dev, sync) if cuda and _offload_ops_timer is not None else None
        if cuda:  # the buffers measured with (about 1.3 GB) go back to the device, not into the allocator's cache
            del tiny
            torch.cuda.empty_cache()
        if not cuda:
            # Competing processes hold the CPU for a while: the less disturbed of two readings, one before and
            # one after the benchmarks, keeps a passing burst from marking an idle machine busy.
            shares.append(measure_cpu_share())

    return HardwareProfile(
        device_key=device_key(dev),
        torch_version=torch.__version__,
        format_version=FORMAT_VERSION,
        matmul_flops=flops,
        memory_bandwidth=memory_bandwidth,
        host_to_device=h2d,
        device_to_host=d2h,
        launch_overhead_s=launch,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        cpu_share=None if cuda else max(shares),
        memory_bytes=device_memory(dev).total_bytes,
        offload_ops_s=offload_ops,
        matmul_table=table,
    )


# The host time of one offloaded value's ops (`ops.offload_ops.host_seconds_per_value`), registered by that
# module when it is imported (this layer does not import the ops): the backend, the runtime and `dpcs hardware`
# import it before they measure. A CUDA profile measured without it leaves `offload_ops_s` unmeasured.
_offload_ops_timer: Callable[[torch.device, Callable[[], None]], float] | None = None


def register_offload_ops_timer(timer: Callable[[torch.device, Callable[[], None]], float]) -> None:
    """How `measure_hardware_profile` times the offload ops on a CUDA device: timer(device, sync) -> seconds."""
    global _offload_ops_timer
    _offload_ops_timer = timer


# ----------------------------------------------------------------------------------------------- cache

_MEMO: dict[tuple[str, str], ResolvedProfile] = {}


def default_cache_dir() -> Path:
    """`$DPCS_CACHE_DIR/hardware` when the variable is set, else `~/.cache/dpcs/hardware`."""
    root = os.environ.get(_CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "dpcs") / "hardware"


def cache_path(key: str, cache_dir: Path) -> Path:
    """The cache file for one device key under this format and torch version (readable name plus a hash)."""
    identity = f"{key}|{FORMAT_VERSION}|{torch.__version__}"
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", f"{key}-f{FORMAT_VERSION}-torch{torch.__version__}").strip("_")
    return cache_dir / f"{slug[:150]}-{hashlib.sha256(identity.encode()).hexdigest()[:10]}.json"


def forget_memoized_profiles() -> None:
    """Drop the in-process memo, so the next `measured_profile` call reads the disk cache again."""
    _MEMO.clear()


def _load(path: Path, key: str) -> HardwareProfile | None:
    """The cached profile at `path` if it is valid and describes this device, format and torch; else None."""
    try:
        profile = profile_from_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("re-measuring: unusable hardware profile cache %s (%s)", path, e)
        return None
    found = (profile.device_key, profile.format_version, profile.torch_version)
    if found != (key, FORMAT_VERSION, torch.__version__):
        log.warning("re-measuring: hardware profile cache %s describes %s, not %s", path, found,
                    (key, FORMAT_VERSION, torch.__version__))
        return None
    return profile


def _store(path: Path, profile: HardwareProfile) -> bool:
    """Write atomically (temporary file, then rename); a cache that cannot be written is only logged (False)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, profile_to_json(profile))
    except OSError as e:
        log.warning("hardware profile not cached at %s: %s", path, e)
        return False
    return True


@dataclasses.dataclass(frozen=True)
class ResolvedProfile:
    """A hardware profile and where it came from (`source`, a phrase: "built-in 'h100' (...)", "file ...")."""

    profile: HardwareProfile
    source: str

    @property
    def hash(self) -> str:
        return self.profile.short_hash()

    def describe(self) -> str:
        """Where the profile came from and its short hash, as records, dumps and `dpcs hardware` name it."""
        return f"{self.source} #{self.hash}"


def measured_profile(
    device: torch.device | str, *, cache_dir: str | os.PathLike[str] | None = None, refresh: bool = False
) -> ResolvedProfile:
    """The device's measured profile: from the in-process memo, else the disk cache, else measured now and cached.

    refresh=True measures again and overwrites the cache. A profile measured on a busy CPU is memoized only.
    """
    key = device_key(device)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    memo_key = (str(directory.resolve()), key)
    if not refresh and memo_key in _MEMO:
        return _MEMO[memo_key]
    path = cache_path(key, directory)
    profile = None if refresh else _load(path, key)
    source = f"cached at {path}"
    if profile is None:
        profile = measure_hardware_profile(device)
        if profile.device_key != key:
            raise RuntimeError(f"measured profile is for {profile.device_key!r}, expected {key!r}")
        if profile.busy:
            log.warning(
                "%s was busy while its hardware profile was measured: other processes held the CPU (CPU share "
                "%.2f of %g usable CPUs). The profile is used in this process but not cached, so plans may differ "
                "from run to run; measure on a quiet machine (`dpcs hardware --refresh`) or pin a profile "
                "(option hardware_profile, or DPCS_HARDWARE_PROFILE: 'reference-cpu' or a profile file)",
                key, profile.cpu_share, usable_cpus(),
            )
            source = f"on a busy CPU (CPU share {profile.cpu_share:.2f}), not cached"
        elif not _store(path, profile):
            source = f"not cached (cannot write {path})"
    resolved = ResolvedProfile(profile, f"measured {profile.measured_at}, {source}")
    _MEMO[memo_key] = resolved
    return resolved
