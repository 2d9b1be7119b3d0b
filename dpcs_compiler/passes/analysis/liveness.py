"""When every value and every buffer of a step is alive, across the forward/backward boundary.

Positions are indices into `Schedule.nodes`. A value is born at its producer (BEFORE_STEP for resident
inputs, the first backward node for tangents) and lives through its last use; values the step hands back
(user outputs, gradients, also a forward value the backward returns unchanged) live to AFTER_STEP. A forward
value received by backward lives through its last backward use, and at least until backward starts
(autograd holds saved tensors until then; AFTER_STEP when the backward computes nothing). A buffer lives as
long as any value that points into it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from dpcs_compiler.passes.analysis.base import require
from dpcs_compiler.passes.analysis.fusion import is_pointwise
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
    reuses: dict[Buffer, Buffer]  # new buffer -> the dying input buffer it is written over, in place

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

    allocations: dict[fx.Node, tuple[Buffer, ...]] = {}
    references: dict[fx.Node, tuple[Buffer, ...]] = {}

    def translate(buffers: tuple[Buffer, ...]) -> tuple[Buffer, ...]:
        # A buffer "made" by a backward placeholder that receives a forward value is that value's buffer;
        # one "made" by a fused node does not exist: it stands for the buffers that node reads.
        out: list[Buffer] = []
        for b in buffers:
            if b.producer in schedule.receives:
                source = schedule.receives[b.producer]
                out.extend(references.get(source) or sizes[source.graph.owning_module].references[source])
            elif b.producer in schedule.fused:
                out.extend(references[b.producer])
            else:
                out.append(b)
        return tuple(dict.fromkeys(out))

    for gm, analysis in sizes.items():
        for node, buffers in analysis.allocations.items():  # graph order: inputs before their users
            if node in schedule.fused:
                # Computed inside its readers' kernels: no buffer; it keeps its inputs' buffers alive instead.
                allocations[node] = ()
                references[node] = tuple(
                    dict.fromkeys(b for arg in node.all_input_nodes for b in references.get(arg, ()))
                )
                continue
            allocations[node] = () if node in schedule.receives else buffers
            references[node] = translate(analysis.references[node])

    # Uses of a value, counting the uses of every backward placeholder that receives it.
    uses: dict[fx.Node, list[int]] = {node: [] for node in position}
    for node in schedule.nodes:
        for arg in node.all_input_nodes:
            uses.setdefault(schedule.source(arg), []).append(position[node])

    # A value the backward returns as it received it (a gradient the forward computed) is live out too.
    live_out = schedule.live_out | {schedule.source(n) for n in schedule.live_out}
    backward_starts = first_backward if first_backward is not None else after_step
    resident = frozenset(schedule.resident)
    values: dict[fx.Node, Interval] = {}
    for node, start in position.items():
        if node in schedule.receives:
            continue
        end = max(uses.get(node, []), default=start)
        if node in schedule.saved:
            end = max(end, backward_starts)
        if node in live_out or node in resident:
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
    reuses = _in_place_reuses(schedule, sizes, buffers, allocations, references) if schedule.reuses_dying_inputs else {}
    return Liveness(
        schedule=schedule,
        reuses=reuses,
        values=values,
        buffers=buffers,
        allocations=allocations,
        references=references,
        sizes=sizes,
    )


def _in_place_reuses(
    schedule: Schedule,
    sizes: dict[fx.GraphModule, TensorBytes],
    buffers: dict[Buffer, Interval],
    allocations: dict[fx.Node, tuple[Buffer, ...]],
    references: dict[fx.Node, tuple[Buffer, ...]],
) -> dict[Buffer, Buffer]:
    """Pointwise results that take over an input buffer of equal size and dtype dying at the same node.

    Inductor's `can_match_buffer_size` asks for the same dtype too: a cast between two dtypes of one width
    (float32 to int32) allocates its result.
    """
    def size(b: Buffer) -> int:
        return sizes[b.producer.graph.owning_module].hint(b.size)

    def dtype(b: Buffer) -> Any:
        value = b.producer.meta["val"]
        return (value if b.index is None else value[b.index]).dtype

    reuses: dict[Buffer, Buffer] = {}
    taken: set[Buffer] = set()
    for i, node in enumerate(schedule.nodes):
        made = allocations.get(node, ())
        if len(made) != 1 or not is_pointwise(node):
            continue
        candidates = [
            b
            for arg in node.all_input_nodes
            for b in references.get(arg, ())
            if b in buffers
            and b not in taken
            and buffers[b].end == i
            and buffers[b].start != BEFORE_STEP
            and b.producer not in schedule.late_input_set
            and size(b) == size(made[0])
            and dtype(b) == dtype(made[0])
        ]
        if candidates:
            reuses[made[0]] = candidates[0]
            taken.add(candidates[0])
    return reuses
