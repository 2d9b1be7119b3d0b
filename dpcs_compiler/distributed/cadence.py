"""El Che cadence: data-parallel ranks of unequal speed each run as many micro-batches as they can in the
time the slowest runs `anchor`, then the gradients are summed once, weighted by the samples each rank took.

    cadence = Cadence(ddp_model, anchor=1)                 # or a plain module, or torch.compile(ddp_model, ...)
    for step in range(steps):
        for _ in range(cadence.count):                     # this rank's micro-batches this round
            x, y = next(batches)
            cadence.backward(loss_fn(model(x), y), samples=len(x))   # the last one syncs
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

Synchronous DDP marches at the slowest rank's pace while the others idle. Here every rank accumulates its own
micro-batches (DDP's `no_sync` is held open), and the last backward of a round all-reduces the gradients in
buckets as autograd finishes them (overlapped with that backward, as DDP does), followed by one small
all-reduce of each rank's sample count and timings. Each micro-batch's loss is scaled by its sample count
(`loss_reduction="mean"`, the loss is a mean over its samples) and the sum is divided by the samples of every
rank, so the gradient equals one big batch of all of them, whatever each rank ran.

After each sync every rank holds every rank's busy time and wait, and takes the same decision from them
(`next_round`, a pure function): the slowest rank runs `anchor` micro-batches, the others as many as fit in
the same time (capped at `anchor + max_batch_diff`); the anchor grows while the all-reduce's overhead (its
share of the round) is above `overhead_target` (up to `max_anchor`, the staleness limit) and shrinks back
towards the anchor asked for when it is well under. A larger anchor is a larger batch per optimizer step:
fewer updates per second, so it grows only for the all-reduce, not for the imbalance whole micro-batches
leave (measured: counting that too made the anchor climb on a jittery CPU and the loss fall slower in time).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dpcs_compiler.options import config_from

STATE_VERSION = 1
LOSS_REDUCTIONS = ("mean", "sum")


class CadenceError(RuntimeError):
    """A cadence sync failed: a rank stopped reporting (crashed, hung, out of data) or the collective broke."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CadenceConfig:
    """anchor: micro-batches the slowest rank runs per sync (the least the tuning goes down to).
    overhead_target: the fraction of a round the sync may take before the anchor grows (None: the anchor stays).
    max_anchor: the most micro-batches the slowest rank runs per sync (how stale a gradient may get).
    max_batch_diff: how many micro-batches more than the anchor the fastest may run (None: no cap).
    speeds: each rank's relative speed before anything is measured ([1.0, 0.5]: rank 1 takes twice as long).
    report_timing: ranks report their measured times at each sync and the counts follow them; False keeps the
    counts of `speeds` and the anchor fixed (reproducible batch counts, no timing noise).
    timeout: seconds a sync waits for the other ranks before raising `CadenceError`.
    first_bucket_bytes, bucket_bytes: gradient bytes of the first all-reduce bucket and of the others, launched
    as the last backward finishes them (DDP's sizes: a small first bucket starts the sync early).
    smoothing: weight of the newest round in the running time estimates (1.0: the last round only)."""

    anchor: int = 1
    overhead_target: float | None = 0.10
    max_anchor: int = 8
    max_batch_diff: int | None = None
    speeds: tuple[float, ...] | None = None
    report_timing: bool = True
    timeout: float = 600.0
    loss_reduction: str = "mean"
    first_bucket_bytes: int = 2**20
    bucket_bytes: int = 25 * 2**20
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        def whole(name: str, value: Any, minimum: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"Cadence {name}={value!r} is not valid; valid choices: an int >= {minimum}")

        whole("anchor", self.anchor, 1)
        whole("max_anchor", self.max_anchor, 1)
        if self.max_anchor < self.anchor:
            raise ValueError(f"Cadence max_anchor={self.max_anchor} is below anchor={self.anchor}; valid choices: "
                             f"an int >= anchor")
        if self.max_batch_diff is not None:
            whole("max_batch_diff", self.max_batch_diff, 0)
        whole("bucket_bytes", self.bucket_bytes, 1)
        whole("first_bucket_bytes", self.first_bucket_bytes, 1)
        target = self.overhead_target
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1):
            raise ValueError(f"Cadence overhead_target={target!r} is not valid; valid choices: None or a number in (0, 1)")
        if self.speeds is not None:
            speeds = tuple(self.speeds)
            if not speeds or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0
                                     for s in speeds):
                raise ValueError(f"Cadence speeds={self.speeds!r} is not valid; valid choices: None or one positive "
                                 f"number per rank")
            object.__setattr__(self, "speeds", tuple(float(s) for s in speeds))
        if not isinstance(self.report_timing, bool):
            raise ValueError(f"Cadence report_timing={self.report_timing!r} is not valid; valid choices: True, False")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"Cadence timeout={self.timeout!r} is not valid; valid choices: seconds > 0")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"Cadence loss_reduction={self.loss_reduction!r} is not valid; valid choices: "
                             f"{', '.join(map(repr, LOSS_REDUCTIONS))}")
        if isinstance(self.smoothing, bool) or not isinstance(self.smoothing, (int, float)) or not 0 < self.smoothing <= 1:
            raise ValueError(f"Cadence smoothing={self.smoothing!r} is not valid; valid choices: a number in (0, 1]")


