"""Renderings of a hand-made memory timeline: byte sizes, the text table with its peak, the PNG plot."""

from __future__ import annotations

import pytest

from dpcs_compiler.debug.render import format_bytes, plot_timeline, timeline_table
from dpcs_compiler.passes.analysis.memory_timeline import CATEGORIES, MemoryTimeline, TimelineStep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step(node: str, phase: str, during: int, after: int, saved: int = 0) -> TimelineStep:
    by_category = dict.fromkeys(CATEGORIES, 0) | {"parameter": 1024, "saved": saved, "temporary": during - 1024 - saved}
    return TimelineStep(node=node, phase=phase, during=during, after=after, by_category=by_category)


TIMELINE = MemoryTimeline(
    steps=(
        step("mm", "forward", 2048, 2048, saved=512),
        step("relu", "forward", 4096, 3072, saved=1024),
        step("mm_1", "backward", 3072, 1024),
    ),
    resident_bytes=1024,
)


@pytest.mark.parametrize(
    "n, text",
    [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (7072, "6.91 KiB"), (3 * 2**20, "3.00 MiB"),
     (2**30, "1.00 GiB"), (-2048, "-2.00 KiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_timeline_table_marks_the_peak_once():
    lines = timeline_table(TIMELINE).splitlines()
    assert lines[0] == "resident before the step: 1024 B (1.00 KiB); peak 4096 B (4.00 KiB) at relu"
    assert lines[1].split() == ["#", "node", "phase", "during", "after", *CATEGORIES]
    marked = [line for line in lines if "<- peak" in line]
    assert len(marked) == 1
    assert marked[0].split()[:5] == ["1", "relu", "forward", "4096", "3072"]
    assert len(lines) == 2 + len(TIMELINE.steps)


def test_timeline_table_of_an_empty_step():
    lines = timeline_table(MemoryTimeline(steps=(), resident_bytes=0)).splitlines()
    assert lines[0] == "resident before the step: 0 B (0 B); peak 0 B (0 B) at -"
    assert len(lines) == 2


@pytest.mark.parametrize("timeline", [TIMELINE, MemoryTimeline(steps=(), resident_bytes=0)], ids=["step", "empty"])
def test_plot_timeline_writes_a_png(tmp_path, timeline):
    path = plot_timeline(timeline, tmp_path / "nested" / "timeline.png", title="toy")
    assert path == tmp_path / "nested" / "timeline.png"
    assert path.read_bytes().startswith(PNG_MAGIC)
