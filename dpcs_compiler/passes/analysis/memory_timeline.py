"""Simulated live bytes after each node of a step, and the peak.

The simulation walks the schedule: before a node runs, every buffer alive before it is counted; while it
runs, the buffers it makes are added (its inputs are still alive: the peak is taken here); after it runs,
buffers whose last use it was are freed. Buffers are sorted into categories (parameters, inputs, saved
activations, gradients, user outputs, temporaries, and the workspace a node's kernel allocates inside itself
while it runs, `Schedule.workspace`) so a peak can be explained. Sizes use trace-time hints.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from dpcs_compiler.passes.analysis.base import require
from dpcs_compiler.passes.analysis.liveness import BEFORE_STEP, Liveness, liveness
from dpcs_compiler.passes.analysis.schedule import FORWARD, Schedule
from dpcs_compiler.passes.analysis.tensor_bytes import Buffer

CATEGORIES = ("parameter", "input", "saved", "gradient", "output", "temporary", "workspace")


@dataclasses.dataclass(frozen=True)
class TimelineStep:
    """Memory around one node: `during` while it runs (inputs and outputs alive), `after` once it frees."""

    node: str
    phase: str
    during: int
    after: int
    by_category: dict[str, int]  # bytes alive during the node, per category


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
    steps: tuple[TimelineStep, ...]
    resident_bytes: int  # bytes alive before the step starts (parameters and inputs)

    @property
    def peak_bytes(self) -> int:
        return max((s.during for s in self.steps), default=self.resident_bytes)

    @property
    def peak_index(self) -> int:
        return max(range(len(self.steps)), key=lambda i: self.steps[i].during, default=-1)

    @property
    def peak_step(self) -> TimelineStep | None:
        return self.steps[self.peak_index] if self.steps else None

    def to_json(self) -> dict:
        return {
            "resident_bytes": self.resident_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_step.node if self.peak_step else None,
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }


def buffer_categories(live: Liveness) -> dict[Buffer, str]:
    """Sort each buffer into one of CATEGORIES."""
    schedule = live.schedule
    first_backward = schedule.first_backward_index
    referenced_by_grad = {b for n in schedule.gradients for b in live.references.get(n, ())}
    referenced_by_output = {
        b for n in schedule.live_out - schedule.gradients for b in live.references.get(schedule.source(n), ())
    }
    categories = {}
    for buffer, interval in live.buffers.items():
        producer = buffer.producer
        if producer in schedule.parameters:
            category = "parameter"
        elif producer in schedule.outside:
            category = "input"
        elif buffer in referenced_by_grad:
            category = "gradient"
        elif buffer in referenced_by_output:
            category = "output"
        elif (
            first_backward is not None
            and schedule.phase[producer] == FORWARD
            and interval.end >= first_backward
        ):
            category = "saved"
        else:
            category = "temporary"
        categories[buffer] = category
    return categories


def memory_timeline(schedule: Schedule, analyses: Any | None = None) -> MemoryTimeline:
    """The analysis: simulate the schedule's live bytes node by node."""
    return simulate(require(analyses, liveness, schedule))


def simulate(live: Liveness, exclude: frozenset[Buffer] = frozenset()) -> MemoryTimeline:
    """Walk the schedule counting every buffer's bytes while it is alive, leaving out `exclude`.

    The memory planner excludes the buffers whose lifetimes a plan decides and adds them back per plan
    (`cost.memory_model`); in-place reuses still apply. An excluded buffer written over a dying counted
    one frees that one when it is made. A counted buffer written over a dying excluded one (a saved value
    at its last backward use, under every plan) is not counted at that step: the plan counts the bytes.
    """
    categories = buffer_categories(live)
    born_at: dict[int, list[Buffer]] = defaultdict(list)
    freed_after: dict[int, list[Buffer]] = defaultdict(list)
    for buffer, interval in live.buffers.items():
        if buffer in exclude:
            continue
        born_at[interval.start].append(buffer)
        freed_after[interval.end].append(buffer)
    size = {b: live.hint(b) for b in live.buffers}
    reuses = {new: old for new, old in live.reuses.items() if not (new in exclude and old in exclude)}

    alive: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    for buffer in born_at[BEFORE_STEP]:
        alive[categories[buffer]] += size[buffer]
    resident = sum(alive.values())

    reused = set(reuses.values())  # taken over in place: freed the moment their successor is made
    steps = []
    reused_by_excluded = defaultdict(list)
    for new, old in reuses.items():
        if new in exclude:
            reused_by_excluded[live.buffers[new].start].append(old)
    workspace = live.schedule.workspace
    for i, node in enumerate(live.schedule.nodes):
        for old in reused_by_excluded[i]:
            alive[categories[old]] -= size[old]
        taken_over = []
        for buffer in born_at[i]:
            alive[categories[buffer]] += size[buffer]
            if buffer in reuses:
                old = reuses[buffer]
                if old in exclude:
                    taken_over.append(buffer)
                else:
                    alive[categories[old]] -= size[old]
        during = dict(alive)
        during["workspace"] = workspace.get(node, 0)
        for buffer in taken_over:
            during[categories[buffer]] -= size[buffer]
        for buffer in freed_after[i]:
            if buffer not in reused:
                alive[categories[buffer]] -= size[buffer]
        steps.append(
            TimelineStep(
                node=node.name,
                phase=live.schedule.phase[node],
                during=sum(during.values()),
                after=sum(alive.values()),
                by_category=during,
            )
        )
    return MemoryTimeline(steps=tuple(steps), resident_bytes=resident)
