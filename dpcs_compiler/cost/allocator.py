"""A pure-Python model of PyTorch's CUDA caching allocator (torch 2.11): the reserved bytes a step really needs.

The planner counts allocated bytes; the device runs out of reserved ones. This model replays an allocation
sequence through the allocator's rules, all from `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`)
and `c10/core/AllocatorConfig.h` as written up in notes/allocator_study.md, and is checked against six H200
traces (tests/cost/data/h200_allocator):

- sizes: `round_size` (512 B multiples), `get_pool` (small pool for <= 1 MiB), `get_allocation_size`
  (2 MiB small segments, `large_segment_size` for 1-10 MiB, 2 MiB multiples from 10 MiB).
- reuse: `get_free_block`, best fit on (stream, size, address) (`BlockComparatorSize`); a free expandable block
  followed by unmapped space is passed over for the next larger one (its "expandable size" counts the space).
- `should_split`: small pool or expandable segments: remainder >= 512 B; large pool: remainder > 1 MiB.
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours in the same mapped state.
- `alloc_block`: under a per-process cap, fails when reserved + alloc_size would exceed it; `malloc` then runs
  `release_cached_blocks` and retries once (`isRetry`) before raising out-of-memory.
- `release_blocks`: cudaFree of each segment that is one free block; expandable: `unmap_block` of the pages
  wholly inside each free block, and `release_expandable_segment` once a segment is wholly unmapped.
- expandable segments: `find_expandable_block` / `try_allocate_expandable_block` / `map_block` grow one VA
  range per (stream, pool) at its lowest unmapped address (after a free mapped tail) by whole pages
  (2 MiB small, `large_segment_size` large); freed blocks stay mapped until a release.

Not modelled (all off by default): max_split_size, roundup_power2_divisions, garbage collection, record_stream
events, graph pools and MemPools.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The allocator's settings, torch's defaults.

    `cap_bytes`: the per-process memory fraction as bytes (or the device's memory, for a physical limit).
    """

    expandable: bool = False
    cap_bytes: int | None = None
    min_block_size: int = 512  # kMinBlockSize
    small_size: int = 1 * MiB  # kSmallSize
    small_buffer: int = 2 * MiB  # kSmallBuffer: small segments, and small expandable pages
    min_large_alloc: int = 10 * MiB  # kMinLargeAlloc
    round_large: int = 2 * MiB  # kRoundLarge
    large_segment_size: int = 20 * MiB  # large_segment_size_mb: 1-10 MiB segments, and large expandable pages
    expandable_va_bytes: int = 1 << 40  # address space of one new expandable segment (torch: 1.125x the device)

    def __post_init__(self) -> None:
        if self.large_segment_size <= self.min_large_alloc:
            raise ValueError("large_segment_size must exceed min_large_alloc (torch: > 10 MiB)")
        if self.cap_bytes is not None and self.cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {self.cap_bytes}")

    def round_size(self, size: int) -> int:
        """The block size a request of `size` bytes gets (`round_size`)."""
        return max(self.min_block_size, -(-size // self.min_block_size) * self.min_block_size)

    def is_small(self, rounded: int) -> bool:
        """Whether a rounded request goes to the small pool (`get_pool`)."""
        return rounded <= self.small_size

    def allocation_size(self, rounded: int) -> int:
        """The segment cudaMalloc'd when nothing cached fits (`get_allocation_size`); also the cap check's size."""
        if rounded <= self.small_size:
            return self.small_buffer
        if rounded < self.min_large_alloc:
            return self.large_segment_size
        return -(-rounded // self.round_large) * self.round_large

    def page_bytes(self, small: bool) -> int:
        """The mapping granule of an expandable segment of the small or the large pool."""
        return self.small_buffer if small else self.large_segment_size


class SimulatedOutOfMemory(RuntimeError):
    """The model could not place a request under `cap_bytes`, even after releasing every cached block."""

    def __init__(self, requested: int, reserved: int, cap: int | None) -> None:
        super().__init__(f"simulated CUDA OOM: tried to allocate {requested} B with {reserved} B reserved, cap {cap} B")
        self.requested, self.reserved, self.cap = requested, reserved, cap


@dataclasses.dataclass(eq=False)
class _Segment:
    address: int
    size: int  # cudaMalloc'd bytes, or the reserved address space of an expandable segment
    stream: int
    small: bool
    expandable: bool
    page: int


@dataclasses.dataclass(eq=False)
class _Block:
    address: int
    size: int
    segment: _Segment
    allocated: bool = False
    mapped: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def end(self) -> int:
        return self.address + self.size


class _Pool:
    """One BlockPool: free mapped blocks by (stream, size, address), unmapped blocks by (stream, address)."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int, int]] = []
        self.unmapped: list[tuple[int, int]] = []
        self.by_address: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        stream = block.segment.stream
        if block.mapped:
            bisect.insort(self.free, (stream, block.size, block.address))
        else:
            bisect.insort(self.unmapped, (stream, block.address))
        self.by_address[block.address] = block

    def remove(self, block: _Block) -> None:
        stream = block.segment.stream
        keys: list[Any] = self.free if block.mapped else self.unmapped
        key = (stream, block.size, block.address) if block.mapped else (stream, block.address)
        del keys[bisect.bisect_left(keys, key)]
        del self.by_address[block.address]


def _link(prev: _Block | None, block: _Block, next_: _Block | None) -> None:
    block.prev, block.next = prev, next_
    if prev is not None:
        prev.next = block
    if next_ is not None:
        next_.prev = block


def _expandable_size(block: _Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


class CachingAllocatorModel:
    """The allocator of one device: `malloc`/`free`/`release_cached` with torch's byte accounting and peaks."""

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        self._pools = {True: _Pool(), False: _Pool()}  # keyed by "small"
        self._live: dict[int, _Block] = {}
        self._segments: list[_Segment] = []
        self._next_address = 1 << 32
        self._allocated = self._reserved = self._peak_allocated = self._peak_reserved = 0
        self.num_device_allocs = 0  # cudaMalloc plus page-map calls (torch's num_device_alloc)
        self.num_device_frees = 0  # cudaFree plus unmap calls
        self.num_alloc_retries = 0
        self.num_ooms = 0

    @classmethod
    def from_segments(
        cls, segments: Iterable[Mapping[str, Any]], config: AllocatorConfig | None = None
    ) -> CachingAllocatorModel:
        """The allocator holding `segments` (snapshot/trace format, blocks as [size, (requested,) state]).

        A snapshot lists an expandable segment as its mapped ranges; the ranges of one (stream, pool) become one
        address space whose gaps and tail are unmapped, so growth continues at the end of the last range.
        """
        model = cls(config)
        open_tails: dict[tuple[int, bool], _Block] = {}  # last block of the expandable segment being rebuilt
        for seg in sorted(segments, key=lambda s: s["address"]):
            address, size, stream = seg["address"], seg["total_size"], seg["stream"]
            small = seg["segment_type"] == "small"
            prev = open_tails.get((stream, small)) if seg["is_expandable"] else None
            if prev is not None and address + size <= prev.segment.address + prev.segment.size:
                segment = prev.segment
                if address > prev.end:
                    prev = model._new_block(segment, prev.end, address - prev.end, prev, mapped=False)
            else:
                model._close_expandable(prev)
                page = model.config.page_bytes(small) if seg["is_expandable"] else 0
                if page and not model.config.expandable:
                    raise ValueError("expandable segments need AllocatorConfig(expandable=True)")
                reserve = -(-max(model.config.expandable_va_bytes, size) // page) * page if page else size
                segment, prev = _Segment(address, reserve, stream, small, bool(page), page), None
                model._segments.append(segment)
            last = model._add_blocks(segment, prev, address, seg["blocks"])
            if segment.expandable:
                open_tails[(stream, small)] = last
        for last in open_tails.values():
            model._close_expandable(last)
        model._next_address = max([model._next_address] + [s.address + s.size for s in model._segments])
        model._peak_allocated, model._peak_reserved = model._allocated, model._reserved
        return model

    def _new_block(self, segment: _Segment, address: int, size: int, prev: _Block | None, *, mapped: bool) -> _Block:
        block = _Block(address, size, segment, mapped=mapped)
        _link(prev, block, None)
        self._pools[segment.small].add(block)
        return block

    def _add_blocks(
        self, segment: _Segment, prev: _Block | None, address: int, blocks: Sequence[Sequence[Any]]
    ) -> _Block:
        for entry in blocks:
            size = entry[0]
            if str(entry[-1]).startswith("active"):
                block = _Block(address, size, segment, allocated=True)
                _link(prev, block, None)
                self._live[address] = block
                self._allocated += size
            else:
                block = self._new_block(segment, address, size, prev, mapped=True)
            self._reserved += size
            prev, address = block, address + size
        assert prev is not None, "a segment has at least one block"
        return prev

    def _close_expandable(self, last: _Block | None) -> None:
        if last is not None and last.end < last.segment.address + last.segment.size:
            self._new_block(
                last.segment, last.end, last.segment.address + last.segment.size - last.end, last, mapped=False
            )

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_reserved

    def live_blocks(self) -> dict[int, int]:
        """Address -> size of every allocated block."""
        return {address: block.size for address, block in self._live.items()}

    def malloc(self, size: int, stream: int = 0) -> int:
        """The address of a new block of at least `size` bytes on `stream` (0 for a 0-byte request, as torch)."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if size == 0:
            return 0
        rounded = self.config.round_size(size)
        small = self.config.is_small(rounded)
        block = self._best_fit(rounded, stream, small)
        if block is None:
            block = self._grow(rounded, stream, small)
            if block is None:
                self.release_cached()
                self.num_alloc_retries += 1
                block = self._grow(rounded, stream, small)
            if block is None:
                self.num_ooms += 1
                raise SimulatedOutOfMemory(rounded, self._reserved, self.config.cap_bytes)
        return self._hand_out(block, rounded)

    def free(self, address: int) -> None:
        """Return a block to its pool, merged with its free neighbours; nothing goes back to the device."""
        if address == 0:
            return
        block = self._live.pop(address)
        block.allocated = False
        self._allocated -= block.size
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._pools[block.segment.small].add(block)

    def release_cached(self) -> int:
        """`torch.cuda.empty_cache()`: free every wholly free segment, unmap whole free pages; the bytes released."""
        before = self._reserved
        for small in (False, True):
            pool = self._pools[small]
            to_unmap = []
            for _, _, address in list(pool.free):
                block = pool.by_address[address]
                if block.segment.expandable:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    pool.remove(block)
                    self._segments.remove(block.segment)
                    self._reserved -= block.size
                    self.num_device_frees += 1
            for block in to_unmap:
                self._unmap(block)
        return before - self._reserved

    def reserved_after_release_bytes(self) -> int:
        """The reserved bytes `release_cached` would leave: the floor the live blocks hold under any cap."""
        by_segment: dict[int, list[tuple[int, int]]] = {}
        for block in self._live.values():
            by_segment.setdefault(id(block.segment), []).append((block.address, block.size))
        total = 0
        for segment in self._segments:
            live = by_segment.get(id(segment), [])
            if segment.expandable:
                total += touched_page_bytes(live, segment.page, segment.address)
            elif live:
                total += segment.size
        return total

    def snapshot(self) -> list[dict[str, Any]]:
        """The segments as `torch.cuda.memory_snapshot` lists them (expandable: one per mapped range)."""
        pooled = [b for pool in self._pools.values() for b in pool.by_address.values() if b.mapped]
        out: list[dict[str, Any]] = []
        for block in sorted([*self._live.values(), *pooled], key=lambda b: b.address):
            if block.prev is None or not block.prev.mapped:
                segment = block.segment
                kind = "small" if segment.small else "large"
                out.append(
                    {
                        "address": block.address,
                        "total_size": 0,
                        "stream": segment.stream,
                        "segment_type": kind,
                        "is_expandable": segment.expandable,
                        "blocks": [],
                    }
                )
            out[-1]["total_size"] += block.size
            out[-1]["blocks"].append([block.size, "active_allocated" if block.allocated else "inactive"])
        return out

    def _best_fit(self, rounded: int, stream: int, small: bool) -> _Block | None:
        pool = self._pools[small]
        keys = pool.free
        i = bisect.bisect_left(keys, (stream, rounded, 0))
        if i == len(keys) or keys[i][0] != stream:
            return None
        block = pool.by_address[keys[i][2]]
        # An expandable block ranks by its size plus the unmapped space after it: a growable tail is passed over.
        while block.segment.expandable and i + 1 < len(keys) and keys[i + 1][0] == stream:
            candidate = pool.by_address[keys[i + 1][2]]
            if _expandable_size(candidate) >= _expandable_size(block):
                break
            block, i = candidate, i + 1
        pool.remove(block)
        return block

    def _grow(self, rounded: int, stream: int, small: bool) -> _Block | None:
        alloc_size = self.config.allocation_size(rounded)
        if self.config.cap_bytes is not None and self._reserved + alloc_size > self.config.cap_bytes:
            return None
        if self.config.expandable:
            return self._grow_expandable(rounded, stream, small)
        segment = _Segment(self._take_address(alloc_size), alloc_size, stream, small, False, 0)
        self._segments.append(segment)
        self._reserve(alloc_size)
        return _Block(segment.address, alloc_size, segment)

    def _grow_expandable(self, rounded: int, stream: int, small: bool) -> _Block:
        pool = self._pools[small]

        def has_room(block: _Block | None) -> bool:  # the free and unmapped blocks from `block` on cover the request
            room = 0
            while room < rounded and block is not None and not block.allocated:
                room, block = room + block.size, block.next
            return room >= rounded

        candidate: _Block | None = None
        for block_stream, address in pool.unmapped[bisect.bisect_left(pool.unmapped, (stream, 0)) :]:
            if block_stream != stream:
                break
            start = pool.by_address[address]
            if start.prev is not None and not start.prev.allocated:
                start = start.prev  # a free mapped tail grows into the unmapped space after it
            if has_room(start):
                candidate = start
                break
        if candidate is None:
            page = self.config.page_bytes(small)
            va_bytes = -(-self.config.expandable_va_bytes // page) * page
            segment = _Segment(self._take_address(va_bytes), va_bytes, stream, small, True, page)
            self._segments.append(segment)
            candidate = self._new_block(segment, segment.address, va_bytes, None, mapped=False)
        if not candidate.mapped:
            candidate = self._map(candidate, min(candidate.size, rounded))
        while candidate.size < rounded:
            assert candidate.next is not None
            candidate = self._map(candidate.next, min(rounded - candidate.size, candidate.next.size))
        pool.remove(candidate)
        return candidate

    def _map(self, block: _Block, size: int) -> _Block:
        segment, pool = block.segment, self._pools[block.segment.small]
        mapped = -(-size // segment.page) * segment.page
        pool.remove(block)
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, segment, mapped=False)
            _link(block, rest, block.next)
            pool.add(rest)
            block.size = mapped
        block.mapped = True
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.add(block)
        self._reserve(mapped)
        return block

    def _unmap(self, block: _Block) -> None:
        segment, pool, end = block.segment, self._pools[block.segment.small], block.end
        low = segment.address + -(-(block.address - segment.address) // segment.page) * segment.page
        high = segment.address + (end - segment.address) // segment.page * segment.page
        if low >= high:
            return
        pool.remove(block)
        if low > block.address:
            before = _Block(block.address, low - block.address, segment)
            _link(block.prev, before, block)
            pool.add(before)
        if high < end:
            after = _Block(high, end - high, segment)
            _link(block, after, block.next)
            pool.add(after)
        block.address, block.size, block.mapped = low, high - low, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._reserved -= high - low
        self.num_device_frees += 1
        if block.prev is None and block.next is None:
            self._segments.remove(segment)
        else:
            pool.add(block)

    def _merge(self, block: _Block, other: _Block | None) -> None:
        """Absorb `other`, a neighbour of `block` (which is in no pool), if it is free in the same mapped state."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        self._pools[other.segment.small].remove(other)
        if other is block.prev:
            block.address = other.address
            _link(other.prev, block, block.next)
        else:
            _link(block.prev, block, other.next)
        block.size += other.size

    def _hand_out(self, block: _Block, rounded: int) -> int:
        remaining = block.size - rounded
        if block.segment.small or self.config.expandable:
            split = remaining >= self.config.min_block_size
        else:  # the large pool keeps remainders of up to 1 MiB inside the block
            split = remaining > self.config.small_size
        if split:
            rest = _Block(block.address + rounded, remaining, block.segment)
            _link(block, rest, block.next)
            self._pools[block.segment.small].add(rest)
            block.size = rounded
        block.allocated = True
        self._live[block.address] = block
        self._allocated += block.size
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        return block.address

    def _reserve(self, nbytes: int) -> None:
        self._reserved += nbytes
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self.num_device_allocs += 1

    def _take_address(self, size: int) -> int:
        address = self._next_address
        self._next_address = -(-(address + size) // (2 * MiB)) * (2 * MiB)
        return address


def touched_page_bytes(live_blocks: Iterable[tuple[int, int]], page_bytes: int, base: int = 0) -> int:
    """Bytes of the pages (aligned to `base`) that the live (address, size) blocks touch.

    What an expandable segment keeps mapped after a release: no cap below it can be met.
    """
    spans = sorted(((a - base) // page_bytes, (a + s - 1 - base) // page_bytes) for a, s in live_blocks if s > 0)
    pages, reach = 0, -1
    for first, last in spans:
        first = max(first, reach + 1)
        if last >= first:
            pages += last - first + 1
            reach = last
    return pages * page_bytes


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What a replayed trace did in the model, next to what the real allocator did."""

    allocations: int
    same_address: int  # allocations the model placed where the real allocator did
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    growth_events: int  # cudaMalloc'd segments plus page mappings
    ooms: int
    segments_after: tuple[dict[str, Any], ...]

    @property
    def match_rate(self) -> float:
        return self.same_address / self.allocations if self.allocations else 1.0


def replay(
    events: Iterable[Sequence[Any]],
    config: AllocatorConfig | None = None,
    segments_before: Iterable[Mapping[str, Any]] | None = None,
) -> ReplayResult:
    """Feed a trace's `alloc` and `free_completed` events ([action, address, size, stream]) to the model.

    Real addresses are mapped to the model's; frees of blocks the model never saw (or could not place) are skipped.
    """
    model = CachingAllocatorModel.from_segments(segments_before or (), config)
    to_model = {address: address for address in model.live_blocks()}
    growth_before = model.num_device_allocs
    allocations = same_address = ooms = 0
    for action, address, size, stream in events:
        if action == "alloc":
            allocations += 1
            try:
                placed = model.malloc(size, stream)
            except SimulatedOutOfMemory:
                ooms += 1
                continue
            same_address += placed == address
            to_model[address] = placed
        elif action == "free_completed" and address in to_model:
            model.free(to_model.pop(address))
    return ReplayResult(
        allocations=allocations,
        same_address=same_address,
        peak_allocated_bytes=model.peak_allocated_bytes,
        peak_reserved_bytes=model.peak_reserved_bytes,
        growth_events=model.num_device_allocs - growth_before,
        ooms=ooms,
        segments_after=tuple(model.snapshot()),
    )


def predict_peak_reserved(
    events: Iterable[tuple[Hashable, int | None]],
    config: AllocatorConfig | None = None,
    segments_before: Iterable[Mapping[str, Any]] | None = None,
    *,
    stream: int = 0,
) -> int:
    """The reserved peak of a sequence of `(key, nbytes)` allocations and `(key, None)` frees.

    Starts from an empty allocator or `segments_before` (whose live blocks are keyed by their address);
    raises `SimulatedOutOfMemory` if a cap cannot be met.
    """
    model = CachingAllocatorModel.from_segments(segments_before or (), config)
    addresses: dict[Hashable, int] = {address: address for address in model.live_blocks()}
    for key, nbytes in events:
        if nbytes is None:
            model.free(addresses.pop(key))
        else:
            addresses[key] = model.malloc(nbytes, stream)
    return model.peak_reserved_bytes
