"""What a step is made of, as the recorder sees it: its graphs' calls (`_Call`), what each holds and frees,
and how the steps of one shape seen more than once are joined into the shape planned for (`_covering`)."""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from torch.multiprocessing.reductions import StorageWeakRef

from dpcs_compiler.cost.step_model import (
    OPTIMIZER,
    TURN,
    OffloadBlocks,
    StepShape,
    recomputed_names,
)
from dpcs_compiler.passes.analysis.planning import Freeable, StepSharing
from dpcs_compiler.report import compiles_raised
from dpcs_compiler.cost.budget import CORRECTION_MIN_BYTES
from dpcs_compiler.step.holdings import _Block, _Fsdp
from dpcs_compiler.step.participant import Participant


# FSDP2's backward, beside the block that runs: the block before it, gathered ahead (its prefetch); the block
# after it, whose gradients' reduce-scatter input FSDP2 keeps until the next reduce-scatter; and a block's
# worth of buffers per collective its process group releases late (`step.holdings.late_collectives`: gloo's
# reduce-scatter copies its input, and each of its worker threads drops the collective it ran when it next
# takes its queue's lock, before or after the running block's peak by the ranks' timing: measured at the first
# backward too, a forward gather's; 2 blocks late at once on a loaded CPU, gloo's 2 threads).
FSDP_PREFETCHED_BLOCKS = 1
FSDP_REDUCING_BLOCKS = 1


STABLE_STEPS = 2


# A measured planned step more than `cost.budget.measurement_tolerance` above its prediction is planned again
# with the excess counted.
MAX_CORRECTIONS = 2  # complete steps of known shapes after which the recorder stops watching


MAX_TRANSIENT_UPDATES = 4  # times an optimizer step's measured temporaries re-plan a step shape


MAX_PENDING_CALLS = 100_000  # forward calls without their backwards after which a recording is dropped


_step_ids = itertools.count()


@dataclasses.dataclass
class _Call:
    dispatcher: Participant
    parameters: dict[int, int]  # storage pointer -> bytes
    gradients: dict[int, int]  # parameter storage pointer -> bytes of the .grad it already has
    inputs: dict[int, int]  # its other tensor inputs: storage pointer -> bytes
    held: dict[int, int]  # inputs and outputs its backward reads (it holds them): storage pointer -> bytes
    outside: dict[int, int]  # memory of the step outside graphs, by owner (DDP's gradient buckets)
    bucket: tuple[int, ...]  # the graph's size bucket at this call (dynamic shapes)
    own_gradients: int  # the gradients its backward leaves for the rest of the step (FSDP2: sharded)
    gathered: int  # FSDP2: parameter bytes gathered for this call only (its timeline counts them)
    fsdp: _Fsdp | None  # FSDP2's shards and sharded gradients, as seen at this call
    # ParameterOffload blocks (`_Block`): those whose parameters it takes, and those brought in beside it during
    # its forward and its backward (their prefetch).
    blocks: tuple[tuple[int, int], ...] = ()
    ahead: frozenset[tuple[int, int]] = frozenset()
    behind: frozenset[tuple[int, int]] = frozenset()
    # Its inputs and outputs its backward does not read (`StepSharing.freeable`), each with a weak reference to
    # its storage; and the bytes of those freed when its backward started, with the candidates that must not be
    # recomputed for them to stay free (`StepShape.call_backward_freed`, `call_keep_saved`).
    droppable: tuple[tuple[StorageWeakRef, int, Freeable], ...] = ()  # (reference, storage pointer, buffer)
    freed: int = 0
    keep_saved: frozenset[str] = frozenset()
    # The other calls' droppable buffers alive when its forward starts and when its backward starts: bytes no
    # graph counts there (each graph's holdings leave them out), such as the last graph's output a training loop
    # keeps through the backward (`StepShape.call_forward_others`, `call_backward_others`).
    forward_others: int = 0
    backward_others: int = 0
    # Of `held`: what it holds only because its plan recomputes from it (`_kept_for_recomputation`).
    kept: frozenset[int] = frozenset()
    block: frozenset[int] = frozenset()  # FSDP2: its gathered parameters (by id): the block it runs

    def backward_starts(self, calls: Sequence[_Call], collect: bool) -> None:
        """Its backward starts: read which of its droppable buffers the step has freed, and what the others'
        still hold; with `collect`, after a garbage collection if outputs worth a correction are alive (a step in
        which Dynamo compiled frames, or a compile raised, leaves reference cycles, which can hold a graph's output
        the loop has dropped; `_compile_marks`)."""
        if collect and _alive_elsewhere(calls, None, set(), outputs_only=True) >= CORRECTION_MIN_BYTES:
            gc.collect()
        index = next((i for i, c in enumerate(calls) if c is self), len(calls))
        # One a call whose backward is still to run reads is freed or not as that call's plan saves it or
        # recomputes it: not counted (that call counts it while it holds it).
        held_elsewhere = {p for c in calls[:index] for p in c.held}
        gone = [(p, f) for ref, p, f in self.droppable if ref.expired() and p not in held_elsewhere]
        self.freed = sum(f.nbytes for _, f in gone)
        self.keep_saved = self.keep_saved | {name for _, f in gone for name in f.readers}
        # One the calls whose backwards are still to run could keep alive by recomputing from it: they keep
        # what would read it saved too.
        freed = {p for p, _ in gone}
        for c in calls[:index]:
            c.keep_saved = c.keep_saved | {name for _, p, f in c.droppable if p in freed for name in f.readers}
        # Calls before it run their backwards after it: what they hold for them is counted as theirs; its own
        # inputs and outputs, as its own.
        self.backward_others = _alive_elsewhere(calls, self, {p for c in calls[:index] for p in c.held}
                                                | {p for _, p, _ in self.droppable} | set(self.inputs) | set(self.held))


