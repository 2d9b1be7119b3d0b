"""Schedule: execution order, phases and the values that cross from forward to backward."""

from __future__ import annotations

import functools

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.passes.analysis import BACKWARD, FORWARD, Schedule

from training_graphs import trace_training


def linear_sin(w, x):
    return (torch.mm(x, w).sin(),)


def names(nodes):
    return sorted(n.name for n in nodes)


def test_of_graph_is_one_forward_graph_whose_placeholders_are_resident():
    gm = make_fx(lambda w, x: (torch.mm(x, w).relu(),), tracing_mode="fake")(torch.randn(4, 4), torch.randn(2, 4))
    schedule = Schedule.of_graph(gm, parameter_indices=(0,))
    assert [n.name for n in schedule.nodes] == ["mm", "relu"]
    assert [n.name for n in schedule.resident] == ["w_1", "x_1"]
    assert names(schedule.parameters) == ["w_1"]
    assert names(schedule.live_out) == ["relu"]
    assert set(schedule.phase.values()) == {FORWARD} and len(schedule.phase) == len(gm.graph.nodes)
    assert schedule.late_inputs == () and schedule.receives == {}
    assert schedule.saved == frozenset() and schedule.gradients == frozenset()
    assert schedule.first_backward_index is None
    assert schedule.graphs == (gm,)


def test_of_joint_puts_the_backward_where_the_partition_runs_it():
    graphs = trace_training(linear_sin, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    schedule = Schedule.of_joint(graphs.joint, num_fwd_outputs=graphs.num_fwd_outputs, parameter_indices=(0,))
    # cos(mm) and t(x) need no tangent, but AOTAutograd traced them in the backward, after the forward's
    # last op: torch's default_partition runs them in the backward, and saves mm and x for them.
    assert [(n.name, schedule.phase[n]) for n in schedule.nodes] == [
        ("mm", FORWARD), ("sin", FORWARD), ("cos", BACKWARD), ("mul", BACKWARD), ("t", BACKWARD), ("mm_1", BACKWARD),
    ]
    assert schedule.first_backward_index == 2
    assert [n.name for n in schedule.resident] == ["primals_1", "primals_2"]
    assert names(schedule.parameters) == ["primals_1"]
    assert [n.name for n in schedule.late_inputs] == ["tangents_1"]
    assert schedule.phase[schedule.late_inputs[0]] == BACKWARD
    assert names(schedule.saved) == ["mm", "primals_2"]
    assert names(schedule.saved) == sorted(v.name for v in graphs.forward.graph.output_node().args[0][1:])
    assert names(schedule.gradients) == ["mm_1"]
    assert names(schedule.live_out) == ["mm_1", "sin"]
    assert schedule.receives == {}


def test_of_partition_receives_saved_values_by_name_and_makes_tangents_late():
    graphs = trace_training(linear_sin, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    schedule = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1, parameter_indices=(0,))
    forward = {n.name: n for n in graphs.forward.graph.nodes}
    backward = {n.name: n for n in graphs.backward.graph.nodes}
    # forward returns (sin, primals_2, mm): the user output first, then what backward needs.
    assert [n.name for n in graphs.forward.graph.output_node().args[0]] == ["sin", "primals_2", "mm"]
    assert schedule.graphs == (graphs.forward, graphs.backward)
    assert schedule.nodes == (
        forward["mm"], forward["sin"], backward["cos"], backward["mul"], backward["t"], backward["mm_1"],
    )
    assert schedule.first_backward_index == 2
    assert schedule.receives == {backward["primals_2"]: forward["primals_2"], backward["mm"]: forward["mm"]}
    assert schedule.source(backward["mm"]) is forward["mm"] and schedule.source(backward["cos"]) is backward["cos"]
    assert schedule.late_inputs == (backward["tangents_1"],)
    assert schedule.resident == (forward["primals_1"], forward["primals_2"])
    assert schedule.parameters == {forward["primals_1"]}
    assert schedule.saved == {forward["primals_2"], forward["mm"]}
    assert schedule.live_out == {forward["sin"], backward["mm_1"]}  # mm is a forward output, but not the user's
    assert schedule.gradients == {backward["mm_1"]}
    assert {schedule.phase[n] for n in graphs.forward.graph.nodes} == {FORWARD}
    assert {schedule.phase[n] for n in graphs.backward.graph.nodes} == {BACKWARD}


def test_of_partition_after_min_cut_saves_what_the_partitioner_chose():
    min_cut = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    graphs = trace_training(linear_sin, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4), partition=min_cut)
    schedule = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1)
    saved = graphs.forward.graph.output_node().args[0][1:]  # after the one user output
    assert schedule.saved == set(saved)
    assert names(schedule.receives) == names(saved)
    assert names(schedule.late_inputs) == ["tangents_1"]
    assert schedule.parameters == frozenset()


def test_as_inductor_keeps_the_schedule_and_marks_fused_values():
    gm = make_fx(lambda x: (x.sin().cos(),), tracing_mode="fake")(torch.randn(4))
    schedule = Schedule.of_graph(gm)
    sin = schedule.nodes[0]
    inductor = schedule.as_inductor(frozenset({sin}))
    assert (inductor.fused, inductor.reuses_dying_inputs) == ({sin}, True)
    assert (schedule.fused, schedule.reuses_dying_inputs) == (frozenset(), False)
    assert inductor.nodes == schedule.nodes and inductor.live_out == schedule.live_out
