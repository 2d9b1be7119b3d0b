"""memory_timeline: exact live bytes during and after every node, the peak, and what the bytes are."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dpcs_compiler.passes.analysis import Schedule, memory_timeline
from dpcs_compiler.passes.analysis.fusion import inductor_fusion

from training_graphs import trace_training


def rows(timeline):
    return [(s.node, s.phase, s.during, s.after) for s in timeline.steps]


def test_live_bytes_during_and_after_each_node_of_a_small_graph():
    def fn(x):  # x: f32[8, 16] = 512 B; every intermediate but the sum is 512 B too
        a = x.sin()
        b = a.cos()
        c = b * a
        return (c.sum(),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16))
    timeline = memory_timeline(Schedule.of_graph(gm))
    assert timeline.resident_bytes == 512
    assert rows(timeline) == [
        ("sin", "forward", 512 + 512, 1024),
        ("cos", "forward", 1024 + 512, 1536),  # a is still read by mul
        ("mul", "forward", 1536 + 512, 1024),  # a and b die at mul
        ("sum_1", "forward", 1024 + 4, 516),  # c dies; the 4-byte sum leaves the step
    ]
    assert (timeline.peak_bytes, timeline.peak_index, timeline.peak_step.node) == (2048, 2, "mul")
    assert timeline.to_json()["peak_node"] == "mul" and timeline.to_json()["peak_bytes"] == 2048


def test_a_graph_without_compute_peaks_at_its_resident_bytes():
    gm = make_fx(lambda x: (x,), tracing_mode="fake")(torch.randn(8, 16))
    timeline = memory_timeline(Schedule.of_graph(gm))
    assert (timeline.steps, timeline.resident_bytes, timeline.peak_bytes) == ((), 512, 512)
    assert (timeline.peak_index, timeline.peak_step) == (-1, None)


def test_a_training_step_sorts_its_bytes_into_categories():
    def linear_sin(w, x):
        return (torch.mm(x, w).sin(),)

    # w: f32[4, 4] = 64 B, a parameter; x, mm, sin, the tangent, cos and mul: f32[2, 4] = 32 B; the gradient 64 B.
    graphs = trace_training(linear_sin, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    schedule = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1, parameter_indices=(0,))
    timeline = memory_timeline(schedule)

    def category(parameter=64, input=32, saved=0, gradient=0, output=0, temporary=0):
        return dict(parameter=parameter, input=input, saved=saved, gradient=gradient, output=output, temporary=temporary,
                    workspace=0)

    assert timeline.resident_bytes == 96
    assert [(s.node, s.phase, s.during, s.after, s.by_category) for s in timeline.steps] == [
        ("mm", "forward", 128, 128, category(saved=32)),
        ("sin", "forward", 160, 160, category(saved=32, output=32)),
        ("cos", "backward", 224, 192, category(input=64, saved=32, output=32, temporary=32)),  # tangent arrives
        ("mul", "backward", 224, 160, category(input=64, output=32, temporary=64)),
        ("t", "backward", 160, 160, category(output=32, temporary=32)),  # a view: nothing new
        ("mm_1", "backward", 224, 192, category(output=32, temporary=32, gradient=64)),
    ]
    assert all(sum(s.by_category.values()) == s.during for s in timeline.steps)
    assert (timeline.peak_bytes, timeline.peak_step.node) == (224, "cos")


def test_inductor_fusion_and_in_place_reuse_lower_the_peak_of_a_pointwise_chain():
    def pointwise_chain(x, w):  # x: 512 B, w: 1024 B, every intermediate 512 B
        return (torch.mm(x, w).sin().cos().exp(),)

    gm = make_fx(pointwise_chain, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 16))
    schedule = Schedule.of_graph(gm)
    eager = memory_timeline(schedule)
    inductor = memory_timeline(schedule.as_inductor(inductor_fusion(gm)))
    assert eager.resident_bytes == inductor.resident_bytes == 1536
    # Eager: each op materializes its result while its input is still alive.
    assert rows(eager) == [
        ("mm", "forward", 2048, 2048), ("sin", "forward", 2560, 2048),
        ("cos", "forward", 2560, 2048), ("exp", "forward", 2560, 2048),
    ]
    # Inductor: sin and cos are computed inside exp's kernel, which writes over mm's dying buffer.
    assert rows(inductor) == [
        ("mm", "forward", 2048, 2048), ("sin", "forward", 2048, 2048),
        ("cos", "forward", 2048, 2048), ("exp", "forward", 2048, 2048),
    ]
    assert (eager.peak_bytes, eager.peak_step.node) == (2560, "sin")
    assert (inductor.peak_bytes, inductor.peak_step.node) == (2048, "mm")


def test_a_fused_chain_keeps_its_input_buffer_alive_until_its_reader_runs():
    def fn(x, w):  # mm's result (512 B) stays alive until add, which computes sin and exp inside its kernel
        h = torch.mm(x, w)
        return (h.sin().exp() + h.sum(),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 16))
    fused = inductor_fusion(gm)
    assert sorted(n.name for n in fused) == ["exp", "sin"]  # read by add only
    inductor = memory_timeline(Schedule.of_graph(gm).as_inductor(fused))
    assert rows(inductor) == [
        ("mm", "forward", 2048, 2048), ("sin", "forward", 2048, 2048), ("exp", "forward", 2048, 2048),
        ("sum_1", "forward", 2052, 2052), ("add", "forward", 2052, 2048),  # add writes over mm in place
    ]
