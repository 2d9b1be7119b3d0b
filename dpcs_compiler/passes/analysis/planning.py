"""What a memory plan can decide in a joint graph: the candidates, and the memory that stays as it is.

A candidate is a forward buffer the backward reads (a saved activation). For each one this analysis finds
when it is made, last read in forward, first and last read in backward, and how it would be made again in
backward: the forward nodes to re-run (its producer and the intermediates only it needs, up to resident
inputs and other candidates) and the candidates that must be in memory for that. Everything else the step
allocates is simulated once, with the foundation's timeline simulator, as the plan-independent base.

The schedule is the joint graph in the order the partitioned graphs will run, as the final compiler runs
it; a forward value the backward reads is a forward output after partitioning, so it is never fused away.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from dpcs_compiler.cost import budget
from dpcs_compiler.cost.memory_model import Candidate, MemoryProblem
from dpcs_compiler.passes.analysis.base import require
from dpcs_compiler.passes.analysis.fusion import _readers, inductor_fusion
from dpcs_compiler.passes.analysis.liveness import Liveness, liveness
from dpcs_compiler.passes.analysis.memory_timeline import buffer_categories, simulate
from dpcs_compiler.passes.analysis.schedule import BACKWARD, FORWARD, Schedule
from dpcs_compiler.passes.analysis.tensor_bytes import Buffer

# Bytes the runtime allocates around a compiled step that no graph shows: scalar tensors made by the
# autograd engine and AOTAutograd's wrappers (measured on CPU: 16 B alive at the peak of a 2-layer GPT).
# The planner counts them at every step so a plan within the budget is within it when measured.
RUNTIME_ALLOWANCE_BYTES = budget.RUNTIME_ALLOWANCE_BYTES


@dataclasses.dataclass(frozen=True, eq=False)
class CandidateNodes:
    """A candidate buffer and the graph nodes behind it."""

    buffer: Buffer
    holder: fx.Node  # the node whose value is exactly this buffer: what the forward saves
    nbytes: int
    produced: int
    last_forward_use: int
    first_backward_use: int
    last_use: int
    recompute_nodes: tuple[fx.Node, ...]  # forward nodes re-run in backward to make it again, in graph order
    recompute_inputs: tuple[int, ...]  # candidates (indices) that must be in memory to re-run them
    transient: int  # the most bytes the re-run holds beyond the buffer's own (`_closure_peak`)
    random: bool  # re-running would draw new random numbers


@dataclasses.dataclass(frozen=True, eq=False)
class PlanningGraph:
    schedule: Schedule
    live: Liveness
    base_bytes: np.ndarray  # bytes alive during each schedule step, candidates left out
    base_before_bytes: np.ndarray  # bytes alive just before each step runs, candidates left out
    resident_bytes: int  # bytes alive before the step (parameters and inputs)
    candidates: tuple[CandidateNodes, ...]

    @property
    def backward_start(self) -> int:
        first = self.schedule.first_backward_index
        return len(self.schedule.nodes) if first is None else first

    def memory_problem(
        self,
        node_seconds: Callable[[fx.Node], float],
        transfer_seconds: Callable[[int], float] | None = None,
        offload_ops_seconds: float | None = None,
    ) -> MemoryProblem:
        """The pure problem the solvers take: step times from `node_seconds`; offload allowed (and costed:
        each copy's `transfer_seconds`, and `offload_ops_seconds` of host time per value, both needed) only
        when `transfer_seconds` is given (a device with a host link)."""
        if (transfer_seconds is None) != (offload_ops_seconds is None):
            raise ValueError("memory_problem: an offload is costed by transfer_seconds and offload_ops_seconds together; "
                             f"got transfer_seconds={transfer_seconds!r}, offload_ops_seconds={offload_ops_seconds!r}")
        step_seconds = np.array([node_seconds(n) for n in self.schedule.nodes], dtype=np.float64)
        # Two couplings the memory model does not carry, ruled out instead (a plan with them would hold
        # memory the model does not count): a candidate whose recomputation reads an input after that
        # input's own last use (the input would have to live longer), and the offload of a candidate that
        # a recomputation reads (its reload would have to come before the recomputation).
        late_input = {
            i
            for i, c in enumerate(self.candidates)
            if any(self.candidates[j].last_use < c.first_backward_use for j in c.recompute_inputs)
        }
        read_by_recompute = {j for c in self.candidates for j in c.recompute_inputs}
        candidates = []
        for i, c in enumerate(self.candidates):
            candidates.append(
                Candidate(
                    name=c.holder.name,
                    nbytes=c.nbytes,
                    produced=c.produced,
                    last_forward_use=c.last_forward_use,
                    first_backward_use=c.first_backward_use,
                    last_use=c.last_use,
                    recompute_seconds=float(sum(node_seconds(n) for n in c.recompute_nodes)),
                    recompute_transient=c.transient,
                    recompute_inputs=c.recompute_inputs,
                    transfer_seconds=transfer_seconds(c.nbytes) if transfer_seconds is not None else 0.0,
                    offload_ops_seconds=offload_ops_seconds if offload_ops_seconds is not None else 0.0,
                    can_recompute=not c.random and i not in late_input,
                    can_offload=transfer_seconds is not None and i not in read_by_recompute,
                )
            )
        return MemoryProblem(
            base_bytes=self.base_bytes,
            base_before_bytes=self.base_before_bytes,
            step_seconds=step_seconds,
            backward_start=self.backward_start,
            candidates=tuple(candidates),
        )


def planning_schedule(
    joint: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    parameter_indices: Sequence[int],
    compiler: str,
    analyses: Any | None = None,
) -> Schedule:
    """The joint schedule as the final compiler will run the planned partition."""
    schedule = Schedule.of_joint(joint, num_fwd_outputs=num_fwd_outputs, parameter_indices=parameter_indices)
    schedule = _phases_by_placement(schedule)
    if compiler != "inductor":
        return schedule
    fused = require(analyses, inductor_fusion, joint)
    crossing = {
        n for n in fused if schedule.phase[n] == FORWARD and any(schedule.phase[r] == BACKWARD for r in _readers(n))
    }
    return schedule.as_inductor(frozenset(fused - crossing))


def _phases_by_placement(schedule: Schedule) -> Schedule:
    """Every node from the first backward node on runs in the backward graph.

    `Schedule.of_joint` calls a node backward when it depends on a tangent; the partition keeps the joint
    graph's placement instead (a node backward recomputes from forward values, such as the softmax of a
    cross-entropy backward, stays there), and the plan must describe the partition.
    """
    start = schedule.first_backward_index
    if start is None:
        return schedule
    phase = dict(schedule.phase)
    phase.update({n: BACKWARD for n in schedule.nodes[start:]})
    saved = frozenset(
        n for n in schedule.saved if phase[n] == FORWARD and any(phase.get(u) == BACKWARD for u in n.users)
    )
    return dataclasses.replace(schedule, phase=phase, saved=saved)


def is_random(node: fx.Node) -> bool:
    """True if running the node twice can give different values (an attention op without dropout cannot)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        index = names.index("dropout_p")
        dropout = node.kwargs.get("dropout_p", node.args[index] if index < len(node.args) else 0.0)
        return dropout != 0.0
    return True


