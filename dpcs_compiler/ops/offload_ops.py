"""Custom ops that move a saved activation to host memory in forward and back to the device in backward.

Four ops in the "dpcs" namespace, defined with `torch.library.Library` (schema, one kernel for every device,
fake impls) so they live in FX graphs, pass through AOTAutograd and lower to Inductor fallback kernels on
torch 2.11 and 2.13 alike (torch 2.13's own `ao::` offload ops are not on 2.11). Not `torch.library.custom_op`:
its Python autograd and checking layers cost about 20 us a call on the host, ten times this registration's,
and a step issues four calls per offloaded value in line with its kernels (`host_seconds_per_value`). The ops
have no autograd formula: they run inside compiled graphs, after the partition.

    host = dpcs.offload(x)              # forward, right after x is made: D2H copy on the side stream
    dpcs.wait_offload(host, x)          # forward, where x may be freed: compute stream waits for that copy
    dev = dpcs.reload(host, device)     # backward, at the prefetch point: H2D copy on the side stream
    dpcs.wait_tensor(dev)               # backward, right before dev's first use: compute stream waits

Streams and events. One dpcs side stream per CUDA device carries every copy, created lazily; each copy first
waits for the compute (current) stream, so it reads finished data. An event is recorded right after every
copy, and every asynchronous consumer waits on the event of the copy it depends on: the reload's side stream
on the D2H copy it reads (also right if the streams were released in between), the compute stream on the
D2H copy before x's memory is reused (`wait_offload`) and on the H2D copy before dev is read (`wait_tensor`).

Memory of x. `offload` calls `x.record_stream(side)`, so once x is freed the caching allocator does not hand
its memory out again before the copy is done. That covers graph inputs and standalone use, but not
Inductor, which reuses a dead buffer in place without asking the allocator; hence `wait_offload`, which the
rewrite puts where x's memory may be freed (after its last forward use, or later to hide the copy).

Memory of dev. It is allocated on the compute stream (only that stream ever frees or reuses it) and the side
stream waits for the compute stream before writing it, so earlier compute work on that memory is done; all
readers come after `wait_tensor`, so it needs no `record_stream` (which would also delay its reuse until
every later queued copy is done). Pinned host buffers need nothing: the caching host allocator records the
copy's stream itself.

Why the waits mutate and return nothing. A custom op may not return an alias of its input, and a fresh copy
would cost the memory we are saving. Declaring the device tensor mutated (`Tensor(a!)`) keeps the op through
dead code elimination and makes Inductor run every later reader of the tensor after it, on graphs that are
already past functionalization (the rewrite runs after the partition). Inductor may still run the wait
before an earlier reader that it fuses lazily (seen for wait_offload): that costs overlap, not correctness.
The data is not changed.

Events are keyed by the data pointer of the copy's destination (the host buffer, dev): fresh allocations
that stay alive until their consumer runs. `release_offload_state()` drops streams, events and cached pinned
memory deterministically. On CPU (or any non-CUDA device) every op is synchronous: offload and reload return
plain copies and the waits do nothing; that is how CPU tests check graph structure and numerics.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dpcs_compiler.cost import hardware

__all__ = [
    "offload",
    "reload",
    "wait_tensor",
    "wait_offload",
    "release_offload_state",
    "pending_events",
    "host_seconds_per_value",
    "OFFLOAD_OPS",
]

_side_streams: dict[int, torch.cuda.Stream] = {}
# Event recorded right after the D2H copy into a host buffer, keyed by the host buffer's data_ptr.
_d2h_events: dict[int, torch.cuda.Event] = {}
# Event recorded right after the H2D copy into a reloaded device tensor, keyed by its data_ptr.
_h2d_events: dict[int, torch.cuda.Event] = {}


_LIB = torch.library.Library("dpcs", "FRAGMENT")  # the namespace is shared with dpcs's other ops
# Make Inductor give the ops' inputs the stride order of their meta["val"] (x's layout is the host's). Not
# needs_exact_strides: Inductor applies it only to nodes traced with `eager_input_vals`, which nodes inserted
# after the partition do not have.
_FIXED_STRIDES = (torch.Tag.needs_fixed_stride_order,)


def _define(schema: str, kernel: Callable, fake: Callable, tags: tuple = ()) -> torch._ops.OpOverload:
    """Define `dpcs::<schema>` with `kernel` for every device and `fake` for fake tensors; its overload."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=tags)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dpcs::{name}", fake, lib=_LIB)
    return getattr(torch.ops.dpcs, name).default


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The dpcs copy stream of a CUDA device, created on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


def _host_like(x: torch.Tensor, pin: bool) -> torch.Tensor:
    """Empty host tensor with x's shape, dtype and (x being dense) strides; the fake impl follows the same rule."""
    return torch.empty_like(x, device="cpu", pin_memory=pin)


