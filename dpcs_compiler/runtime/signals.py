"""Signals, collected cheaply: each step writes a few values into a ring buffer on the device; every N steps
the buffer is read in one copy and the statistics are computed on the host.

Per step (`SignalCollector.collect`), three device ops and no host sync:
- gradient norms: one `_foreach_norm` over the gradients (per device), stacked into the step's row of the
  ring (the host sums their squares per region at the read; a region with a non-finite sum overflowed);
- the loss (not finite: an overflow), GradScaler's scale and the dpcs overflow flag of the compiled
  backward (`ops/overflow.py`, read and reset), each copied into the step's row. A step after which the
  scale dropped is one GradScaler skipped and handled (dynamic loss scaling backs off now and then by
  design): it counts as a back-off (`Signals.scaler_backoffs`, `Signals.scale`), not as an overflow.

Every `every` steps the ring is copied to the host: on an accelerator without blocking (pinned buffer and
an event, read at the next step: the decision lags one step), on the CPU at once. The host then runs the
running statistics (`Moments`: EMAs of the global gradient norm and of the loss, and the largest deviation
from them in running standard deviations, a spike) over the interval's steps, in order. Memory headroom is
read on the host at the same time: CUDA `mem_get_info` and the most the caching allocator reserved since the
last read, from its counters (`ReservedReadings`; its peak statistics are the user's and never reset); CPU
the memory the system can still give (MemAvailable, within the cgroup limit) against its total, and the
process's peak RSS.
"""

from __future__ import annotations

import dataclasses
import math
import re
import resource
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dpcs_compiler.ops.overflow import overflow_flag, reset_overflow
from dpcs_compiler.runtime.policies import Signals

# Deviations are measured in running standard deviations, never smaller than this fraction of the mean.
RELATIVE_SPREAD = 0.05

# Fields of a read's vector after the per-region overflow flags (one more slot: parameters in no region), and
# how ranks combine each (`reduce_rule`); -1 stands for "not known".
FIELDS = ("overflow", "grad_norm", "grad_norm_z", "loss", "loss_z", "steps", "headroom", "peak_bytes", "oom",
          "curvature", "curvature_ratio", "scaler_backoffs", "scale")
_RULES = {"overflow": "max", "grad_norm": "mean", "grad_norm_z": "max", "loss": "mean", "loss_z": "max",
          "steps": "max", "headroom": "min", "peak_bytes": "max", "oom": "max", "curvature": "mean",
          "curvature_ratio": "max", "scaler_backoffs": "max", "scale": "min"}


def reduce_rule(regions: int) -> list[str]:
    """How ranks combine each slot of a read's vector: any overflow, the mean statistics, the largest
    deviation, the least headroom, the largest peak."""
    return ["max"] * (regions + 1) + [_RULES[f] for f in FIELDS]


