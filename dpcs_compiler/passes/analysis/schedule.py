"""The order in which one training (or inference) step computes its values.

A `Schedule` lays the nodes of a forward graph and then a backward graph (or of one joint or inference
graph) out in execution order and says which values cross from one graph to the other: a backward
placeholder named like a forward output receives that output (the partitioner keeps names). Liveness and
the memory timeline run over a Schedule, so a saved tensor lives from its forward producer to its last
backward use whether the graphs are joint or partitioned.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.graph_module import GraphModule

FORWARD = "forward"
BACKWARD = "backward"


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """One step's graphs in execution order.

    graphs: the graph modules in the order they run (forward then backward, or a single graph).
    nodes: every compute node (call_function / call_module / get_attr) in execution order.
    phase: FORWARD or BACKWARD for every node, placeholders included.
    resident: placeholders whose values exist before the step starts (parameters, user inputs).
    parameters: the resident placeholders that are nn.Parameters (module buffers count as inputs).
    late_inputs: placeholders made at the start of backward (tangents), born at the first backward node.
    receives: backward placeholder -> the forward node whose value it receives.
    live_out: values still referenced after the step (user outputs and the gradients returned).
    saved: forward values handed to backward.
    gradients: values the backward returns.
    fused: values the final compiler computes inside their readers' kernels (no buffer of their own).
    reuses_dying_inputs: the final compiler writes a pointwise result into an input buffer of the same
        size that dies at that node (Inductor's inplace_buffers / donated_buffer), instead of allocating.
    workspace: bytes a node's kernel allocates inside itself while it runs, beyond its outputs (measured,
        `op_workspace.WorkspaceTable`); nodes without any are left out.
    """

    graphs: tuple[GraphModule, ...]
    nodes: tuple[fx.Node, ...]
    phase: dict[fx.Node, str]
    resident: tuple[fx.Node, ...]
    parameters: frozenset[fx.Node]
    late_inputs: tuple[fx.Node, ...]
    receives: dict[fx.Node, fx.Node]
    live_out: frozenset[fx.Node]
    saved: frozenset[fx.Node]
    gradients: frozenset[fx.Node]
    fused: frozenset[fx.Node] = frozenset()
    reuses_dying_inputs: bool = False
    workspace: Mapping[fx.Node, int] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def first_backward_index(self) -> int | None:
        for i, node in enumerate(self.nodes):
            if self.phase[node] == BACKWARD:
                return i
        return None

    @functools.cached_property
    def outside(self) -> frozenset[fx.Node]:
        """The placeholders made outside the schedule's nodes: resident ones and late inputs (a set, for the
        membership tests over every buffer)."""
        return frozenset(self.resident) | frozenset(self.late_inputs)

    @functools.cached_property
    def late_input_set(self) -> frozenset[fx.Node]:
        return frozenset(self.late_inputs)

    def source(self, node: fx.Node) -> fx.Node:
        """The node that produced a value (a backward placeholder's forward producer, else itself)."""
        return self.receives.get(node, node)

    @classmethod
    def of_graph(cls, gm: GraphModule, *, parameter_indices: Sequence[int] = ()) -> Schedule:
        """A single forward-only graph (inference) where every placeholder is resident."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        nodes = tuple(n for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
        outputs = _output_values(gm)
        return cls(
            graphs=(gm,),
            nodes=nodes,
            phase={n: FORWARD for n in gm.graph.nodes},
            resident=tuple(placeholders),
            parameters=frozenset(placeholders[i] for i in parameter_indices if i < len(placeholders)),
            late_inputs=(),
            receives={},
            live_out=frozenset(_nodes(outputs)),
            saved=frozenset(),
            gradients=frozenset(),
        )

    def as_inductor(self, fused: frozenset[fx.Node]) -> Schedule:
        """The same schedule run the way Inductor runs it: `fused` values never materialized, and pointwise
        results written in place over same-size inputs that die there."""
        return dataclasses.replace(self, fused=frozenset(fused), reuses_dying_inputs=True)

    def with_workspace(self, workspace: Mapping[fx.Node, int]) -> Schedule:
        """The same schedule with its kernels' own workspace (node -> bytes, while the node runs)."""
        return dataclasses.replace(self, workspace=dict(workspace))

    @classmethod
    def of_joint(cls, gm: GraphModule, *, num_fwd_outputs: int, parameter_indices: Sequence[int] = ()) -> Schedule:
        """An AOTAutograd joint graph: (primals, tangents) -> (forward outputs, gradients).

        Backward nodes are those that depend on a tangent, and, as torch's `default_partition` places them,
        every node after the last one AOTAutograd traced in the forward (`partitioner_tag` "is_forward"): a
        backward op that needs no tangent (GELU's derivative, from the forward's input to GELU) runs in the
        backward, not the forward, although it depends on forward values only. The rest are forward.
        """
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        tangents = [n for n in placeholders if n.name.startswith("tangents")]
        primals = [n for n in placeholders if n not in tangents]
        backward: set[fx.Node] = set(tangents)
        tagged = [n for n in gm.graph.nodes if n.meta.get("partitioner_tag") == "is_forward"]
        after_forward = False
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if after_forward or any(a in backward for a in node.all_input_nodes):
                backward.add(node)
            if tagged and node is tagged[-1]:
                after_forward = True
        outputs = _output_values(gm)
        fwd_outputs, grads = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
        saved = {
            n
            for n in gm.graph.nodes
            if n not in backward and n.op != "output" and any(u in backward for u in n.users if u.op != "output")
        }
        return cls(
            graphs=(gm,),
            nodes=tuple(n for n in gm.graph.nodes if n.op not in ("placeholder", "output")),
            phase={n: (BACKWARD if n in backward else FORWARD) for n in gm.graph.nodes},
            resident=tuple(primals),
            parameters=frozenset(primals[i] for i in parameter_indices if i < len(primals)),
            late_inputs=tuple(tangents),
            receives={},
            live_out=frozenset(_nodes(fwd_outputs + grads)),
            saved=frozenset(saved),
            gradients=frozenset(_nodes(grads)),
        )

    @classmethod
    def of_partition(
        cls,
        forward: GraphModule,
        backward: GraphModule,
        *,
        num_user_outputs: int,
        parameter_indices: Sequence[int] = (),
    ) -> Schedule:
        """A forward graph and the backward graph the partitioner split from the same joint graph.

        The first `num_user_outputs` forward outputs go to the user (they live past the step); the rest are
        saved for backward. Backward placeholders named like a forward node receive that node's value; the
        other backward placeholders are tangents, made when backward starts.
        """
        fw_placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
        fw_by_name = {n.name: n for n in forward.graph.nodes}
        fw_outputs = _output_values(forward)
        bw_placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
        receives = {p: fw_by_name[p.name] for p in bw_placeholders if p.name in fw_by_name}
        tangents = tuple(p for p in bw_placeholders if p not in receives)
        grads = _output_values(backward)
        phase = {n: FORWARD for n in forward.graph.nodes}
        phase.update({n: BACKWARD for n in backward.graph.nodes})
        nodes = tuple(n for n in forward.graph.nodes if n.op not in ("placeholder", "output")) + tuple(
            n for n in backward.graph.nodes if n.op not in ("placeholder", "output")
        )
        return cls(
            graphs=(forward, backward),
            nodes=nodes,
            phase=phase,
            resident=tuple(fw_placeholders),
            parameters=frozenset(fw_placeholders[i] for i in parameter_indices if i < len(fw_placeholders)),
            late_inputs=tangents,
            receives=receives,
            live_out=frozenset(_nodes(fw_outputs[:num_user_outputs] + grads)),
            saved=frozenset(receives.values()),
            gradients=frozenset(_nodes(grads)),
        )


def _output_values(gm: GraphModule) -> list[fx.Node | None]:
    """The graph's outputs by position (None where an output is not a node, e.g. a None gradient)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return [v if isinstance(v, fx.Node) else None for v in pytree.tree_leaves(output.args[0], is_leaf=_is_none)]


def _is_none(x: object) -> bool:
    return x is None


def _nodes(values: list[fx.Node | None]) -> list[fx.Node]:
    return [v for v in values if v is not None]