def _kept_for_recomputation(job: Any, sharing: StepSharing | None) -> tuple[frozenset[int], frozenset[int]]:
    """The positions of a call's inputs and of its outputs that its backward does not read but that its plan
    keeps alive for a recomputation (`StepSharing.freeable`'s readers, by name: a stand-in's step view names
    its candidates as the stand-in does)."""
    if job is None or sharing is None or job.problem is None or not any(f.readers for f in sharing.freeable):
        return frozenset(), frozenset()
    recomputed = recomputed_names(job.problem, job.plan.decisions)
    kept = [f for f in sharing.freeable if not recomputed.isdisjoint(f.readers)]
    return frozenset(i for f in kept for i in f.inputs), frozenset(i for f in kept for i in f.outputs)


def _droppable(sharing: StepSharing | None, args: Sequence[Any], outputs: Sequence[torch.Tensor],
               held: dict[int, int], parameters: dict[int, int]) -> tuple[tuple[StorageWeakRef, Freeable], ...]:
    """Weak references to the storages of a call's droppable buffers (`StepSharing.freeable`): one of its
    tensors at the positions that point into each. Those a backward or a parameter holds stay alive anyway and
    are left out."""
    found = []
    for f in sharing.freeable if sharing is not None else ():
        tensors = [args[i] for i in f.inputs if i < len(args)] + [outputs[i] for i in f.outputs if i < len(outputs)]
        t = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in held and storage.data_ptr() not in parameters and storage.nbytes() > 0:
            found.append((StorageWeakRef(storage), storage.data_ptr(), f))
    return tuple(found)


