"""Partition a joint graph as a memory plan says: save, recompute or offload each candidate.

The plan's decisions become torch's own checkpoint tags on the joint graph (`meta["recompute"]`):
MUST_RECOMPUTE on every forward node a recomputed candidate needs re-run (and on the views of it the
backward reads), MUST_SAVE on the values of saved and offloaded candidates, MUST_RECOMPUTE on the views of an
offloaded one (the backward makes them again from its reload). torch's `default_partition`
then splits the graph by those tags and reorders the backward the way autograd runs it, so each recomputed
value is made just before its first use (`reordering_to_mimic_autograd_engine`) - the schedule the memory
model assumes. Offloaded values then get their copy and reload ops (`passes.rewrite.offload`).
"""

from __future__ import annotations

import inspect
import unittest.mock
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import partitioners
from torch._functorch.partitioners import default_partition
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from dpcs_compiler.cost.memory_model import OFFLOAD, RECOMPUTE, SAVE
from dpcs_compiler.passes.analysis.planning import PlanningGraph, is_random
from dpcs_compiler.passes.analysis.schedule import FORWARD
from dpcs_compiler.passes.analysis.tensor_bytes import is_view

PASS_NAME = "plan_partition"


def tag_joint(planning: PlanningGraph, decisions: Sequence[str]) -> None:
    """Write the decisions onto the joint graph's nodes as checkpoint tags (the joint graph is the plan's)."""
    if len(decisions) != len(planning.candidates):
        raise ValueError(f"{len(decisions)} decisions for {len(planning.candidates)} candidates")
    schedule, live = planning.schedule, planning.live
    recomputed_buffers = set()
    offloaded_buffers = set()
    recompute: set[fx.Node] = set()
    save: set[fx.Node] = set()
    for candidate, decision in zip(planning.candidates, decisions):
        if decision == RECOMPUTE:
            recompute.update(candidate.recompute_nodes)
            recomputed_buffers.add(candidate.buffer)
        elif decision in (SAVE, OFFLOAD):
            save.add(candidate.holder)
            if decision == OFFLOAD:
                offloaded_buffers.add(candidate.buffer)
        else:
            raise ValueError(f"decision {decision!r} for {candidate.holder.name!r} is not valid")
    resident = set(schedule.resident)
    for node in schedule.nodes:
        if schedule.phase[node] != FORWARD or node in resident:
            continue
        buffers = live.references.get(node, ())
        if node in recompute or any(b in recomputed_buffers for b in buffers):
            recompute.add(node)
        elif node not in save and is_view(node) and buffers and all(b in offloaded_buffers for b in buffers):
            # The backward may read an offloaded value through a view (the transpose of a bf16 weight cast,
            # the 2-D view of an activation a linear reads): left untagged, the partition would save that view
            # and not the value, and the offload ops (`passes.rewrite.offload`) would find nothing to copy.
            # Made again from the value, the view costs nothing and the partition saves the value itself.
            recompute.add(node)
    random = sorted(n.name for n in recompute if is_random(n))
    if random:
        raise ValueError(f"plan recomputes random values {random}: they would not reproduce")
    clash = recompute & save
    if clash:
        raise ValueError(f"plan both saves and recomputes {sorted(n.name for n in clash)}")
    for node in schedule.nodes:
        # A user's torch.utils.checkpoint regions would make torch's cleanup re-tag plan decisions.
        for key in ("recompute", "ac_graph_id", "has_backward_hook"):
            node.meta.pop(key, None)
    for node in recompute:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["dpcs"] = {"pass": PASS_NAME, "decision": RECOMPUTE}
    for node in save:
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        node.meta["dpcs"] = {"pass": PASS_NAME, "decision": SAVE}


