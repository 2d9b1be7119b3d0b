"""liveness: exact value and buffer intervals over a schedule, across the forward/backward boundary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.passes.analysis import Interval, Schedule, liveness, tensor_bytes
from dpcs_compiler.passes.analysis.fusion import inductor_fusion
from dpcs_compiler.passes.analysis.liveness import BEFORE_STEP
from dpcs_compiler.passes.infra import AnalysisCache

from training_graphs import trace_training


def intervals(mapping):
    """{name: (start, end)} for values, {name or name[index]: (start, end)} for buffers."""
    out = {}
    for key, interval in mapping.items():
        name = key.name if hasattr(key, "name") else key.producer.name + ("" if key.index is None else f"[{key.index}]")
        out[name] = (interval.start, interval.end)
    return out


def square_sum(w, x):
    y = torch.mm(x, w)
    return ((y * y).sum(),)


def linear_sin(w, x):
    return (torch.mm(x, w).sin(),)


def test_a_chain_lives_from_producer_to_last_use_and_inputs_and_outputs_span_the_step():
    def fn(x):
        a = x.sin()
        b = a.cos()
        return (b * a,)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16))
    live = liveness(Schedule.of_graph(gm))
    assert live.after_step == 3
    assert intervals(live.values) == {"x_1": (BEFORE_STEP, 3), "sin": (0, 2), "cos": (1, 2), "mul": (2, 3)}
    assert intervals(live.buffers) == intervals(live.values)
    assert live.values[next(iter(gm.graph.nodes))] == Interval(-1, 3)
    assert live.reuses == {}


def test_a_buffer_lives_as_long_as_any_view_of_it():
    def fn(x):
        flat = x.sin().view(-1)  # sin is read only by the view: the value dies at 1, its buffer at 4
        return (flat + x.cos().view(-1),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16))
    live = liveness(Schedule.of_graph(gm))
    values = intervals(live.values)
    assert [n.name for n in live.schedule.nodes] == ["sin", "view", "cos", "view_1", "add"]
    assert (values["sin"], values["view"]) == ((0, 1), (1, 4))
    assert intervals(live.buffers) == {"x_1": (-1, 5), "sin": (0, 4), "cos": (2, 4), "add": (4, 5)}


def test_a_saved_tensor_lives_from_its_forward_producer_to_its_last_backward_use():
    graphs = trace_training(square_sum, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    schedule = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1, parameter_indices=(0,))
    live = liveness(schedule)
    assert [n.name for n in schedule.nodes] == ["mm", "mul", "sum_1", "expand", "mul_1", "mul_2", "add", "t", "mm_1"]
    assert schedule.first_backward_index == 3
    assert intervals(live.values) == {
        "primals_1": (-1, 9), "primals_2": (-1, 9),  # resident: the whole step
        "mm": (0, 5),  # saved: read by mul_1 and mul_2 in backward
        "mul": (1, 2), "sum_1": (2, 9),  # the user output lives past the step
        "tangents_1": (3, 3),  # made when backward starts; read only by the view expand
        "expand": (3, 5), "mul_1": (4, 6), "mul_2": (5, 6), "add": (6, 8), "t": (7, 8), "mm_1": (8, 9),
    }
    buffers = intervals(live.buffers)
    assert buffers["tangents_1"] == (3, 5)  # the tangent's buffer lives as long as its view expand
    assert buffers["mm"] == (0, 5)
    # A backward placeholder allocates nothing: it points into the buffer of the forward value it receives.
    received_mm = next(p for p in schedule.receives if p.name == "mm")
    assert live.allocations[received_mm] == ()
    assert live.references[received_mm] == live.allocations[schedule.source(received_mm)]
    assert received_mm not in live.values


def test_a_saved_tensor_lives_at_least_until_backward_starts():
    graphs = trace_training(square_sum, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    schedule = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1)
    mul = next(n for n in graphs.forward.graph.nodes if n.name == "mul")
    assert liveness(schedule).values[mul] == Interval(1, 2)
    held = dataclasses.replace(schedule, saved=schedule.saved | {mul})  # as if autograd held it for backward
    assert liveness(held).values[mul] == Interval(1, schedule.first_backward_index)


class ReturnSavedAsGradient(torch.autograd.Function):
    """sin(w) * x; backward returns cos(w), computed in forward, unchanged as w's gradient."""

    @staticmethod
    def forward(ctx, w, x):
        cos = w.cos()
        ctx.save_for_backward(cos)
        return w.sin() * x

    @staticmethod
    def backward(ctx, grad):
        (cos,) = ctx.saved_tensors
        return cos, grad * 2


@pytest.mark.parametrize(
    ("x_needs_grad", "nodes"),
    [(False, ["cos", "sin", "mul"]), (True, ["cos", "sin", "mul", "mul_1"])],
    ids=["backward-computes-nothing", "backward-computes-x-grad"],
)
def test_a_forward_value_the_backward_returns_as_a_gradient_lives_past_the_step(x_needs_grad, nodes):
    w, x = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=x_needs_grad)
    graphs = trace_training(lambda w, x: (ReturnSavedAsGradient.apply(w, x),), w, x)
    schedule = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1, parameter_indices=(0,))
    assert [n.name for n in schedule.nodes] == nodes
    received_cos = next(p for p in schedule.receives if p.name == "cos")
    assert received_cos in schedule.gradients
    live = liveness(schedule)
    cos = schedule.source(received_cos)
    assert live.values[cos] == Interval(0, len(nodes))
    assert intervals(live.buffers)["cos"] == (0, len(nodes))


