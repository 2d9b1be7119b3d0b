"""When every value and every buffer of a step is alive, across the forward/backward boundary.

Positions are indices into `Schedule.nodes`. A value is born at its producer (BEFORE_STEP for resident
inputs, the first backward node for tangents) and lives through its last use; values the step hands back
(user outputs, gradients) live to AFTER_STEP. A forward value received by backward lives through its last
backward use, and at least until backward starts (autograd holds saved tensors until then). A buffer lives
as long as any value that points into it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from dpcs_compiler.passes.analysis.base import require
from dpcs_compiler.passes.analysis.schedule import Schedule
from dpcs_compiler.passes.analysis.tensor_bytes import Buffer, TensorBytes, tensor_bytes

BEFORE_STEP = -1


@dataclasses.dataclass(frozen=True)
class Interval:
    """Alive from schedule position `start` through `end`, both inclusive."""

    start: int
    end: int


@dataclasses.dataclass(frozen=True, eq=False)
class Liveness:
    schedule: Schedule
    values: dict[fx.Node, Interval]
    buffers: dict[Buffer, Interval]
    allocations: dict[fx.Node, tuple[Buffer, ...]]
    references: dict[fx.Node, tuple[Buffer, ...]]
    sizes: dict[fx.GraphModule, TensorBytes]

    @property
    def after_step(self) -> int:
        return len(self.schedule.nodes)

    def hint(self, buffer: Buffer) -> int:
        return self.sizes[buffer.producer.graph.owning_module].hint(buffer.size)


def liveness(schedule: Schedule, analyses: Any | None = None) -> Liveness:
    """The analysis: value and buffer intervals over a schedule."""
    sizes = {gm: require(analyses, tensor_bytes, gm) for gm in schedule.graphs}
    after_step = len(schedule.nodes)
    position = {node: i for i, node in enumerate(schedule.nodes)}
    first_backward = schedule.first_backward_index
    for node in schedule.resident:
        position[node] = BEFORE_STEP
    for node in schedule.late_inputs:
        position[node] = first_backward if first_backward is not None else after_step

    def translate(buffers: tuple[Buffer, ...]) -> tuple[Buffer, ...]:
        # A buffer "made" by a backward placeholder that receives a forward value is that value's buffer.
        out: list[Buffer] = []
        for b in buffers:
            source = schedule.receives.get(b.producer)
            if source is None:
                out.append(b)
            else:
                out.extend(sizes[source.graph.owning_module].references[source])
        return tuple(out)

    allocations: dict[fx.Node, tuple[Buffer, ...]] = {}
    references: dict[fx.Node, tuple[Buffer, ...]] = {}
    for gm, analysis in sizes.items():
        for node, buffers in analysis.allocations.items():
            allocations[node] = () if node in schedule.receives else buffers
            references[node] = translate(analysis.references[node])

    # Uses of a value, counting the uses of every backward placeholder that receives it.
    uses: dict[fx.Node, list[int]] = {node: [] for node in position}
    for node in schedule.nodes:
        for arg in node.all_input_nodes:
            uses.setdefault(schedule.source(arg), []).append(position[node])

    values: dict[fx.Node, Interval] = {}
    for node, start in position.items():
        if node in schedule.receives:
            continue
        end = max(uses.get(node, []), default=start)
        if node in schedule.saved and first_backward is not None:
            end = max(end, first_backward)
        if node in schedule.live_out or (node in schedule.resident):
            end = after_step
        values[node] = Interval(start, max(start, end))

    buffers: dict[Buffer, Interval] = {}
    for node, interval in values.items():
        for buffer in allocations.get(node, ()):
            buffers[buffer] = Interval(interval.start, interval.start)
    for node, interval in values.items():
        for buffer in references.get(node, ()):
            if buffer in buffers:
                buffers[buffer] = Interval(buffers[buffer].start, max(buffers[buffer].end, interval.end))
    return Liveness(
        schedule=schedule,
        values=values,
        buffers=buffers,
        allocations=allocations,
        references=references,
        sizes=sizes,
    )