def _closure_peak(nodes: Sequence[fx.Node], buffer: Buffer, live: Liveness) -> int:
    """The most bytes a re-run of `nodes` (in order) holds at once beyond `buffer`'s own bytes, which the
    memory model counts from the re-run on: each buffer it makes lives from its node to the last node of the
    re-run that reads it (`buffer` to the end), with a node's kernel workspace while it runs. Where the final
    compiler writes a pointwise result over a dying input of its size (`Liveness.reuses`, where the forward
    these nodes re-run does so, the input read by nothing outside the re-run), the result allocates nothing:
    a remade activation over its remade pre-activation holds one of the two, not both (the graph-break net's
    remade tanh: 8 MiB, which the model counted as 16)."""
    last_read: dict[Buffer, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            for b in live.references.get(arg, ()):
                last_read[b] = i
    members = frozenset(nodes)
    delta = [0] * (len(nodes) + 1)
    for i, node in enumerate(nodes):
        made = [b for b in live.allocations.get(node, ()) if b in live.buffers]
        # Written in place where the schedule writes it in place (the input's last reader there, in the forward
        # these nodes re-run), and the input dies here in the re-run too: made by it, read last by this node,
        # and by nothing outside it (a value two remade candidates read is re-run once for both: its other
        # reader can come after this node in the backward).
        over = live.reuses.get(made[0]) if len(made) == 1 else None
        if over is not None and not (over.producer in members and over != buffer and last_read.get(over) == i
                                     and _read_only_within(over.producer, members, live)):
            over = None
        for b in made:
            if over is not None:  # written over `over`: its bytes stay, now as b's
                delta[i + 1] += live.hint(over)
            else:
                delta[i] += live.hint(b)
            if b != buffer:
                delta[max(i, last_read.get(b, i)) + 1] -= live.hint(b)
    workspace = live.schedule.workspace
    peak = alive = 0
    for node, change in zip(nodes, delta[:-1]):
        alive += change
        peak = max(peak, alive + workspace.get(node, 0))
    return max(0, peak - live.hint(buffer))


def _read_only_within(producer: fx.Node, members: frozenset[fx.Node], live: Liveness) -> bool:
    """Whether every reader of `producer`'s value, through views (nodes that allocate nothing), is in
    `members`."""
    stack, seen = [producer], set()
    while stack:
        for user in stack.pop().users:
            if user not in members:
                return False
            if user not in seen and not live.allocations.get(user):
                seen.add(user)
                stack.append(user)
    return True


def planning_graph(schedule: Schedule, analyses: Any | None = None) -> PlanningGraph:
    """The analysis: candidates and base memory of a joint schedule."""
    live = require(analyses, liveness, schedule)
    categories = buffer_categories(live)
    position = {n: i for i, n in enumerate(schedule.nodes)}
    backward_start = schedule.first_backward_index
    if backward_start is None:
        backward_start = len(schedule.nodes)  # no backward compute (gradients are the tangents): no candidates
    resident = set(schedule.resident)

    referrers: dict[Buffer, list[fx.Node]] = {}
    for node, buffers in live.references.items():
        for b in buffers:
            referrers.setdefault(b, []).append(node)

    def holder_of(b: Buffer) -> fx.Node | None:
        if b.index is None:
            return b.producer
        for user in b.producer.users:
            if user.op == "call_function" and user.args[1:] == (b.index,):
                return user
        return None

    chosen: list[tuple[Buffer, fx.Node, int, int, int]] = []
    for b, interval in sorted(live.buffers.items(), key=lambda kv: (kv[1].start, kv[0].producer.name)):
        if categories[b] != "saved" or b.producer in resident or schedule.phase[b.producer] != FORWARD:
            continue
        holder = holder_of(b)
        if holder is None or interval.end >= len(schedule.nodes):
            continue
        uses = [position[u] for v in referrers.get(b, ()) for u in v.users if u in position]
        forward_uses = [p for p in uses if p < backward_start]
        backward_uses = [p for p in uses if p >= backward_start]
        if not backward_uses:
            continue
        chosen.append((b, holder, max(forward_uses, default=interval.start), min(backward_uses), interval.end))

    index_of_holder = {holder: i for i, (_, holder, *_rest) in enumerate(chosen)}
    # A recomputation reads the graph's own outputs where the forward made them, as it reads its inputs: the
    # model counts an output alive to the step's end, so its bytes are there. Re-running one instead would
    # leave the forward's copy unread by the backward, freed where the caller drops it (Phi's and BLOOM's
    # key/value caches), which no plan's count shows (a prediction 5-7% over the measured peak), and would
    # spend the time of making it again.
    readable = resident | _forward_outputs(schedule, live, categories)
    candidates = []
    for b, holder, last_forward_use, first_backward_use, last_use in chosen:
        nodes, inputs, transient, random = _recompute_closure(b, holder, live, readable, position, index_of_holder)
        candidates.append(
            CandidateNodes(
                buffer=b,
                holder=holder,
                nbytes=live.hint(b),
                produced=live.buffers[b].start,
                last_forward_use=last_forward_use,
                first_backward_use=first_backward_use,
                last_use=last_use,
                recompute_nodes=nodes,
                recompute_inputs=inputs,
                transient=transient,
                random=random,
            )
        )
    base = simulate(live, exclude=frozenset(c.buffer for c in candidates))
    return PlanningGraph(
        schedule=schedule,
        live=live,
        base_bytes=np.array([s.during for s in base.steps], dtype=np.int64) + RUNTIME_ALLOWANCE_BYTES,
        base_before_bytes=np.array([base.resident_bytes] + [s.after for s in base.steps[:-1]], dtype=np.int64)
        + RUNTIME_ALLOWANCE_BYTES,
        resident_bytes=base.resident_bytes,
        candidates=tuple(candidates),
    )


def _forward_outputs(schedule: Schedule, live: Liveness, categories: dict[Buffer, str]) -> set[fx.Node]:
    """The forward nodes whose values are the graph's outputs (or views of them): every buffer they point
    into is an output's."""
    return {
        n for n in schedule.nodes
        if schedule.phase[n] == FORWARD and live.references.get(n)
        and all(categories.get(b) == "output" for b in live.references[n])
    }


def _recompute_closure(
    buffer: Buffer,
    holder: fx.Node,
    live: Liveness,
    readable: set[fx.Node],
    position: dict[fx.Node, int],
    index_of_holder: dict[fx.Node, int],
) -> tuple[tuple[fx.Node, ...], tuple[int, ...], int, bool]:
    """Nodes to re-run to make `buffer` again (up to the nodes of `readable`, read where they are: resident
    inputs and the graph's outputs), the candidates they read, their other bytes, randomness."""
    seen: set[fx.Node] = set()
    nodes: list[fx.Node] = []
    inputs: set[int] = set()
    stack = [buffer.producer] + ([holder] if holder is not buffer.producer else [])
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        for arg in node.all_input_nodes:
            if arg in readable or arg in seen:
                continue
            if arg in index_of_holder and arg is not holder:
                inputs.add(index_of_holder[arg])
                continue
            stack.append(arg)
    ordered = tuple(sorted(nodes, key=lambda n: position.get(n, -1)))
    transient = _closure_peak(ordered, buffer, live)
    own = index_of_holder.get(holder)
    return ordered, tuple(sorted(i for i in inputs if i != own)), transient, any(is_random(n) for n in nodes)


@dataclasses.dataclass(frozen=True)
class StepSharing:
    """What of a graph's memory the other graphs of its step see (`cost.step_model.GraphStep`).

    parameter_bytes: its parameters; shared_bytes: what its boundary level (between forward and backward)
    holds that is not its own to keep: parameters, inputs its backward does not read, outputs its backward
    does not read (the caller or the next graph holds those); gradient_bytes: the parameter gradients its
    backward returns (they stay, in `.grad`, while the earlier graphs run their backwards).
    """

    parameter_bytes: int
    shared_bytes: int
    gradient_bytes: int
    # Which of the graph's inputs (positions) and forward outputs its backward reads: the same tensor can be
    # held by two graphs of a step (one's output another's input, both saved), counted once (`step/`).
    held_inputs: tuple[int, ...] = ()
    held_outputs: tuple[int, ...] = ()
    # (schedule step that makes it, bytes) of each parameter gradient its backward returns, in step order.
    gradient_steps: tuple[tuple[int, int], ...] = ()
    # The input and output buffers its backward does not read, which the step's code may free before the
    # backward (a loss's logits between two graphs): the problem counts them alive to the step's end.
    freeable: tuple[Freeable, ...] = ()

    def output_readers(self) -> frozenset[str]:
        """The candidates whose recomputation reads one of its forward outputs (and none of its inputs) that
        its backward does not read: a plan that recomputes one keeps that output alive for the backward."""
        return frozenset(name for f in self.freeable if f.outputs and not f.inputs for name in f.readers)


@dataclasses.dataclass(frozen=True)
class Freeable:
    """One buffer of a graph's inputs or outputs that its backward does not read.

    nbytes: what the problem counts for it; inputs / outputs: the positions of the graph's (non-parameter)
    inputs and of its forward outputs that point into it; readers: the candidates whose recomputation reads
    it (a plan that recomputes one keeps it alive for the backward)."""

    nbytes: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    readers: tuple[str, ...]


def step_sharing(planning: PlanningGraph, num_fwd_outputs: int) -> StepSharing:
    """The analysis behind `StepSharing`, from the joint schedule's buffers."""
    schedule, live = planning.schedule, planning.live
    categories = buffer_categories(live)
    referrers: dict[Buffer, list[fx.Node]] = {}
    for node, buffers in live.references.items():
        for b in buffers:
            referrers.setdefault(b, []).append(node)

    def read_by_backward(b: Buffer) -> bool:
        return any(
            schedule.phase.get(u) == BACKWARD for v in referrers.get(b, ()) for u in v.users if u.op != "output"
        )

    parameters = shared = 0
    freed_buffers: list[Buffer] = []
    for b in live.buffers:
        category = categories[b]
        if category == "parameter":
            parameters += live.hint(b)
            shared += live.hint(b)
        elif category in ("input", "output") and b.producer not in schedule.late_input_set and not read_by_backward(b):
            shared += live.hint(b)
            freed_buffers.append(b)
    gradients = 0
    made: list[tuple[int, int]] = []
    index = {n: i for i, n in enumerate(schedule.nodes)}
    (joint,) = schedule.graphs[:1]
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    output = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    outputs = list(pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None))
    for primal, grad in zip(primals, outputs[num_fwd_outputs:]):
        if primal in schedule.parameters and isinstance(grad, fx.Node):
            nbytes = sum(live.hint(b) for b in live.references.get(primal, ()))
            gradients += nbytes
            # made at its node (a gradient that is no compute node of its own: from the backward's start)
            made.append((index.get(grad, planning.backward_start), nbytes))

    def held(node: object) -> bool:
        return isinstance(node, fx.Node) and any(read_by_backward(b) for b in live.references.get(node, ()))

    # Buffers each candidate's recomputation reads (the graph's inputs among them), for `Freeable.readers`.
    reads = [(c.holder.name, {b for n in c.recompute_nodes for a in n.all_input_nodes for b in live.references.get(a, ())})
             for c in planning.candidates]
    freeable = []
    for b in freed_buffers:
        inputs = tuple(i for i, p in enumerate(primals) if p not in schedule.parameters
                       and b in live.references.get(p, ()))
        outs = tuple(i for i, o in enumerate(outputs[:num_fwd_outputs]) if isinstance(o, fx.Node)
                     and b in live.references.get(schedule.source(o), ()))
        if inputs or outs:
            freeable.append(Freeable(live.hint(b), inputs, outs, tuple(name for name, r in reads if b in r)))

    return StepSharing(
        parameter_bytes=parameters,
        shared_bytes=shared,
        gradient_bytes=gradients,
        held_inputs=tuple(i for i, p in enumerate(primals) if p not in schedule.parameters and held(p)),
        held_outputs=tuple(i for i, o in enumerate(outputs[:num_fwd_outputs]) if held(o)),
        gradient_steps=tuple(sorted(made)),
        freeable=tuple(freeable),
    )
