"""The caching-allocator model: exact bytes on tiny sequences, and the real allocator's choices on H200 traces."""

from __future__ import annotations

import bisect
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from dpcs_compiler.cost.allocator import (
    AllocatorConfig,
    CachingAllocatorModel,
    SimulatedOutOfMemory,
    predict_peak_reserved,
    replay,
    touched_page_bytes,
)

MiB = 1 << 20
BASE = 1 << 34
DATA = Path(__file__).parent / "data" / "h200_allocator"
TRACES = sorted(p for p in DATA.glob("*.json.gz") if not p.name.startswith("history_"))  # one step each
EXPANDABLE = AllocatorConfig(expandable=True)


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def layout(segments: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Segments as comparable tuples: blocks as (size, state), the stale requested sizes dropped."""
    return [
        (s["address"], s["total_size"], s["stream"], s["segment_type"], s["is_expandable"])
        + tuple((b[0], b[-1]) for b in s["blocks"])
        for s in segments
    ]


def segment(blocks: list[tuple[int, str]], address: int = BASE, kind: str = "large", expandable: bool = False):
    return {
        "address": address,
        "total_size": sum(size for size, _ in blocks),
        "stream": 0,
        "segment_type": kind,
        "is_expandable": expandable,
        "blocks": [[size, state] for size, state in blocks],
    }


def true_peak_reserved(trace: dict[str, Any]) -> int:
    """The real reserved peak: the starting segments plus the trace's segment events."""
    reserved = peak = sum(s["total_size"] for s in trace["segments_before"])
    for action, _, size, _ in trace["events"]:
        reserved += {"segment_alloc": size, "segment_map": size, "segment_free": -size, "segment_unmap": -size}.get(
            action, 0
        )
        peak = max(peak, reserved)
    return peak


def true_peak_allocated(trace: dict[str, Any]) -> int:
    """The real allocated peak, placed by the trace's own addresses.

    A free region is one block (free neighbours merge), so the block handed out at an address runs to the next
    live block or the segment's end; the large default pool keeps a remainder of up to 1 MiB inside it.
    """
    config = AllocatorConfig(expandable=trace["expandable"])
    segments = sorted((s["address"], s["total_size"], s["segment_type"] == "small") for s in trace["segments_before"])
    live: dict[int, int] = {}
    for s in trace["segments_before"]:
        address = s["address"]
        for size, _, state in s["blocks"]:
            if state != "inactive":
                live[address] = size
            address += size
    starts = sorted(live)
    allocated = peak = sum(live.values())
    for action, address, size, _ in trace["events"]:
        if action == "alloc":
            seg_address, seg_size, small = segments[bisect.bisect_right(segments, (address, 1 << 62, True)) - 1]
            i = bisect.bisect_right(starts, address)
            region_end = min(seg_address + seg_size, starts[i] if i < len(starts) else 1 << 62)
            rounded = config.round_size(size)
            remainder = region_end - address - rounded
            assert remainder >= 0
            keep = remainder < 512 if small or config.expandable else remainder <= MiB
            live[address] = rounded + remainder if keep else rounded
            bisect.insort(starts, address)
            allocated += live[address]
            peak = max(peak, allocated)
        elif action == "free_completed":
            allocated -= live.pop(address)
            starts.remove(address)
    return peak


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_replay_matches_the_real_allocator(path: Path) -> None:
    trace = load(path)
    result = replay(trace["events"], AllocatorConfig(expandable=trace["expandable"]), trace["segments_before"])
    assert result.allocations == sum(event[0] == "alloc" for event in trace["events"])
    assert result.same_address == result.allocations, f"{result.match_rate:.2%} at the real addresses"
    assert result.peak_reserved_bytes == true_peak_reserved(trace)
    assert result.peak_allocated_bytes == true_peak_allocated(trace)
    assert (result.growth_events, result.ooms) == (0, 0)
    assert layout(list(result.segments_after)) == layout(trace["segments_after"])


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_predicted_peak_and_release_floor_on_real_layouts(path: Path) -> None:
    trace = load(path)
    config = AllocatorConfig(expandable=trace["expandable"])
    keys: dict[int, Any] = {}
    sequence: list[tuple[Any, int | None]] = []
    for i, (action, address, size, _) in enumerate(trace["events"]):
        if action == "alloc":
            keys[address] = i
            sequence.append((i, size))
        elif action == "free_completed":
            sequence.append((keys.pop(address, address), None))  # blocks from before the step: their address
    assert predict_peak_reserved(sequence, config, trace["segments_before"]) == true_peak_reserved(trace)

    model = CachingAllocatorModel.from_segments(trace["segments_before"], config)
    assert layout(model.snapshot()) == layout(trace["segments_before"])
    floor = model.reserved_after_release_bytes()
    assert model.release_cached() == model.peak_reserved_bytes - floor
    assert model.reserved_bytes == floor
    if trace["expandable"]:
        live = model.live_blocks().items()
        assert floor == sum(
            touched_page_bytes(
                [b for b in live if s["address"] <= b[0] < s["address"] + s["total_size"]],
                config.page_bytes(s["segment_type"] == "small"),
                s["address"],
            )
            if s["is_expandable"]  # (dpcs's run: the parameters' segments were made before it turned them on)
            else s["total_size"] * any(s["address"] <= b[0] < s["address"] + s["total_size"] for b in live)
            for s in trace["segments_before"]
        )


@pytest.mark.parametrize(
    "size, rounded, reserved, allocated, kind",
    [
        (1, 512, 2 * MiB, 512, "small"),
        (512, 512, 2 * MiB, 512, "small"),
        (513, 1024, 2 * MiB, 1024, "small"),
        (MiB, MiB, 2 * MiB, MiB, "small"),
        (MiB + 1, MiB + 512, 20 * MiB, MiB + 512, "large"),
        (10 * MiB - 512, 10 * MiB - 512, 20 * MiB, 10 * MiB - 512, "large"),
        (10 * MiB, 10 * MiB, 10 * MiB, 10 * MiB, "large"),
        (10 * MiB + 1, 10 * MiB + 512, 12 * MiB, 10 * MiB + 512, "large"),
        (19 * MiB - 512, 19 * MiB - 512, 20 * MiB, 19 * MiB - 512, "large"),  # remainder 1 MiB + 512: split
        (19 * MiB + 1, 19 * MiB + 512, 20 * MiB, 20 * MiB, "large"),  # remainder below 1 MiB: kept
        (19 * MiB, 19 * MiB, 20 * MiB, 20 * MiB, "large"),  # remainder exactly 1 MiB: kept
    ],
)
def test_rounding_pool_segment_size_and_large_split(size, rounded, reserved, allocated, kind) -> None:
    assert AllocatorConfig().round_size(size) == rounded
    model = CachingAllocatorModel()
    model.malloc(size)
    assert (model.reserved_bytes, model.allocated_bytes) == (reserved, allocated)
    assert model.snapshot()[0]["segment_type"] == kind


def test_small_pool_splits_remainders_of_512_bytes() -> None:
    model = CachingAllocatorModel()
    a = model.malloc(MiB)
    assert model.malloc(MiB - 512) == a + MiB
    assert model.malloc(1) == a + 2 * MiB - 512
    assert (model.reserved_bytes, model.allocated_bytes) == (2 * MiB, 2 * MiB)


@pytest.mark.parametrize("config, allocated", [(AllocatorConfig(), 20 * MiB), (EXPANDABLE, 19 * MiB)])
def test_expandable_splits_large_remainders_of_512_bytes(config: AllocatorConfig, allocated: int) -> None:
    model = CachingAllocatorModel(config)
    model.malloc(19 * MiB)
    assert (model.reserved_bytes, model.allocated_bytes) == (20 * MiB, allocated)


def test_best_fit_takes_the_smallest_block_then_the_lowest_address() -> None:
    free_4, live_2, free_3 = (4 * MiB, "inactive"), (2 * MiB, "active_allocated"), (3 * MiB, "inactive")
    model = CachingAllocatorModel.from_segments(
        [segment([free_4, live_2, free_3, live_2, free_3, (6 * MiB, "active_allocated")])]
    )
    assert (model.reserved_bytes, model.allocated_bytes) == (20 * MiB, 10 * MiB)
    assert model.malloc(3 * MiB) == BASE + 6 * MiB
    assert model.malloc(3 * MiB - 512) == BASE + 11 * MiB  # the 512 B left is kept in the block
    assert model.malloc(2 * MiB) == BASE  # the 4 MiB block, split
    assert model.malloc(2 * MiB) == BASE + 2 * MiB
    assert (model.reserved_bytes, model.allocated_bytes) == (20 * MiB, 20 * MiB)


def test_blocks_are_reused_only_on_their_stream() -> None:
    model = CachingAllocatorModel()
    a = model.malloc(5 * MiB, stream=1)
    model.free(a)
    assert model.malloc(5 * MiB, stream=0) != a
    assert model.reserved_bytes == 40 * MiB
    assert model.malloc(5 * MiB, stream=1) == a


def test_free_merges_neighbours_and_release_returns_whole_segments() -> None:
    model = CachingAllocatorModel()
    a, b, c = (model.malloc(5 * MiB) for _ in range(3))
    assert (b, c) == (a + 5 * MiB, a + 10 * MiB)
    live, free = "active_allocated", "inactive"
    model.free(b)
    assert model.snapshot()[0]["blocks"] == [[5 * MiB, live], [5 * MiB, free], [5 * MiB, live], [5 * MiB, free]]
    model.free(a)
    assert model.snapshot()[0]["blocks"] == [[10 * MiB, free], [5 * MiB, live], [5 * MiB, free]]
    assert model.release_cached() == 0
    model.free(c)
    assert model.snapshot()[0]["blocks"] == [[20 * MiB, free]]
    assert model.release_cached() == 20 * MiB
    assert (model.reserved_bytes, model.peak_reserved_bytes, model.snapshot()) == (0, 20 * MiB, [])


def test_a_cap_releases_cached_segments_then_retries_then_raises() -> None:
    model = CachingAllocatorModel(AllocatorConfig(cap_bytes=30 * MiB))
    model.free(model.malloc(5 * MiB))  # a cached 20 MiB segment
    model.free(model.malloc(100))  # a cached 2 MiB small segment
    model.malloc(22 * MiB)  # 22 + 22 MiB > cap: both cached segments go, then it fits
    assert (model.num_alloc_retries, model.reserved_bytes, model.peak_reserved_bytes) == (1, 22 * MiB, 22 * MiB)
    with pytest.raises(SimulatedOutOfMemory):
        model.malloc(10 * MiB)  # 22 + 10 MiB > cap with nothing left to release
    assert (model.num_alloc_retries, model.num_ooms) == (2, 1)
    assert (model.reserved_bytes, model.allocated_bytes) == (22 * MiB, 22 * MiB)


def test_expandable_growth_maps_whole_pages_at_the_end() -> None:
    model = CachingAllocatorModel(EXPANDABLE)
    a = model.malloc(30 * MiB)
    assert (model.reserved_bytes, model.allocated_bytes) == (40 * MiB, 30 * MiB)  # ceil(30 / 20) pages
    assert model.malloc(25 * MiB) == a + 30 * MiB  # the 10 MiB free tail plus one more page, not two
    assert model.reserved_bytes == 60 * MiB
    model.malloc(100)
    assert (model.reserved_bytes, model.num_device_allocs) == (62 * MiB, 3)  # a 2 MiB small page


def test_expandable_free_stays_mapped_until_release_which_unmaps_whole_free_pages() -> None:
    model = CachingAllocatorModel(EXPANDABLE)
    a, b, c = model.malloc(30 * MiB), model.malloc(15 * MiB), model.malloc(20 * MiB)  # [0, 30) [30, 45) [45, 65)
    assert (b, c, model.reserved_bytes) == (a + 30 * MiB, a + 45 * MiB, 80 * MiB)
    model.free(b)
    assert model.reserved_bytes == 80 * MiB
    assert model.release_cached() == 0  # [30, 45) and the tail [65, 80) hold no whole page
    model.free(a)
    assert model.reserved_after_release_bytes() == 40 * MiB == touched_page_bytes([(c, 20 * MiB)], 20 * MiB, a)
    assert model.release_cached() == 40 * MiB  # pages [0, 20) and [20, 40)
    assert layout(model.snapshot()) == layout(
        [
            segment(
                [(5 * MiB, "inactive"), (20 * MiB, "active_allocated"), (15 * MiB, "inactive")],
                a + 40 * MiB,
                expandable=True,
            )
        ]
    )
    assert model.malloc(30 * MiB) == a  # growth refills the lowest unmapped address first
    assert model.reserved_bytes == 80 * MiB


def test_expandable_ranges_of_a_snapshot_share_one_address_space() -> None:
    live = [(20 * MiB, "active_allocated")]
    ranges = [segment(live, BASE, expandable=True), segment(live, BASE + 60 * MiB, expandable=True)]
    model = CachingAllocatorModel.from_segments(ranges, EXPANDABLE)
    assert model.malloc(30 * MiB) == BASE + 20 * MiB  # into the gap, not after the last range
    assert model.reserved_bytes == 80 * MiB
    assert model.snapshot()[0]["blocks"] == [[20 * MiB, "active_allocated"], [30 * MiB, "active_allocated"]] + [
        [10 * MiB, "inactive"],
        [20 * MiB, "active_allocated"],
    ]
    assert model.malloc(25 * MiB) == BASE + 80 * MiB  # then at the end of the last range
    with pytest.raises(ValueError, match="expandable"):
        CachingAllocatorModel.from_segments(ranges)


def test_expandable_best_fit_passes_over_the_growable_tail() -> None:
    model = CachingAllocatorModel(EXPANDABLE)
    a = model.malloc(12 * MiB)
    model.malloc(8 * MiB)  # the rest of the first page
    model.malloc(30 * MiB)  # two more pages: a 10 MiB free tail
    model.free(a)  # a 12 MiB free block
    assert model.malloc(9 * MiB) == a  # not the 10 MiB tail: its "expandable size" counts the unmapped space


def test_touched_page_bytes() -> None:
    assert touched_page_bytes([], 2 * MiB) == 0
    assert touched_page_bytes([(0, 1), (1, 1)], 2 * MiB) == 2 * MiB
    assert touched_page_bytes([(0, 1), (2 * MiB - 1, 2)], 2 * MiB) == 4 * MiB
    assert touched_page_bytes([(5 + 19 * MiB, 2 * MiB), (5 + 20 * MiB, MiB)], 20 * MiB, base=5) == 40 * MiB


def test_predict_peak_reserved() -> None:
    events: list[tuple[str, int | None]] = [("a", 5 * MiB), ("b", 100), ("a", None), ("c", 12 * MiB)]
    assert predict_peak_reserved(events) == 22 * MiB  # c reuses a's 20 MiB segment
    assert predict_peak_reserved([*events, ("d", 12 * MiB)]) == 34 * MiB  # 8 MiB are left there: a new segment
    assert predict_peak_reserved([*events, ("d", 12 * MiB)], EXPANDABLE) == 42 * MiB  # a's page, one more for d
    with pytest.raises(SimulatedOutOfMemory):
        predict_peak_reserved(events, AllocatorConfig(cap_bytes=20 * MiB))


GiB = 2**30


@pytest.mark.parametrize("name, expandable, within", [("history_compile_steps0-4", False, 0.005),
                                                       ("history_dpcs_12GiB_steps0-4", True, 0.0)])
def test_from_an_empty_allocator_the_model_reserves_what_the_gpu_did_over_a_whole_run(name, expandable, within):
    """Whole runs from the process's start (model, compile, steps 0-4 of the 439M Llama on the H200): the
    model, given the allocation sequence alone, reaches the reserved peak the real allocator reached
    (torch.compile with the default allocator: 16.13 GiB against 16.19, the 64 MiB it misses being made
    outside the recorded history; dpcs at 12 GiB, which turns expandable segments on at its first compile:
    12.238 GiB exactly) and the allocated peak."""
    trace = load(DATA / f"{name}.json.gz")
    real_reserved = true_peak_reserved(trace)
    result = replay(trace["events"], AllocatorConfig(expandable=expandable))
    assert abs(result.peak_reserved_bytes / real_reserved - 1) <= within, (result.peak_reserved_bytes, real_reserved)
    level = peak = 0
    for action, _, size, _ in trace["events"]:  # requested sizes, rounded: the large pool's unsplit rests aside
        level += {"alloc": 1, "free_completed": -1}.get(action, 0) * -(-size // 512) * 512
        peak = max(peak, level)
    assert result.peak_allocated_bytes == pytest.approx(peak, rel=1e-3)


def test_under_a_cap_at_the_budget_the_dpcs_run_fits_by_giving_back_cached_pages_once_a_step():
    """The dpcs run at a 12 GiB budget reserved 12.24 GiB uncapped (cached pages of freed blocks); under a cap
    at 12 GiB the allocator gives free pages back instead: no out-of-memory error, one release a step after
    the first, and below 11.95 GiB the same steps run out of memory."""
    trace = load(DATA / "history_dpcs_12GiB_steps0-4.json.gz")
    fits = replay(trace["events"], AllocatorConfig(expandable=True, cap_bytes=12 * GiB))
    assert fits.ooms == 0 and fits.peak_reserved_bytes <= 12 * GiB
    assert replay(trace["events"], AllocatorConfig(expandable=True, cap_bytes=int(11.8 * GiB))).ooms > 0