def test_the_joint_graph_and_its_partition_have_the_same_liveness():
    """The joint schedule puts cos and t (backward ops that need no tangent) in the backward, where the
    partition runs them: the tangent arrives at the same point in both."""
    graphs = trace_training(linear_sin, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    joint = intervals(liveness(Schedule.of_joint(graphs.joint, num_fwd_outputs=graphs.num_fwd_outputs)).values)
    partition = intervals(liveness(Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1)).values)
    # both: mm, sin | cos, mul, t, mm_1
    assert joint.pop("tangents_1") == partition.pop("tangents_1") == (2, 3)
    assert joint == partition == {
        "primals_1": (-1, 6), "primals_2": (-1, 6),
        "mm": (0, 2), "sin": (1, 6), "cos": (2, 3), "mul": (3, 5), "t": (4, 5), "mm_1": (5, 6),
    }


def pointwise_chain(x, w):
    h = torch.mm(x, w)
    return (h.sin().cos().exp(),)


def test_fused_values_allocate_nothing_and_keep_their_inputs_alive():
    gm = make_fx(pointwise_chain, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 16))
    fused = inductor_fusion(gm)
    assert sorted(n.name for n in fused) == ["cos", "sin"]
    eager = liveness(Schedule.of_graph(gm))
    inductor = liveness(Schedule.of_graph(gm).as_inductor(fused))
    assert intervals(eager.buffers) == {
        "x_1": (-1, 4), "w_1": (-1, 4), "mm": (0, 1), "sin": (1, 2), "cos": (2, 3), "exp": (3, 4),
    }
    assert intervals(inductor.buffers) == {"x_1": (-1, 4), "w_1": (-1, 4), "mm": (0, 3), "exp": (3, 4)}
    assert intervals(inductor.values) == intervals(eager.values)
    nodes = {n.name: n for n in gm.graph.nodes}
    (mm,) = inductor.allocations[nodes["mm"]]
    for node in fused:
        assert inductor.allocations[node] == ()
        assert inductor.references[node] == (mm,)
    assert inductor.reuses == {inductor.allocations[nodes["exp"]][0]: mm}  # exp is written over mm, dying there


def test_reuse_is_for_pointwise_nodes_over_same_size_dying_non_resident_buffers():
    def fn(x, w):
        h = torch.mm(x, w)  # not pointwise
        a = h.sin()  # h still read by add: no reuse
        b = a + h  # a and h die here, same size: reuses a (its first input)
        s = b.sum(1)  # a reduction: no reuse
        c = s.exp()  # s dies here, same size: reuses s
        d = c.unsqueeze(1) * x  # c dies here but is smaller; x is resident: no reuse
        return (torch.mm(d, w),)  # d dies here, same size, but mm is not pointwise

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 16))
    schedule = Schedule.of_graph(gm)
    live = liveness(schedule.as_inductor(frozenset()))
    reuses = {(new.producer.name, old.producer.name) for new, old in live.reuses.items()}
    assert reuses == {("add", "sin"), ("exp", "sum_1")}
    assert liveness(schedule).reuses == {}  # only the way Inductor runs it


@pytest.mark.parametrize(
    ("dtype", "reused"), [(torch.float32, True), (torch.int32, False), (torch.float16, False)], ids=str
)
def test_reuse_needs_the_same_dtype_not_just_the_same_bytes(dtype, reused):
    def fn(x):
        a = x.sin()  # f32[8, 16], dies at the cast
        return (torch.ops.prims.convert_element_type(a, dtype),)  # a pointwise cast

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16))
    live = liveness(Schedule.of_graph(gm).as_inductor(frozenset()))
    sin, cast = live.schedule.nodes
    assert live.reuses == ({live.allocations[cast][0]: live.allocations[sin][0]} if reused else {})


def test_reuse_never_takes_a_tangent_but_takes_a_dying_saved_tensor():
    graphs = trace_training(linear_sin, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    schedule = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1).as_inductor(frozenset())
    live = liveness(schedule)
    # cos(mm) writes over the saved mm, dying there; mul(tangents_1, cos) writes over cos, not the tangent.
    assert {(new.producer.name, old.producer.name) for new, old in live.reuses.items()} == {("cos", "mm"), ("mul", "cos")}


def test_liveness_reads_sizes_through_the_cache_when_given():
    gm = make_fx(lambda x: (x.sin(),), tracing_mode="fake")(torch.randn(3))
    cache = AnalysisCache()
    live = liveness(Schedule.of_graph(gm), cache)
    assert cache.computed == ["tensor_bytes"]
    assert live.sizes[gm] is cache.get(tensor_bytes, gm)
    assert live.hint(live.allocations[live.schedule.nodes[0]][0]) == 12