def _compile_marks() -> tuple[Any, int, int]:
    """What tells that a compile may have left reference cycles holding a graph's output since it was read:
    the frames Dynamo set out to compile (its own counter, and the counter itself: clearing Dynamo's counters
    makes another), and the dpcs compiles that raised (`report.compiles_raised`: a re-plan, a failed variant).
    A full garbage collection takes 0.4-0.8 s in a 12-layer Hugging Face GPT-2 process, and a variant compiled
    between steps without either left none (measured on benchmarks/compile_time.py: 51.5 MB of outputs alive
    before and after it, the loss graph's logits its backward reads), so a step that only compiled variants
    is read without one (`_marks_changed`)."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return frames, frames["total"], compiles_raised()


def _marks_changed(before: tuple[Any, int, int], now: tuple[Any, int, int]) -> bool:
    return before[0] is not now[0] or before[1:] != now[1:]


def fsdp_in_flight(blocks: Sequence[frozenset[int]], gathered: Sequence[int], late: int = 1) -> tuple[int, ...]:
    """Per call of a step (in forward order, each with its FSDP2 block: the ids of the gathered parameters it
    takes, empty for none, and their bytes), what FSDP2 holds beside its backward: the gather of the block
    before it (`FSDP_PREFETCHED_BLOCKS`), the reduce-scatter input of the block after it, which ran its backward
    just before (`FSDP_REDUCING_BLOCKS`), and the largest block's worth for each of the `late` collectives
    whose buffers are released after they end (`step.holdings.late_collectives`). A block several calls take
    (a graph break inside it) is one block; the first backward has nothing reducing yet and the last nothing to
    gather ahead."""
    if len(blocks) != len(gathered):
        raise ValueError(f"fsdp_in_flight: {len(blocks)} blocks for {len(gathered)} calls; one per call")
    if not isinstance(late, int) or late < 0:
        raise ValueError(f"fsdp_in_flight: late={late!r}; a count of collectives, 0 or more")
    size: dict[frozenset[int], int] = {}
    for block, nbytes in zip(blocks, gathered):
        if block:
            size[block] = max(size.get(block, 0), nbytes)
    late_bytes = late * max(size.values(), default=0)
    out = []
    for i, block in enumerate(blocks):
        before = [b for b in dict.fromkeys(blocks[:i]) if b and b != block]
        after = [b for b in dict.fromkeys(blocks[i + 1:]) if b and b != block]
        out.append(FSDP_PREFETCHED_BLOCKS * (size[before[-1]] if before else 0)
                   + FSDP_REDUCING_BLOCKS * (size[after[0]] if after else 0) + late_bytes)
    return tuple(out)


def _alive_elsewhere(calls: Sequence[_Call], this: _Call | None, counted: set[int], *, outputs_only: bool = False) -> int:
    """Bytes of the droppable buffers of `calls` (other than `this`) still alive, each storage once, those in
    `counted` (held by a graph, or the running call's own) left out; with `outputs_only`, only graph outputs
    (what a garbage collection could free that the step counts as freed: a user's batch stays alive anyway)."""
    seen, total = set(counted), 0
    for c in calls:
        if c is this:
            continue
        for ref, ptr, f in c.droppable:
            if ptr not in seen and not ref.expired() and (f.outputs or not outputs_only):
                seen.add(ptr)
                total += f.nbytes
    return total


def _pieces(orders: set[tuple[str, ...]], first: str) -> set[tuple[str, ...]]:
    """The planned orders of calls cut before each call of `first`: what an unwatched step shows between two
    calls of that graph (a graph called once per layer starts many pieces of one step)."""
    pieces = set()
    for order in orders:
        start = 0
        for i, name in enumerate(order):
            if name == first and i > start:
                pieces.add(order[start:i])
                start = i
        pieces.add(order[start:])
    return pieces


def _offload_blocks(calls: Sequence[_Call], blocks: dict[tuple[int, int], _Block]) -> OffloadBlocks | None:
    """The ParameterOffload blocks the calls take, and those prefetched beside them, as a step shape counts
    them (None without any)."""
    names = list(dict.fromkeys(name for c in calls for name in (*c.blocks, *c.ahead, *c.behind) if name in blocks))
    if not names:
        return None
    index = {name: i for i, name in enumerate(names)}

    def indices(group) -> frozenset[int]:
        return frozenset(index[name] for name in group if name in index)

    return OffloadBlocks(
        names=tuple(names),
        parameter_bytes=tuple(blocks[n].parameter_bytes for n in names),
        gradient_bytes=tuple(blocks[n].gradient_bytes for n in names),
        held_gradient_bytes=tuple(blocks[n].held_gradient_bytes for n in names),
        uses=tuple(indices(c.blocks) for c in calls),
        ahead=tuple(indices(c.ahead) for c in calls),
        behind=tuple(indices(c.behind) for c in calls),
    )


def _covering(a: StepShape, b: StepShape) -> StepShape:
    """One shape for two steps of the same calls (micro-batches with and without earlier gradients): each
    figure at its more demanding value, so a plan for it holds for both."""
    def most(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(map(max, x, y)) if x and y else x or y

    def least(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(map(min, x, y)) if x and y else ()

    return dataclasses.replace(
        a,
        parameter_bytes=max(a.parameter_bytes, b.parameter_bytes),
        outside_bytes=max(a.outside_bytes, b.outside_bytes),
        # what is held at the end (outside less what the new gradients are added into) at its larger value
        accumulated_bytes=max(a.outside_bytes, b.outside_bytes) - max(a.outside_bytes - a.accumulated_bytes,
                                                                      b.outside_bytes - b.accumulated_bytes),
        bucket_bytes=max(a.bucket_bytes, b.bucket_bytes),
        optimizer_bytes=max((x for x in (a.optimizer_bytes, b.optimizer_bytes) if x is not None), default=None),
        inputs_held_before=least(a.inputs_held_before, b.inputs_held_before),
        held_twice=least(a.held_twice, b.held_twice),
        call_parameter_bytes=least(a.call_parameter_bytes, b.call_parameter_bytes),
        call_gradient_bytes=most(a.call_gradient_bytes, b.call_gradient_bytes),
        forward_extra_bytes=max(a.forward_extra_bytes, b.forward_extra_bytes),
        backward_extra_bytes=max(a.backward_extra_bytes, b.backward_extra_bytes),
        call_forward_extra_bytes=most(a.call_forward_extra_bytes, b.call_forward_extra_bytes),
        call_backward_extra_bytes=most(a.call_backward_extra_bytes, b.call_backward_extra_bytes),
        # per call the step that freed less before its backward, with what that needs kept saved (a plan that
        # recomputes from an input keeps it alive: what is freed is seen only under plans that do not)
        **_least_freed(a, b),
        call_forward_others=most(a.call_forward_others, b.call_forward_others),
        call_backward_others=most(a.call_backward_others, b.call_backward_others),
        turn_bytes=max(a.turn_bytes, b.turn_bytes),
        offload_blocks=(dataclasses.replace(b.offload_blocks, held_gradient_bytes=most(
            a.offload_blocks.held_gradient_bytes, b.offload_blocks.held_gradient_bytes))
            if a.offload_blocks and b.offload_blocks and a.offload_blocks.names == b.offload_blocks.names
            else b.offload_blocks),
    )


def _least_freed(a: StepShape, b: StepShape) -> dict[str, tuple]:
    if not (a.call_backward_freed and b.call_backward_freed):
        return {"call_backward_freed": (), "call_keep_saved": ()}
    keep_a = a.call_keep_saved or (frozenset(),) * len(a.instances)
    keep_b = b.call_keep_saved or (frozenset(),) * len(b.instances)
    pairs = [(fa, ka) if fa <= fb else (fb, kb)
             for fa, fb, ka, kb in zip(a.call_backward_freed, b.call_backward_freed, keep_a, keep_b)]
    return {"call_backward_freed": tuple(f for f, _ in pairs), "call_keep_saved": tuple(k for _, k in pairs)}


def _node_name(dispatcher: Participant, step: int) -> str | None:
    """The schedule node at `step` of the dispatcher's current plan (the plan's own problem, no boundary step)."""
    job = dispatcher.current_job()
    names = job.step_node_names if job is not None else ()
    return names[step] if 0 <= step < len(names) else None


def _where(phase: str, graph: str, node: str | None) -> str:
    if phase == OPTIMIZER:
        return (f"in the optimizer step after the backward of {graph} (its temporaries, and what the training "
                "loop holds then, included)")
    if phase == TURN:
        return f"at the step's turn, after the forward of {graph} (eager code there, such as a loss, included)"
    return f"in the {phase} of {graph} at {node}"


def _counted(calls: Sequence[str]) -> list[str]:
    """Graph names with their call counts, in first-call order."""
    counts: dict[str, int] = {}
    for c in calls:
        counts[c] = counts.get(c, 0) + 1
    return [f"{name} x{n}" if n > 1 else name for name, n in counts.items()]