class ReservedReadings:
    """The most the caching allocator reserved between two reads, from its counters alone: reserved bytes
    only fall when it gives memory back (`reserved_bytes.all.freed` grows), so with nothing given back the
    level now is the peak since the last read; with some given back the peak is at most the level then plus
    what was reserved since (`reserved_bytes.all.allocated`), which is what is read (never under the truth)."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int, int]] = {}  # device index -> (reserved, allocated, freed) counters

    def peak_since_last(self, device: torch.device) -> int:
        stats = torch.cuda.memory_stats(device)
        now = (int(stats.get("reserved_bytes.all.current", 0)), int(stats.get("reserved_bytes.all.allocated", 0)),
               int(stats.get("reserved_bytes.all.freed", 0)))
        index = device.index if device.index is not None else torch.cuda.current_device()
        before, self.last[index] = self.last.get(index), now
        if before is None or now[2] == before[2]:
            return now[0]
        return max(now[0], before[0] + (now[1] - before[1]))


_RESERVED = ReservedReadings()


def host_headroom(device: torch.device) -> tuple[float | None, int | None]:
    """(free fraction of the device's memory at its peak since the last read, that peak in bytes). CUDA: the
    peak is what the caching allocator reserved, which is what runs out."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        peak = _RESERVED.peak_since_last(device)
        return max(0.0, (free + reserved - peak) / total), int(peak)
    if device.type == "cpu":
        available, total = _cpu_available_memory()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return (available / total if total else None), int(peak)
    return None, None


_CGROUP = Path("/sys/fs/cgroup")
_CGROUP_LIMITED: bool | None = None  # whether a cgroup v2 memory limit applies (read once)


def _cpu_available_memory() -> tuple[int, int]:
    """(bytes the system can still give this process, its total), the cgroup v2 limit applied."""
    global _CGROUP_LIMITED
    with open("/proc/meminfo", "rb") as meminfo:
        text = meminfo.read(4096)
    total = int(re.search(rb"MemTotal:\s+(\d+)", text).group(1)) * 1024
    match = re.search(rb"MemAvailable:\s+(\d+)", text)
    available = int(match.group(1)) * 1024 if match else 0
    if _CGROUP_LIMITED is not False:
        try:
            limit = (_CGROUP / "memory.max").read_text().strip()
            _CGROUP_LIMITED = limit != "max"
            if _CGROUP_LIMITED:
                used = int((_CGROUP / "memory.current").read_text())
                total = min(total, int(limit))
                available = min(available, max(0, int(limit) - used))
        except (OSError, ValueError):
            _CGROUP_LIMITED = False
    return available, total


@dataclasses.dataclass
class Moments:
    """Running mean and mean square of a scalar (EMAs, host floats), and the largest deviation of a value from
    them, in running standard deviations, since `reset_max`."""

    decay: float
    warmup: int
    mean: float = 0.0
    square: float = 0.0
    count: int = 0
    max_z: float = 0.0
    last: float | None = None

    def update(self, value: float) -> None:
        """Fold one value in; a non-finite one is skipped (it is an overflow, not a statistic)."""
        self.last = value
        if not math.isfinite(value):
            return
        if self.count >= self.warmup:
            # The spread never counts as less than RELATIVE_SPREAD of the mean: a slow trend (a loss that
            # falls steadily) has a tiny variance and would otherwise read as a spike at every step.
            spread = max(math.sqrt(max(self.square - self.mean**2, 0.0)), RELATIVE_SPREAD * abs(self.mean), 1e-12)
            self.max_z = max(self.max_z, abs(value - self.mean) / spread)
        weight = 1.0 if self.count == 0 else 1.0 - self.decay  # the first value sets the averages
        self.mean += weight * (value - self.mean)
        self.square += weight * (value * value - self.square)
        self.count += 1

    def reset_max(self) -> None:
        self.max_z = 0.0

    def state(self) -> list[float]:
        return [self.mean, self.square, self.count]

    def load(self, values: Sequence[float]) -> None:
        self.mean, self.square, self.count = float(values[0]), float(values[1]), int(values[2])


class SignalCollector:
    """Collects a model's signals on its device and hands the runtime one vector per read (`FIELDS`).

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
        self.every = every
        self.grad = Moments(decay, warmup)
        self.loss = Moments(decay, warmup)
        self.watch_overflow_flag = watch_overflow_flag
        # Parameters grouped by device (one _foreach_norm each); float32 on one device needs no conversion.
        devices = list(dict.fromkeys(p.device for p in self.parameters))
        self.by_device = [[p for p in self.parameters if p.device == d] for d in devices]
        self.ordered = [p for group in self.by_device for p in group]
        self.column = {id(p): j for j, p in enumerate(self.ordered)}
        self.column_slot = [self.slot[id(p)] for p in self.ordered]
        self.plain = len(devices) <= 1 and all(p.dtype == torch.float32 for p in self.parameters)
        # One row per step of the interval: each gradient's norm (in `ordered` order), then the loss,
        # GradScaler's scale and the overflow flag. Per-region sums are the host's work, at the read.
        self.width = len(self.region_names) + 1
        self.norms = len(self.ordered)
        self.ring = torch.zeros(every, self.norms + 3, dtype=torch.float32, device=self.device)
        self.row_views = [(r[: self.norms], r[self.norms], r[self.norms + 1], r[self.norms + 2]) for r in self.ring]
        self.rows: list[dict[str, bool]] = []  # per written row: which values it holds (host bookkeeping)
        self.previous_scale: float | None = None
        self._pending: tuple[torch.Tensor, Any, list[dict[str, bool]], float | None, int | None] | None = None

    def collect(self, *, loss: torch.Tensor | None, scaler: Any | None, gradients: bool = True) -> None:
        """Write one step's values into the ring; device ops only. `gradients` False skips the gradient norms
        (the one pass over every gradient, most of a step's cost) for this step."""
        if len(self.rows) >= self.every:
            raise RuntimeError("SignalCollector: the ring is full; launch_read() every `every` steps")
        norm_slots, loss_slot, scale_slot, flag_slot = self.row_views[len(self.rows)]
        written = {"grads": False, "loss": False, "scale": False, "flag": False}
        with torch.no_grad():
            norms, columns = self._gradient_norms() if gradients else ([], None)
            if norms and columns is None:
                torch.stack(norms, out=norm_slots)
                written["grads"] = True
            elif norms:  # some parameters have no gradient this step: theirs count as 0
                norm_slots.zero_()
                norm_slots.index_copy_(0, columns, torch.stack(norms))
                written["grads"] = True
            if loss is not None:
                loss_slot.copy_(loss.detach().reshape(()))
                written["loss"] = True
            if scaler is not None and getattr(scaler, "is_enabled", lambda: False)() and getattr(scaler, "_scale", None) is not None:
                scale_slot.copy_(scaler._scale.reshape(()))
                written["scale"] = True
            if self.watch_overflow_flag():
                flag_slot.copy_(overflow_flag(self.device))
                reset_overflow(self.device)
                written["flag"] = True
        self.rows.append(written)

    def _gradient_norms(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The norm of every gradient (float32, on the collector's device; one `_foreach_norm` per device) and,
        unless every parameter has one (the fast path, most steps), the ring column of each."""
        norms: list[torch.Tensor] = []
        complete = True
        present: list[torch.nn.Parameter] = []
        for group in self.by_device:
            grads = [p.grad for p in group]
            if any(g is None for g in grads):
                complete = False
                group = [p for p in group if p.grad is not None]
                grads = [p.grad for p in group]
            if grads:
                norms += torch._foreach_norm(grads)
                present += group
        if not norms:
            return [], None
        if not self.plain:
            norms = [n.to(self.device, torch.float32) for n in norms]
        if complete:
            return norms, None
        return norms, torch.tensor([self.column[id(p)] for p in present], dtype=torch.int64, device=self.device)

    def launch_read(self) -> None:
        """Start copying the interval's rows to the host and begin a new interval (no sync on accelerators)."""
        rows = self.ring[: len(self.rows)]
        headroom, peak = host_headroom(self.device)
        if self.device.type == "cpu":
            host, event = rows.clone(), None
        else:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.Event(self.device.type) if hasattr(torch, "Event") else torch.cuda.Event()
            event.record()
        self._pending = (host, event, self.rows, headroom, peak)
        self.rows = []

    @property
    def lag(self) -> int:
        """Steps between launching a read and taking it: 0 on the CPU, 1 on an accelerator."""
        return 0 if self.device.type == "cpu" else 1

    def take_read(self, *, oom: bool = False, curvature: float | None = None, curvature_ratio: float | None = None) -> list[float]:
        """The launched read as this rank's vector (`FIELDS`): waits for its copy (by now long done) and runs
        the interval's steps through the running statistics."""
        assert self._pending is not None, "take_read without launch_read"
        host, event, rows, headroom, peak = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        region_flags = [0.0] * self.width
        overflow = False
        backoffs = 0
        self.grad.reset_max()
        self.loss.reset_max()
        for values, written in zip(host.tolist(), rows):
            backoff = False
            if written["scale"]:
                scale = values[self.norms + 1]
                backoff = self.previous_scale is not None and scale < self.previous_scale
                backoffs += backoff
                self.previous_scale = scale
            if written["grads"]:
                sums = [0.0] * self.width
                for slot, norm in zip(self.column_slot, values[: self.norms]):
                    sums[slot] += norm * norm
                if not backoff:  # a step GradScaler skipped and backed off from: its inf gradients are handled
                    region_flags = [max(f, float(not math.isfinite(x))) for f, x in zip(region_flags, sums)]
                self.grad.update(math.sqrt(sum(sums)) if all(math.isfinite(x) for x in sums) else math.inf)
            if written["loss"]:
                self.loss.update(values[self.norms])
                overflow |= not math.isfinite(values[self.norms])  # an inf/NaN loss: the forward overflowed
            if written["flag"] and not backoff:
                overflow |= bool(values[self.norms + 2])
        overflow |= any(region_flags)
        unknown = lambda v: -1.0 if v is None else float(v)  # noqa: E731
        measured = lambda m: -1.0 if m.last is None or not math.isfinite(m.last) else m.last  # noqa: E731
        return region_flags + [
            float(overflow), measured(self.grad), self.grad.max_z, measured(self.loss), self.loss.max_z, float(len(rows)),
            unknown(headroom), unknown(peak), float(oom), unknown(curvature), unknown(curvature_ratio),
            float(backoffs), unknown(self.previous_scale),
        ]

    def snapshot_from(self, values: Sequence[float], step: int) -> Signals:
        """The `Signals` of a read's vector (this rank's, or every rank's combined)."""
        regions = len(self.region_names)
        named = dict(zip(FIELDS, values[regions + 1:]))
        known = lambda v: None if v < 0 else v  # noqa: E731
        flags = [bool(v) for v in values[: regions + 1]]
        # Regions name an overflow's place only when it is confined: not everywhere, not outside every region.
        confined = not flags[regions] and not all(flags[:regions])
        return Signals(
            step=step,
            steps=max(int(named["steps"]), 1),
            overflow=bool(named["overflow"]) or any(flags),
            overflow_regions=tuple(name for name, flag in zip(self.region_names, flags) if flag) if confined else (),
            grad_norm=known(named["grad_norm"]),
            grad_norm_z=named["grad_norm_z"],
            loss=None if named["loss"] == -1 else named["loss"],
            loss_z=named["loss_z"],
            headroom=known(named["headroom"]),
            peak_bytes=None if named["peak_bytes"] < 0 else int(named["peak_bytes"]),
            oom=bool(named["oom"]),
            curvature=None if named["curvature"] == -1 else named["curvature"],
            curvature_ratio=known(named["curvature_ratio"]),
            scaler_backoffs=int(named["scaler_backoffs"]),
            scale=known(named["scale"]),
        )

    def state_dict(self) -> dict[str, Any]:
        """The running statistics and every step not read yet: the rows of the open interval and a launched
        read not taken (copied to the host here, a sync: a checkpoint's cost, not a step's). A run resumed
        between two reads loses none of its steps' signals."""
        unread = {"values": self.ring[: len(self.rows)].tolist(), "rows": [dict(r) for r in self.rows]}
        pending = None
        if self._pending is not None:
            host, event, rows, headroom, peak = self._pending
            if event is not None:
                event.synchronize()
            pending = {"values": host.tolist(), "rows": [dict(r) for r in rows], "headroom": headroom, "peak": peak}
        return {"grad": self.grad.state(), "loss": self.loss.state(), "previous_scale": self.previous_scale,
                "unread": unread, "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grad.load(state["grad"])
        self.loss.load(state["loss"])
        self.previous_scale = state["previous_scale"]
        unread = state.get("unread") or {"values": [], "rows": []}
        values = self._rows_of(unread["values"], "unread")
        if len(values) > self.every:
            raise ValueError(f"saved signals hold {len(values)} unread steps; this runtime reads every {self.every} "
                             "steps: resume with signal_every >= the saved run's")
        self.ring[: len(values)].copy_(values)
        self.rows = [dict(r) for r in unread["rows"]]
        pending = state.get("pending")
        self._pending = None if pending is None else (
            self._rows_of(pending["values"], "pending"), None, [dict(r) for r in pending["rows"]], pending["headroom"],
            pending["peak"])

    def _rows_of(self, values: list[list[float]], what: str) -> torch.Tensor:
        if values and len(values[0]) != self.norms + 3:
            raise ValueError(f"saved {what} signals have {len(values[0]) - 3} gradient norms per step; this model has "
                             f"{self.norms} parameters: the state belongs to another model")
        # On the host: the pending read's copy is there; the ring's copy_ moves the rest.
        return torch.tensor(values, dtype=torch.float32).reshape(-1, self.norms + 3)