def _offload(x: torch.Tensor) -> torch.Tensor:
    """Copy x to host memory: on CUDA into pinned memory, asynchronously on the side stream."""
    if x.device.type != "cuda":
        host = _host_like(x, pin=False)
        host.copy_(x)
        return host
    host, copied = copy_to_host_async(x)
    _d2h_events[host.data_ptr()] = copied
    return host


def copy_to_host_async(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A pinned host copy of CUDA tensor `x`, made on the side stream after the work queued so far, and the
    event recorded right after the copy; `x` may be freed at once (its memory is not reused before the copy)."""
    side = _side_stream(x.device)
    host = _host_like(x, pin=True)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    x.record_stream(side)
    return host, copied


def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return _host_like(x, pin=False)


offload = _define("offload(Tensor x) -> Tensor", _offload, _offload_fake, _FIXED_STRIDES)


def _wait_offload(host: torch.Tensor, source: torch.Tensor) -> None:
    """Make the compute stream wait for the D2H copy of `source` into `host`; after it, `source` may be reused."""
    if source.device.type != "cuda":
        return
    copied = _d2h_events.get(host.data_ptr())  # kept for the reload, which must follow the same copy
    if copied is None:
        raise RuntimeError(
            "dpcs.wait_offload: no pending dpcs.offload into this host tensor "
            "(release_offload_state() called between the offload and the wait?)"
        )
    torch.cuda.current_stream(source.device).wait_event(copied)


def _wait_offload_fake(host: torch.Tensor, source: torch.Tensor) -> None:
    return None


wait_offload = _define("wait_offload(Tensor host, Tensor(a!) source) -> ()", _wait_offload, _wait_offload_fake,
                       _FIXED_STRIDES)


def _reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device`: on CUDA asynchronously on the side stream (pair with wait_tensor)."""
    device = torch.device(device)
    if device.type != "cuda":
        out = torch.empty_like(host, device=device)
        out.copy_(host)
        return out
    compute = torch.cuda.current_stream(device)
    side = _side_stream(device)
    out = torch.empty_like(host, device=device)  # on the compute stream, see the module docstring
    side.wait_stream(compute)
    offloaded = _d2h_events.pop(host.data_ptr(), None)
    if offloaded is not None:
        side.wait_event(offloaded)
    with torch.cuda.stream(side):
        out.copy_(host, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    _h2d_events[out.data_ptr()] = copied
    return out


def _reload_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(host, device=device)


reload = _define("reload(Tensor host, Device device) -> Tensor", _reload, _reload_fake, _FIXED_STRIDES)


def _wait_tensor(tensor: torch.Tensor) -> None:
    """Make the compute stream wait until the reload into `tensor` is done; call it before the first use."""
    if tensor.device.type != "cuda":
        return
    copied = _h2d_events.pop(tensor.data_ptr(), None)
    if copied is None:
        raise RuntimeError(
            "dpcs.wait_tensor: no pending dpcs.reload into this tensor "
            "(waited twice, or release_offload_state() called between the reload and the wait?)"
        )
    torch.cuda.current_stream(tensor.device).wait_event(copied)


def _wait_tensor_fake(tensor: torch.Tensor) -> None:
    return None


wait_tensor = _define("wait_tensor(Tensor(a!) tensor) -> ()", _wait_tensor, _wait_tensor_fake)


OFFLOAD_OPS = (offload, wait_offload, reload, wait_tensor)


def pending_events() -> int:
    """Copy events not yet consumed by a reload or a wait (0 after a full training step on CUDA)."""
    return len(_d2h_events) + len(_h2d_events)


def release_offload_state() -> None:
    """Finish every copy in flight, then drop the side streams, events and cached pinned host memory.

    Call it between training steps, not between a forward and its backward: a wait whose event was dropped
    fails loudly instead of racing.
    """
    for stream in _side_streams.values():
        stream.synchronize()
    _side_streams.clear()
    _d2h_events.clear()
    _h2d_events.clear()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty_host_cache()


def host_seconds_per_value(device: torch.device, sync: Callable[[], None], rounds: int = 50, repeats: int = 5) -> float:
    """Host seconds one offloaded value's four ops take, as a training step issues them: a 4 KiB value copied out
    and back `rounds` times without waiting for the device in between, the median of `repeats` such runs. The
    copies are tiny, so the device keeps up and the time is the host's: what the ops add to a step whose kernels
    are short (on a step whose kernels are long it hides behind them, as launches do). The hardware profile's
    `offload_ops_s` on CUDA."""
    value = torch.ones(1024, device=device)

    def one_round() -> None:
        host = offload(value)
        wait_offload(host, value)
        wait_tensor(reload(host, device))

    for _ in range(3):
        one_round()
    sync()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            one_round()
        runs.append((time.perf_counter() - start) / rounds)
        sync()
    return statistics.median(runs)


hardware.register_offload_ops_timer(host_seconds_per_value)