# ---- the decision: pure functions of what the ranks measured --------------------------------------------


SYNC_WINDOW = 5  # syncs whose median cost the anchor tuning uses (one slow sync does not move it)
MIN_SYNCS = 3  # timed syncs before the anchor is tuned


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The running estimates every rank holds alike: seconds per micro-batch of each rank (relative until
    `measured`), and what each of the last syncs cost beyond the slowest rank's work (newest last)."""

    seconds_per_batch: tuple[float, ...]
    waits: tuple[float, ...] = ()
    measured: bool = False

    @property
    def wait_seconds(self) -> float | None:
        return statistics.median(self.waits) if self.waits else None


def initial_counts(config: CadenceConfig, world: int) -> tuple[tuple[int, ...], Estimate]:
    """The first round's micro-batch counts, from `speeds` (equal without): the slowest runs `anchor`."""
    speeds = config.speeds or (1.0,) * world
    if len(speeds) != world:
        raise ValueError(f"Cadence speeds has {len(speeds)} entries for a job of {world} ranks; valid choices: one "
                         f"relative speed per rank")
    estimate = Estimate(seconds_per_batch=tuple(1.0 / s for s in speeds))
    return counts_for(config, config.anchor, estimate.seconds_per_batch), estimate


def counts_for(config: CadenceConfig, anchor: int, seconds_per_batch: Sequence[float]) -> tuple[int, ...]:
    """Micro-batches per rank: the slowest runs `anchor`, each other as many as fit in the same time (at least
    one, at most `anchor + max_batch_diff`)."""
    round_seconds = anchor * max(seconds_per_batch)
    cap = None if config.max_batch_diff is None else anchor + config.max_batch_diff
    counts = []
    for seconds in seconds_per_batch:
        count = max(1, int(math.floor(round_seconds / seconds + 0.5)))
        counts.append(count if cap is None else min(count, cap))
    return tuple(counts)


@dataclasses.dataclass(frozen=True)
class RoundDecision:
    counts: tuple[int, ...]
    anchor: int
    estimate: Estimate
    overhead: float | None  # the sync's share of a round, as measured (None before a sync was timed)
    reason: str


def next_round(config: CadenceConfig, anchor: int, estimate: Estimate, ran: Sequence[int], busy: Sequence[float],
               waited: float | None) -> RoundDecision:
    """The next round's counts and anchor after a round in which rank i ran `ran[i]` micro-batches in `busy[i]`
    seconds of its own work; `waited`: what the last timed sync cost, the least any rank waited in it (the
    rank that finished its work last waited only for the all-reduce itself; the others also for it).

    Seconds per micro-batch are smoothed over rounds (`smoothing`), the first measured round replacing the
    relative speeds the job started from; the wait is the median of the last `SYNC_WINDOW`."""
    alpha = config.smoothing if estimate.measured else 1.0
    measured = [b / n for b, n in zip(busy, ran)]
    seconds = tuple(alpha * m + (1 - alpha) * old for m, old in zip(measured, estimate.seconds_per_batch))
    waits = estimate.waits if waited is None else (*estimate.waits, waited)[-SYNC_WINDOW:]
    estimate = Estimate(seconds_per_batch=seconds, waits=waits, measured=True)
    sync = estimate.wait_seconds
    slowest = max(seconds)
    overhead = None if sync is None else sync / (anchor * slowest + sync)
    reason = ""
    new_anchor = anchor
    target = config.overhead_target
    if target is not None and len(waits) >= MIN_SYNCS and slowest > 0:
        def needed(share: float) -> int:  # the least anchor whose sync share is at most `share`
            return max(1, math.ceil(sync * (1 - share) / (share * slowest) - 1e-9))

        # A band, not a line: grow to a quarter under the target, shrink only below half of it and only as far
        # as keeps it there; noise around the target does not make the anchor (and the batch) swing.
        if overhead > target and anchor < config.max_anchor:
            new_anchor = min(config.max_anchor, max(anchor + 1, needed(0.75 * target)))
            reason = f"sync overhead {overhead:.1%} > target {target:.0%}: anchor {anchor} -> {new_anchor}"
        elif overhead < target / 2 and anchor > config.anchor:
            new_anchor = min(anchor, max(config.anchor, needed(target / 2)))
            if new_anchor < anchor:
                reason = f"sync overhead {overhead:.1%} < {target / 2:.0%}: anchor {anchor} -> {new_anchor}"
    counts = counts_for(config, new_anchor, seconds)
    if not reason and tuple(counts) != tuple(ran):
        reason = f"measured speeds: micro-batches {list(ran)} -> {list(counts)}"
    return RoundDecision(counts=counts, anchor=new_anchor, estimate=estimate, overhead=overhead, reason=reason)


