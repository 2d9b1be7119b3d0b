"""Keep Inductor from fusing kernels across allocations in a planned graph.

Inductor fuses "horizontally" two kernels that read the same inputs, wherever they sit in the order, and
the fused kernel makes the outputs of both when the earlier one would have run. In a planned backward this
is common: a recomputed value and a later backward op that reads the same saved inputs (silu(gate) * up,
recomputed for a weight gradient, and the silu backward). The later kernel's outputs are then alive across
everything between the two, matmul outputs included, which is memory the plan did not count; torch's own
guard (`Scheduler.are_long_distant_nodes`, 64 nodes apart) does not catch nodes a few steps apart, and its
docstring names activation checkpointing as the case it was written for.

`PlannedFusionChoices` is Inductor's heuristics object (`torch._inductor.choices.InductorChoices`, the
documented hook for out-of-tree heuristics) with one more rule for horizontal fusion: refuse when the later
kernel makes outputs and any kernel between the two, in Inductor's order before fusion, allocates memory.
Fusions of neighbours are left alone. What is lost is the shared read of the common inputs (one more pass
over them by a pointwise kernel); `PartCompiler.check_schedule` still holds the resulting schedule to the
budget.

A planned graph is scheduled with the guard only where Inductor's own fusions do not fit its budget
(`scheduled_guarded_if_over`: both schedules from one lowering): where they fit, the guard buys nothing and
costs a kernel per refused fusion.

`keep_producers_apart` also refuses a producer/consumer fusion across allocations when a kernel in between
reads the producer's outputs: fused, the producer runs after everything its consumer reads, and that reader
after it, with the consumer's outputs alive (the recomputed SwiGLU product read by its weight gradient's
matmul and by the up projection's gradient, which also reads the next matmul's output: 1 MB over the lowest
plan of the bench Llama). A producer read only by its consumer still moves down to it. The same rule raises
Hugging Face GPT-2's lowest plan by 5 MB, where Inductor's reordering around those fusions holds 7 MB less
than the plan's order: which of the two schedules lower is read from Inductor's schedule of both
(`PartCompiler.lowest_scheduled_backward`), so the rule is off unless asked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

from dpcs_compiler.passes.analysis.inductor_schedule import size_hint as _size_hint

log = logging.getLogger("dpcs.fusion_guard")


def _output_bytes(node) -> int:
    """Bytes a scheduler node's outputs allocate (size hints; 0 where unknown)."""
    total = 0
    for buf in node.get_outputs():
        made = buf.node
        if not made.should_allocate():
            continue
        try:
            size = V.graph.get_allocation_storage_size(made)
        except NotImplementedError:  # a multi-output layout: its parts are allocated by their own nodes
            continue
        total += _size_hint(size) * made.get_dtype().itemsize
    return total