def partition_by_plan(
    joint: fx.GraphModule,
    joint_inputs: Sequence[object],
    planning: PlanningGraph,
    decisions: Sequence[str],
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split `joint` (the graph `planning` was computed on) into forward and backward per `decisions`."""
    tag_joint(planning, decisions)
    accepted = inspect.signature(default_partition).parameters
    # torch counts every nondeterministic-seeded op as random, attention without dropout too, and threads
    # RNG states through both graphs when one is recomputed; the plan never recomputes a truly random op
    # (checked above), so the values reproduce without that plumbing.
    with unittest.mock.patch.object(partitioners, "has_recomputable_rng_ops", lambda gm: False):
        forward, backward = default_partition(joint, joint_inputs, **{k: v for k, v in kwargs.items() if k in accepted})
    check_partition(forward, backward, planning, decisions, kwargs["num_fwd_outputs"])
    return forward, backward


def check_partition(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    planning: PlanningGraph,
    decisions: Sequence[str],
    num_user_outputs: int,
) -> None:
    """The partition carried out the plan: what it saves for backward is what the plan keeps, nothing the
    plan recomputes crosses, and each value the plan offloads crosses itself (the offload ops copy what
    crosses); else the memory model would not describe these graphs (ValueError)."""
    saved = set(saved_names(forward, num_user_outputs))
    recomputed = {c.holder.name for c, d in zip(planning.candidates, decisions) if d == RECOMPUTE}
    kept = {c.holder.name for c, d in zip(planning.candidates, decisions) if d in (SAVE, OFFLOAD)}
    offloaded = {c.holder.name for c, d in zip(planning.candidates, decisions) if d == OFFLOAD}
    crossing = sorted(saved & recomputed)
    remade = {n.name for n in backward.graph.nodes if n.op not in ("placeholder", "output")}
    missing = sorted(kept & remade)
    not_crossing = sorted(offloaded - saved)
    if crossing or missing or not_crossing:
        raise ValueError(
            f"the partition does not follow the plan: saves {crossing} the plan recomputes, recomputes {missing} "
            f"the plan saves, does not save {not_crossing} the plan offloads"
        )


def saved_names(forward: fx.GraphModule, num_user_outputs: int) -> list[str]:
    """Names of the forward values handed to backward (the forward's outputs after the user outputs)."""
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    values = output.args[0]
    return [v.name for v in values[num_user_outputs:] if isinstance(v, fx.Node)]


def recast_parameters_in_backward(joint: fx.GraphModule, parameters: frozenset[fx.Node]) -> int:
    """Tag the cheap forward values made from parameters alone (casts to bf16 or fp8, their scales, views)
    MUST_RECOMPUTE, so torch's min-cut partitioner makes them again in backward instead of saving them.

    A parameter stays resident through the step, so a low-precision copy of it saved for backward is pure
    extra memory (2 bytes a parameter for bf16, 1 for fp8), which min-cut does not see: it counts the
    parameter's own bytes against the copy's. Recasting costs one pass over the weight per step, small
    beside the matmuls that read it. Ops with a FLOP formula (a matmul of weights) end a chain: recomputing
    those is not cheap. A parameter the step writes to (`weight.mul_(0.5)` under no_grad, functionalized
    into a `copy_` back to it) is left out: made again in backward, its copy would read the new value.
    Returns the number of nodes tagged.
    """
    written = {n.args[0] for n in joint.graph.nodes if _is_mutating(n) and n.args}
    sources = parameters - written
    derived: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if node.op != "call_function" or is_random(node) or _is_mutating(node):
            continue
        if getattr(node.target, "overloadpacket", None) in flop_registry:
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in sources or i in derived for i in inputs):
            derived.add(node)
    for node in derived:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(derived)


def _is_mutating(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def recompute_upcasts(joint: fx.GraphModule, forward: frozenset[fx.Node]) -> int:
    """Tag every widening cast in the forward (fp8 or bf16 to fp32) MUST_RECOMPUTE, so torch's
    min-cut partitioner saves the narrow value for backward and widens it again there.

    Min-cut can save the wide copy (measured: the fp32 upcasts of fp8 activations that the emulated fp8
    matmul reads, 4 bytes an element instead of 1). Widening again is one pointwise pass; the narrow
    value is the cheaper one to keep. `forward`: the joint graph's forward nodes (`Schedule.phase`).
    Returns the number of nodes tagged.
    """
    tagged = 0
    for node in forward:
        if node.target not in _CASTS or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        source, value = node.args[0].meta.get("val"), node.meta.get("val")
        if (
            isinstance(source, torch.Tensor) and isinstance(value, torch.Tensor)
            and source.is_floating_point() and value.is_floating_point()
            and value.element_size() > source.element_size() and not _is_mutating(node)
        ):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
    return tagged