# ---- the cadence in the training loop --------------------------------------------------------------------


def _wrapped(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel | None]:
    """(the module whose parameters train, the DDP wrapper if any), through torch.compile's wrapper."""
    module = getattr(model, "_orig_mod", model)
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module.module, module
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(module, FSDPModule) or any(isinstance(p, DTensor) for p in module.parameters()) or any(
            type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
        raise ValueError("Cadence needs a replicated model (DDP-wrapped or plain, every rank holding every parameter); "
                         "this one is sharded (FSDP), whose gradient reduce-scatter runs at every backward")
    return module, None


class Cadence:
    """El Che cadence for data-parallel ranks of unequal speed; see the module docstring.

    `telemetry`: a `Runtime` (its telemetry file), a `Telemetry`, or a path: one "cadence" line per sync."""

    def __init__(self, model: torch.nn.Module, *, telemetry: Any = None, group: Any = None,
                 config: CadenceConfig | None = None, **config_fields: Any) -> None:
        self.config = config = config_from(CadenceConfig, config, config_fields, "Cadence")
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("Cadence needs a distributed job (torch.distributed.init_process_group) of 2 or more "
                             "ranks; torch.distributed is not initialized in this process")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world < 2:
            raise ValueError(f"Cadence needs 2 or more ranks; this job has world size {self.world}: with one rank "
                             f"there is nobody to wait for, train without a Cadence")
        self.module, self.ddp = _wrapped(model)
        self.parameters = [p for p in self.module.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("Cadence: the model has no parameter that requires a gradient")
        devices = {p.device for p in self.parameters}
        if len(devices) > 1:
            raise ValueError(f"Cadence needs every parameter on one device; this model has them on {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.counts, self.estimate = initial_counts(config, self.world)
        self.anchor = config.anchor
        self.steps = 0  # syncs done
        self._rounds = 0  # syncs done by this object (the first round, with its compiles, is not measured)
        self.done = 0  # micro-batches of this round done on this rank
        self.last: dict[str, Any] | None = None  # the last sync's telemetry entry
        self._samples = 0
        self._waited = 0.0  # this rank's wait in the last sync, sent with the next
        self._round_start = time.perf_counter()
        self._telemetry = self._telemetry_of(telemetry)
        self._buckets = self._make_buckets()
        self._armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.parameters]
        self._no_sync = None
        if self.ddp is not None:
            self._no_sync = self.ddp.no_sync()  # held open: DDP reduces nothing, the cadence does
            self._no_sync.__enter__()
        else:  # DDP broadcasts rank 0's parameters when it wraps a model; a plain module gets the same here
            with torch.no_grad():
                for tensor in [*self.module.parameters(), *self.module.buffers()]:
                    self._wait(dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0) if group else 0,
                                              group=group, async_op=True), "the initial broadcast of the parameters")
        self._closed = False

    @staticmethod
    def _telemetry_of(telemetry: Any):
        from dpcs_compiler.runtime.runtime import Runtime
        from dpcs_compiler.runtime.telemetry import Telemetry

        if telemetry is None or isinstance(telemetry, Telemetry):
            return telemetry
        if isinstance(telemetry, Runtime):
            return telemetry.telemetry
        if isinstance(telemetry, (str, Path)):
            return Telemetry(telemetry, every=1)
        raise ValueError(f"Cadence telemetry={telemetry!r} is not valid; valid choices: None, a Runtime, a Telemetry "
                         f"or a path")

    # ---- what the loop reads ----------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Micro-batches this rank runs in the current round."""
        return self.counts[self.rank]

    @property
    def remaining(self) -> int:
        """Micro-batches this rank still has to run before the round's sync."""
        return self.count - self.done

    # ---- the step ---------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, samples: int) -> bool:
        """Backward of one micro-batch of `samples` samples; the round's last one also syncs the gradients.
        Returns True when it synced: the parameters' gradients are then the mean over every sample every rank
        ran this round (`loss_reduction="mean"`; the sum divided by the samples with "sum"); step the
        optimizer."""
        if self._closed:
            raise RuntimeError("this Cadence was closed")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"Cadence.backward samples={samples!r} is not valid; valid choices: an int >= 1 "
                             f"(the micro-batch's sample count)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"Cadence.backward needs a scalar loss tensor, got {type(loss).__name__}"
                             f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}")
        last = self.done + 1 == self.count
        if last:
            self._arm()
        (loss * samples if self.config.loss_reduction == "mean" else loss).backward()
        self.done += 1
        self._samples += samples
        if not last:
            return False
        self._sync()
        return True

    # ---- buckets: the gradients all-reduced as the last backward finishes them ---------------------------

    def _make_buckets(self) -> list[dict[str, Any]]:
        """Parameters in reverse order (autograd finishes the last layers first), cut after
        `first_bucket_bytes`, then every `bucket_bytes`; one flat fp32 (fp64 with fp64 parameters) buffer each.

        A parameter of the buffer's dtype has its gradient live in the buffer (a view, as DDP's
        `gradient_as_bucket_view`): the micro-batches accumulate into it, the all-reduce and the division
        work on it in place, and the buckets cost no second copy of the gradients. Others are copied in and
        out at the sync."""
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.parameters) else torch.float32
        groups: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.parameters):
            current.append(p)
            size += p.numel() * dtype.itemsize
            if size >= (self.config.bucket_bytes if groups else self.config.first_bucket_bytes):
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        self._bucket_of: dict[int, int] = {}
        self._view_of: dict[int, torch.Tensor | None] = {}
        buckets = []
        for index, params in enumerate(groups):
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=self.device)
            views, offset = [], 0
            for p in params:
                views.append(buffer[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
                self._bucket_of[id(p)] = index
                self._view_of[id(p)] = views[-1] if p.dtype == dtype else None
            buckets.append({"params": params, "buffer": buffer, "views": views})
        return buckets

    def _arm(self) -> None:
        self._armed = True
        for bucket in self._buckets:
            bucket["ready"] = 0
            bucket["work"] = None
        self._next_launch = 0

    def _grad_ready(self, param: torch.Tensor) -> None:
        view = self._view_of[id(param)]
        if view is not None and param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():  # a fresh gradient (the round's first, after zero_grad(set_to_none=True))
                view.copy_(param.grad)
            param.grad = view
        if not self._armed:
            return
        index = self._bucket_of[id(param)]
        self._buckets[index]["ready"] += 1
        self._launch_ready()

    def _launch_ready(self, every: bool = False) -> None:
        """Launch, in bucket order (the same on every rank), each bucket whose gradients are all in; with
        `every`, the rest too (a parameter that got no gradient this round sends zeros)."""
        import torch.distributed as dist

        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if not every and bucket["ready"] < len(bucket["params"]):
                return
            with torch.no_grad():
                for p, view in zip(bucket["params"], bucket["views"]):
                    if p.grad is None:
                        view.zero_()
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
            bucket["work"] = dist.all_reduce(bucket["buffer"], group=self.group, async_op=True)
            self._next_launch += 1

    # ---- the sync -----------------------------------------------------------------------------------------

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.config.timeout))
        except Exception as error:  # noqa: BLE001 - re-raised with what the job was waiting for
            raise CadenceError(
                f"rank {self.rank}: {what} at cadence step {self.steps + 1} got no answer from the other ranks "
                f"within {self.config.timeout:g} s: a rank stopped reporting (crashed, hung, or ran out of data "
                f"before its {self.counts} micro-batches); the job cannot continue ({type(error).__name__}: {error})"
            ) from error

    def _sync(self) -> None:
        import torch.distributed as dist

        self._launch_ready(every=True)
        self._armed = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        busy = time.perf_counter() - self._round_start
        # One small all-reduce: every rank's samples, busy time and last wait, each in its own slot.
        report = torch.zeros(1 + 2 * self.world, dtype=torch.float64)
        report[0] = self._samples
        report[1 + self.rank] = busy
        report[1 + self.world + self.rank] = self._waited
        if self.device.type == "cuda" and dist.get_backend(self.group) == "nccl":
            report = report.to(self.device)
        waiting = time.perf_counter()
        report_work = dist.all_reduce(report, group=self.group, async_op=True)
        for bucket in self._buckets:
            self._wait(bucket["work"], "the gradient all-reduce")
            bucket["work"] = None  # a finished Work kept to the interpreter's end can abort it (gloo's threads)
        self._wait(report_work, "the sample-count all-reduce")
        del report_work
        report = report.cpu().tolist()
        waited = time.perf_counter() - waiting
        total = report[0]
        busy_all = report[1:1 + self.world]
        with torch.no_grad():
            for bucket in self._buckets:
                bucket["buffer"].div_(total)
                for p, view in zip(bucket["params"], bucket["views"]):
                    if self._view_of[id(p)] is not None:
                        p.grad = view  # every rank's parameter has a gradient now (zeros where none ran it)
                    elif p.grad is None:
                        p.grad = view.to(p.dtype, copy=True)
                    else:
                        p.grad.copy_(view)
            if self.ddp is not None and self.ddp.broadcast_buffers:
                buffers = [b for b in self.module.buffers()]
                works = [dist.broadcast(b, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                        group=self.group, async_op=True) for b in buffers]
                for work in works:
                    self._wait(work, "the buffer broadcast")
        ran = self.counts
        self.steps += 1
        self._rounds += 1
        # Each rank's wait in this sync reaches the others with the next one: the sync cost a decision uses is
        # the last one's. The first round (compiles, warm-up) is not measured.
        previous_waits = report[1 + self.world:]
        timed = self._rounds > 2
        entry: dict[str, Any] = {"step": self.steps, "kind": "cadence", "ran": list(ran), "anchor_ran": self.anchor,
                                 "samples": int(total), "busy_seconds": [round(b, 6) for b in busy_all]}
        if timed:  # the least wait is the all-reduce itself; beyond it a rank waited for the others
            entry.update({"idle_seconds": [round(w - min(previous_waits), 6) for w in previous_waits],
                          "sync_seconds": round(min(previous_waits), 6)})
        if self.config.report_timing and self._rounds > 1:
            decision = next_round(self.config, self.anchor, self.estimate, ran, busy_all,
                                  min(previous_waits) if timed else None)
            self.counts, self.anchor, self.estimate = decision.counts, decision.anchor, decision.estimate
            entry["reason"] = decision.reason
            if decision.overhead is not None:
                entry["overhead"] = round(decision.overhead, 4)
        self._waited = waited
        entry.update({"counts": list(self.counts), "anchor": self.anchor})
        self.last = entry
        if self._telemetry is not None:
            self._telemetry.record(entry)
        self.done = 0
        self._samples = 0
        self._round_start = time.perf_counter()

    # ---- state and end --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue with the same counts and anchor (save it with the checkpoint)."""
        if self.done:
            raise RuntimeError(f"Cadence.state_dict in the middle of a round ({self.done} of {self.count} "
                               f"micro-batches done): save after a sync")
        return {"version": STATE_VERSION, "world": self.world, "steps": self.steps, "counts": list(self.counts),
                "anchor": self.anchor, "seconds_per_batch": list(self.estimate.seconds_per_batch),
                "waits": list(self.estimate.waits), "measured": self.estimate.measured}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Cadence state version {state.get('version')!r} is not valid; valid choices: {STATE_VERSION}")
        if state["world"] != self.world:  # the speeds are per rank: a resized job measures them again
            self.counts, self.estimate = initial_counts(self.config, self.world)
            self.anchor = min(max(state["anchor"], self.config.anchor), self.config.max_anchor)
            self.counts = counts_for(self.config, self.anchor, self.estimate.seconds_per_batch)
        else:
            self.counts = tuple(state["counts"])
            self.anchor = state["anchor"]
            self.estimate = Estimate(tuple(state["seconds_per_batch"]), tuple(state["waits"]), state["measured"])
        self.steps = state["steps"]

    def close(self) -> None:
        """Give DDP its own gradient sync back and remove the cadence's hooks."""
        if self._closed:
            return
        for hook in self._hooks:
            hook.remove()
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
        if self._telemetry is not None:
            self._telemetry.flush()
        self._closed = True

    def __enter__(self) -> Cadence:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