class PlannedFusionChoices(InductorChoices):
    """Inductor's default heuristics, less horizontal fusions across allocations and, with
    `keep_producers_apart`, producer/consumer fusions past a reader of the producer (see module docstring)."""

    def __init__(self, keep_producers_apart: bool = False, count_refusable: bool = False,
                 refuse_horizontal: bool = True) -> None:
        super().__init__()
        self._allocations: dict[int, list[int]] = {}  # id(scheduler) -> bytes allocated per pre-fusion order
        self.keep_producers_apart = keep_producers_apart
        # False: Inductor's own fusions throughout, the horizontal ones the guard would refuse counted
        # (`would_refuse_horizontal`; `scheduled_guarded_if_over`).
        self.refuse_horizontal = refuse_horizontal
        self.would_refuse_horizontal = 0
        self.refused = 0
        self.refused_vertical = 0
        # Without `keep_producers_apart`, with `count_refusable`: the producer/consumer fusions the rule would
        # have refused. None of them means the rule changes nothing here: with it, Inductor would be asked the
        # same and answer alike throughout.
        self.count_refusable = count_refusable
        self.would_refuse_vertical = 0

    def _bytes_by_order(self, scheduler) -> list[int]:
        """Bytes each node allocates, by its place in the order before fusion (read at the first call)."""
        if id(scheduler) not in self._allocations:
            subs = [sub for node in scheduler.nodes for sub in node.get_nodes()]
            by_order = [0] * (max((s.min_order for s in subs), default=-1) + 1)
            for sub in subs:
                by_order[sub.min_order] += _output_bytes(sub)
            self._allocations[id(scheduler)] = by_order
        return self._allocations[id(scheduler)]

    def can_fuse_horizontal(self, scheduler, node1, node2, shared_data_score: int) -> bool:
        if not super().can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
            return False
        early, late = (node1, node2) if node1.min_order <= node2.min_order else (node2, node1)
        if late.min_order <= early.max_order + 1:
            return True  # neighbours, or interleaved groups: nothing between them
        if self._across_allocations(scheduler, early, late):
            if not self.refuse_horizontal:
                self.would_refuse_horizontal += 1
                return True
            self.refused += 1
            return False
        return True

    def can_fuse_vertical(self, scheduler, node1, node2, shared_data_score: int) -> bool:
        if not super().can_fuse_vertical(scheduler, node1, node2, shared_data_score):
            return False
        if not (self.keep_producers_apart or self.count_refusable):
            return True
        early, late = (node1, node2) if node1.min_order <= node2.min_order else (node2, node1)
        if late.min_order <= early.max_order + 1:
            return True
        # Fused, the producer runs where its consumer can: after everything the consumer reads. A kernel in
        # between that reads the producer's outputs runs after it, with the consumer's outputs alive. Moving a
        # producer down to its only consumer frees memory; with an earlier reader it only moves it.
        names = early.get_buffer_names()
        read_between = any(
            early.max_order < user.node.min_order < late.min_order
            for buf in early.get_outputs() for user in buf.users
            if not user.is_weak and user.node.get_name() not in names and user.get_name() != "OUTPUT"
        )
        if read_between and self._across_allocations(scheduler, early, late):
            if not self.keep_producers_apart:
                self.would_refuse_vertical += 1
                return True
            self.refused += 1
            self.refused_vertical += 1
            return False
        return True

    def _across_allocations(self, scheduler, early, late) -> bool:
        """Whether a kernel between `early` and `late`, in Inductor's order before fusion, allocates memory,
        and `late` makes outputs."""
        by_order = self._bytes_by_order(scheduler)
        return sum(by_order[early.max_order + 1 : late.min_order]) > 0 and _output_bytes(late) > 0


@contextlib.contextmanager
def planned_fusion_choices(keep_producers_apart: bool = False, count_refusable: bool = False
                           ) -> Iterator[PlannedFusionChoices]:
    """Within the block, Inductor's scheduler uses `PlannedFusionChoices` on this thread."""
    choices = PlannedFusionChoices(keep_producers_apart, count_refusable)
    with V.set_choices_handler(choices):
        yield choices


def _one_lowering_schedules_alike() -> bool:
    """Whether a second scheduler made from a lowering another scheduler was made from sees the same IR.

    Not under max-autotune (the first scheduler's `finalize_multi_template_buffers` rewrites the lowered
    operations and buffers in place; `benchmark_epilogue_fusion`, on by default, acts only on its templates)
    or fusion benchmarking (fusion generates code); a graph with user-defined Triton kernels is checked where
    it is scheduled (`_schedules_alike`)."""
    config = torch._inductor.config
    return not (config.max_autotune or config.max_autotune_gemm or config.benchmark_fusion)


def _schedules_alike(graph) -> bool:
    """Whether a second scheduler made from `graph`'s lowering sees the IR the first saw
    (`_one_lowering_schedules_alike`, and no user-defined Triton kernel, whose epilogue fusion removes buffers
    by the rule)."""
    from torch._inductor import ir

    return _one_lowering_schedules_alike() and not any(
        isinstance(op, ir.UserDefinedTritonKernel) for op in graph.operations)


