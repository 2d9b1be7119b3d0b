"""Signals, collected cheaply: device values accumulate on the device every step and are read every N steps.

Per step (`SignalCollector.collect`), device ops only, no host sync:
- gradient norms per region: one `_foreach_norm` over the gradients per device, squared and summed per
  region with one `index_add_`; a region whose sum is not finite overflowed;
- running mean and variance (EMAs) of the global gradient norm and of the loss, and the largest deviation
  from them over the interval in running standard deviations, at least 5% of the mean (a spike), after a
  warm-up;
- AMP overflow: GradScaler's scale dropped since the last step (it backs off on inf/NaN), the dpcs overflow
  flag of the compiled backward (`ops/overflow.py`, read and reset), or a non-finite gradient norm.

Every `every` steps the accumulators are stacked into one small tensor and copied to the host: on an
accelerator without blocking (pinned buffer and an event, read at the next step: the decision lags one
step), on the CPU at once. Memory headroom is read on the host at the same time: CUDA `mem_get_info` and
the allocator's peak since the last read (`torch.cuda.reset_peak_memory_stats` is called per read); CPU the
memory the system can still give (MemAvailable, within the cgroup limit) against its total, and the
process's peak RSS.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dpcs_compiler.ops.overflow import take_overflow
from dpcs_compiler.runtime.policies import Signals

# Deviations are measured in running standard deviations, never smaller than this fraction of the mean.
RELATIVE_SPREAD = 0.05

# Fields of a read's vector after the per-region overflow flags (one more slot: parameters in no region), and
# how ranks combine each (`reduce_rule`). The last three are the host's; -1 stands for "not known".
FIELDS = ("overflow", "grad_norm", "grad_norm_z", "loss", "loss_z", "steps", "headroom", "peak_bytes", "oom")
_RULES = {"overflow": "max", "grad_norm": "mean", "grad_norm_z": "max", "loss": "mean", "loss_z": "max",
          "steps": "max", "headroom": "min", "peak_bytes": "max", "oom": "max"}


def reduce_rule(regions: int) -> list[str]:
    """How ranks combine each slot of a read's vector: any overflow, the mean statistics, the largest
    deviation, the least headroom, the largest peak."""
    return ["max"] * (regions + 1) + [_RULES[f] for f in FIELDS]


def host_headroom(device: torch.device) -> tuple[float | None, int | None]:
    """(free fraction of the device's memory at its peak since the last read, that peak in bytes)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return max(0.0, (free + reserved - peak) / total), int(peak)
    if device.type == "cpu":
        available, total = _cpu_available_memory()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return (available / total if total else None), int(peak)
    return None, None


def _cpu_available_memory() -> tuple[int, int]:
    """(bytes the system can still give this process, its total), the cgroup v2 limit applied."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info[key] = int(value.split()[0]) * 1024
    available, total = info.get("MemAvailable", 0), info.get("MemTotal", 0)
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            total = min(total, int(limit))
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available, total


@dataclasses.dataclass
class _Moments:
    """Running mean and mean square of a scalar on the device, and the largest deviation over the interval."""

    mean: torch.Tensor
    square: torch.Tensor
    max_z: torch.Tensor
    last: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> _Moments:
        return cls(*(torch.zeros((), dtype=torch.float32, device=device) for _ in range(4)))

    def update(self, value: torch.Tensor, count: torch.Tensor, decay: float, warmup: int) -> None:
        """Fold one value in (non-finite values are skipped); device ops only."""
        value = value.detach().float()
        finite = torch.isfinite(value)
        # The spread never counts as less than RELATIVE_SPREAD of the mean: a slow trend (a loss that falls
        # steadily) has a tiny variance and would otherwise read as a spike at every step.
        std = torch.maximum((self.square - self.mean * self.mean).clamp_min(0).sqrt(), RELATIVE_SPREAD * self.mean.abs())
        std = std.clamp_min(1e-12)
        z = torch.where(finite & (count >= warmup), (value - self.mean).abs() / std, torch.zeros_like(value))
        torch.maximum(self.max_z, z, out=self.max_z)
        # The first value sets the averages; later ones decay into them.
        weight = torch.where(count == 0, torch.ones_like(value), torch.full_like(value, 1 - decay))
        safe = torch.where(finite, value, self.mean)
        self.mean.add_(weight * (safe - self.mean))
        self.square.add_(weight * (safe * safe - self.square))
        self.last.copy_(value)

    def state(self) -> list[float]:
        return [float(t) for t in (self.mean, self.square)]

    def load(self, values: Sequence[float]) -> None:
        self.mean.fill_(values[0])
        self.square.fill_(values[1])


class SignalCollector:
    """Accumulates a model's signals on its device and hands the runtime one `Signals` snapshot per read.

    regions: region name -> its parameters (a parameter in no region counts in the global norm only).
    every: steps per read. decay: EMA decay of the running statistics. warmup: steps before deviations count.
    """

    def __init__(
        self,
        regions: Mapping[str, Sequence[torch.nn.Parameter]],
        parameters: Sequence[torch.nn.Parameter],
        *,
        every: int,
        decay: float = 0.98,
        warmup: int = 20,
        watch_overflow_flag: Callable[[], bool] = lambda: False,
    ) -> None:
        self.region_names = tuple(regions)
        self.parameters = list(parameters)
        self.device = self.parameters[0].device if self.parameters else torch.device("cpu")
        region_of = {id(p): i for i, params in enumerate(regions.values()) for p in params}
        # Parameters in no region sum into an extra slot past the named ones.
        self.slot = {id(p): region_of.get(id(p), len(self.region_names)) for p in self.parameters}
        self.every, self.decay, self.warmup = every, decay, warmup
        self.watch_overflow_flag = watch_overflow_flag
        self._index_cache: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)
        self.grad = _Moments.zeros(self.device)
        self.loss = _Moments.zeros(self.device)
        self._previous_scale: torch.Tensor | None = None
        self._reset_interval()
        self._pending: tuple[torch.Tensor, Any, float | None, int | None] | None = None
        self.collect_seconds = 0.0  # host time spent in collect(), for the overhead figure

    def _reset_interval(self) -> None:
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=self.device)  # noqa: E731
        self.overflow = zeros()
        self.region_overflow = zeros(len(self.region_names) + 1)
        self.steps_in_interval = zeros()
        self.grad.max_z.zero_()
        self.loss.max_z.zero_()

    def _region_index(self, grads_ids: tuple[int, ...]) -> torch.Tensor:
        if self._index_cache is None or self._index_cache[0] != grads_ids:
            index = torch.tensor([self.slot[i] for i in grads_ids], dtype=torch.int64, device=self.device)
            self._index_cache = (grads_ids, index)
        return self._index_cache[1]

    def collect(self, *, loss: torch.Tensor | None, scaler: Any | None) -> None:
        """Fold one step's values in; device ops only."""
        start = time.perf_counter()
        with torch.no_grad():
            params = [p for p in self.parameters if p.grad is not None]
            if params:
                by_device: dict[torch.device, list[torch.nn.Parameter]] = {}
                for p in params:
                    by_device.setdefault(p.grad.device, []).append(p)
                norms = [
                    n.to(self.device, torch.float32)
                    for group in by_device.values()
                    for n in torch._foreach_norm([p.grad for p in group])
                ]
                ordered = [p for group in by_device.values() for p in group]
                squares = torch.stack(norms).square()
                per_region = torch.zeros(len(self.region_names) + 1, dtype=torch.float32, device=self.device)
                per_region.index_add_(0, self._region_index(tuple(id(p) for p in ordered)), squares)
                self.region_overflow.logical_or_(~torch.isfinite(per_region))
                total = per_region.sum().sqrt()
                self.overflow.logical_or_(~torch.isfinite(total))
                self.grad.update(total, self.count, self.decay, self.warmup)
            if loss is not None:
                self.loss.update(loss.detach().reshape(()), self.count, self.decay, self.warmup)
            if scaler is not None and getattr(scaler, "is_enabled", lambda: False)() and getattr(scaler, "_scale", None) is not None:
                scale = scaler._scale
                if self._previous_scale is not None and self._previous_scale.device == scale.device:
                    self.overflow.logical_or_((scale < self._previous_scale).to(self.device))
                self._previous_scale = scale.detach().clone()
            if self.watch_overflow_flag():
                self.overflow.logical_or_(take_overflow(self.device).to(self.device))
            self.count.add_(1)
            self.steps_in_interval.add_(1)
        self.collect_seconds += time.perf_counter() - start

    def launch_read(self) -> None:
        """Start copying the interval's values to the host and begin a new interval (no sync on accelerators)."""
        vector = torch.cat([
            self.region_overflow,
            torch.stack([self.overflow, self.grad.last, self.grad.max_z, self.loss.last, self.loss.max_z, self.steps_in_interval]),
        ])
        headroom, peak = host_headroom(self.device)
        if self.device.type == "cpu":
            host, event = vector.clone(), None
        else:
            host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            host.copy_(vector, non_blocking=True)
            event = torch.Event(self.device.type) if hasattr(torch, "Event") else torch.cuda.Event()
            event.record()
        self._pending = (host, event, headroom, peak)
        self._reset_interval()

    @property
    def lag(self) -> int:
        """Steps between launching a read and taking its snapshot: 0 on the CPU, 1 on an accelerator."""
        return 0 if self.device.type == "cpu" else 1

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def take_read(self, *, oom: bool = False) -> list[float]:
        """The launched read's vector (waits for its copy: by now long done), host values appended."""
        assert self._pending is not None, "take_read without launch_read"
        host, event, headroom, peak = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        unknown = lambda v: -1.0 if v is None else float(v)  # noqa: E731
        return host.tolist() + [unknown(headroom), unknown(peak), float(oom)]

    def snapshot_from(self, values: Sequence[float], step: int) -> Signals:
        """The `Signals` of a read's vector (this rank's, or every rank's combined)."""
        regions = len(self.region_names)
        named = dict(zip(FIELDS, values[regions + 1:]))
        steps = int(named["steps"])
        measured = lambda v: v if steps and math.isfinite(v) else None  # noqa: E731
        flags = [bool(v) for v in values[: regions + 1]]
        # Regions name an overflow's place only when it is confined: not everywhere, not outside every region.
        confined = not flags[regions] and not all(flags[:regions])
        return Signals(
            step=step,
            steps=max(steps, 1),
            overflow=bool(named["overflow"]) or any(flags),
            overflow_regions=tuple(name for name, flag in zip(self.region_names, flags) if flag) if confined else (),
            grad_norm=measured(named["grad_norm"]),
            grad_norm_z=measured(named["grad_norm_z"]),
            loss=measured(named["loss"]),
            loss_z=measured(named["loss_z"]),
            headroom=None if named["headroom"] < 0 else named["headroom"],
            peak_bytes=None if named["peak_bytes"] < 0 else int(named["peak_bytes"]),
            oom=bool(named["oom"]),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"count": int(self.count), "grad": self.grad.state(), "loss": self.loss.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count.fill_(state["count"])
        self.grad.load(state["grad"])
        self.loss.load(state["loss"])