def _reading(probe, schedule: Callable[[Any], None], graph, choices: PlannedFusionChoices):
    """`graph` scheduled by `schedule` under `choices`, and the probe's reading of it (None if it could not
    read it: its error, if any, left on `probe.errors`)."""
    before, errors = len(probe.peaks), len(probe.errors)
    with V.set_choices_handler(choices):
        schedule(graph)
    if len(probe.peaks) != before + 1 or len(probe.errors) != errors:
        return None
    return probe.peaks[before]


@contextlib.contextmanager
def _first_graph_scheduled_by(schedule_first: Callable[[Callable[[Any], None], Any, contextlib.ExitStack], None]
                              ) -> Iterator[None]:
    """Within the block, the scheduler of the first graph Inductor generates code for (the graph
    compile_fx_inner was given; subgraphs are scheduled while it generates code) is made by
    `schedule_first(schedule, graph, handlers)`: `schedule(graph)` (re)makes it as Inductor does, under the
    choices handler in force, from the one lowering; `handlers` holds what is entered on it (the choices
    handler for the subgraphs) until the block ends. Later graphs are scheduled as Inductor does."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering._update_scheduler
    first = [True]
    handlers = contextlib.ExitStack()

    def update_scheduler(graph) -> None:
        if not first[0]:
            return original(graph)
        first[0] = False
        return schedule_first(original, graph, handlers)

    GraphLowering._update_scheduler = update_scheduler
    try:
        yield
    finally:
        GraphLowering._update_scheduler = original
        handlers.close()


@contextlib.contextmanager
def scheduled_under_each_rule(probe, choose: Callable[[dict[bool, tuple]], bool]) -> Iterator[dict[bool, tuple]]:
    """Within the block, the first graph Inductor generates code for (the graph compile_fx_inner was given;
    subgraphs are scheduled while it generates code) is scheduled from one lowering under each fusion rule:
    Inductor's fusions, counting those `keep_producers_apart` would refuse, then, where it would refuse one,
    the rule (else it schedules the same). `choose` is given the readings, {producers apart: (the probe's
    reading, the rule's `PlannedFusionChoices`)} in that order, and returns the rule whose scheduler generates
    the code (it may raise instead, which ends the compile there); the other reading is taken off `probe.peaks`.
    The rule chosen also schedules the subgraphs, until the block ends. Yields the readings.

    Lowering a graph to Inductor's IR is most of the cost of scheduling it (measured on Hugging Face GPT-2's
    12-layer backward: 2.5 s of the 3.7 s): Inductor's `GraphLowering._update_scheduler` (re)makes the
    scheduler from the lowered operations, and the fusion rules decide nothing before that. Where a second
    scheduler would not see the IR the first saw (`_one_lowering_schedules_alike`; user-defined Triton kernels,
    whose epilogue fusion removes buffers by the rule), only Inductor's fusions are scheduled. A reading the
    probe could not make (`probe.errors`) of Inductor's fusions leaves them and does not ask `choose`; one of
    the rule's is left out of the readings (logged), and its error off `probe.errors`.
    """
    readings: dict[bool, tuple] = {}

    def schedule_first(schedule, graph, handlers: contextlib.ExitStack) -> None:
        schedulers = {}
        alike = _schedules_alike(graph)
        for apart in (False, True):
            guard = PlannedFusionChoices(apart, count_refusable=not apart)
            before, errors = len(probe.peaks), len(probe.errors)
            reading = _reading(probe, schedule, graph, guard)
            schedulers[apart] = graph.scheduler
            if reading is None:
                if not apart:  # Inductor's fusions, as they are
                    return None
                log.warning("the fusion guard's schedule could not be read (%s); Inductor's fusions are kept",
                            probe.errors[errors:])
                del probe.errors[errors:], probe.peaks[before:]
                break
            readings[apart] = (reading, guard)
            if not apart and (guard.would_refuse_vertical == 0 or not alike):
                break
        chosen = choose(readings)
        if chosen not in readings:
            raise ValueError(f"scheduled_under_each_rule: choose returned {chosen!r}, not one of {list(readings)}")
        losers = [peak for apart, (peak, _) in readings.items() if apart != chosen]
        probe.peaks[:] = [p for p in probe.peaks if all(p is not loser for loser in losers)]
        graph.scheduler = schedulers[chosen]  # V.graph is `graph`: the scheduler code generation reads
        handlers.enter_context(V.set_choices_handler(readings[chosen][1]))  # for the subgraphs
        return None

    with _first_graph_scheduled_by(schedule_first):
        yield readings


@contextlib.contextmanager
def scheduled_guarded_if_over(probe, fits: Callable[[Any], bool], check: Callable[[Any], None],
                              keep_producers_apart: bool = False, *, lower: Callable[[Any, Any], bool],
                              may_improve: Callable[[Any], bool]) -> Iterator[list]:
    """Within the block, the first graph Inductor generates code for is scheduled with Inductor's own fusions,
    and with the fusion guard (`PlannedFusionChoices`) only if those hold more than the budget allows and the
    guard's schedule holds measurably less.

    The guard keeps a fused kernel from making its outputs early, at the price of one more kernel per fusion
    refused: on a GPU step bound by the host that is launch time (measured on an H200: the bench GPT's plan at
    torch.compile's own peak ran 203 kernels guarded, 194 unguarded, against torch's 195; `benchmarks/
    lowering_cost.py`), on any device a second pass over the shared inputs, and on CPU more C++ to compile.
    Where Inductor's fusions fit anyway, the guard buys nothing. So the graph is scheduled first with
    Inductor's fusions, counting those the guard would refuse; `fits` is given the probe's reading of that
    schedule. If it fits, or the guard would refuse nothing (it would schedule the same), or no schedule could
    fit or hold measurably less (`may_improve` given that reading says no: a forward whose transient peak is
    not the step's), that schedule generates the code. Otherwise the graph is scheduled again from the same lowering with the guard
    (`_one_lowering_schedules_alike`; where a second scheduler could not see the same IR, the guard schedules
    it from the start), which generates the code if its reading fits or `lower(guard's reading, Inductor's
    reading)` says it holds measurably less; else (neither fits, and the guard's peak is no lower than a
    measurement could tell) Inductor's fusions do. The rule chosen also schedules the subgraphs. `check` is
    called on the reading chosen (it may raise, ending the compile there); the other reading is taken off
    `probe.peaks`. A schedule the probe cannot read is left to the guard, as before.

    Yields a list that holds, once the graph is scheduled, the `PlannedFusionChoices` that scheduled it (its
    `refused` counts what it refused: none for Inductor's own fusions).
    """
    used: list[PlannedFusionChoices] = []

    def schedule_first(schedule, graph, handlers: contextlib.ExitStack) -> None:
        def use(choices: PlannedFusionChoices, reading, dropped=None) -> None:
            """`choices`' schedule generates the code (and schedules the subgraphs); `dropped`, the other
            reading, is taken off the probe's."""
            if dropped is not None:
                probe.peaks[:] = [p for p in probe.peaks if p is not dropped]
            used.append(choices)
            handlers.enter_context(V.set_choices_handler(choices))  # for the subgraphs
            if reading is not None:
                probe.checked = reading
                check(reading)

        guard, own, own_reading = PlannedFusionChoices(keep_producers_apart), None, None
        if _schedules_alike(graph):
            own = PlannedFusionChoices(keep_producers_apart, refuse_horizontal=False)
            own_reading = _reading(probe, schedule, graph, own)
            if own_reading is not None and (own.would_refuse_horizontal == 0 or fits(own_reading)
                                            or not may_improve(own_reading)):
                return use(own, own_reading)
            if own_reading is None:
                log.info("Inductor's own fusions could not be read; scheduling with the fusion guard")
        own_scheduler = graph.scheduler
        reading = _reading(probe, schedule, graph, guard)
        if own_reading is not None and reading is not None and not fits(reading) and not lower(reading, own_reading):
            graph.scheduler = own_scheduler  # V.graph is `graph`: the scheduler code generation reads
            return use(own, own_reading, dropped=reading)
        return use(guard, reading, dropped=own_reading)

    with _first_graph_scheduled_by(schedule_first):
        yield used
