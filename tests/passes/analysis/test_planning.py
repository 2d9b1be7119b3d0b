"""The planning analysis: candidates of a joint graph, and the base memory left when they are taken out."""

from __future__ import annotations

import pytest
import torch

from training_graphs import trace_module_training, trace_training
from dpcs_compiler.cost.memory_model import RECOMPUTE, SAVE, plan_memory
from dpcs_compiler.models import workload
from dpcs_compiler.passes.analysis import memory_timeline
from dpcs_compiler.passes.analysis.planning import RUNTIME_ALLOWANCE_BYTES, planning_graph, planning_schedule, step_sharing
from dpcs_compiler.passes.infra import AnalysisCache
from dpcs_compiler.passes.rewrite.partition import partition_by_plan, saved_names

ROWS, D = 512, 256
F32 = ROWS * D * 4


def mlp_step(x, w0, w1, w2):
    h = torch.relu(x @ w0)
    h = torch.tanh(h @ w1)
    return (h @ w2).sum()


def planning_of(graphs, compiler="eager", parameter_indices=()):
    cache = AnalysisCache()
    schedule = planning_schedule(
        graphs.joint,
        num_fwd_outputs=graphs.num_fwd_outputs,
        parameter_indices=parameter_indices,
        compiler=compiler,
        analyses=cache,
    )
    return cache.get(planning_graph, schedule), cache


def mlp_graphs():
    x = torch.randn(ROWS, D)
    weights = [torch.randn(D, D, requires_grad=True) for _ in range(3)]
    return trace_training(mlp_step, x, *weights)


@pytest.mark.parametrize("compiler, transient", [("eager", F32), ("inductor", 0)])
def test_candidates_of_a_three_layer_mlp(compiler, transient):
    planning, _ = planning_of(mlp_graphs(), compiler, parameter_indices=(1, 2, 3))
    rows = {
        c.holder.name: (c.nbytes, [n.name for n in c.recompute_nodes], c.recompute_inputs, c.transient, c.random)
        for c in planning.candidates
    }
    # relu is made again from x and w0 (re-running mm), tanh from relu and w1. Eager allocates relu's output
    # while mm's is alive: mm's output is the transient. Inductor writes relu over mm's output, which dies
    # there (`Liveness.reuses`): the re-run holds one buffer, relu's own.
    assert rows == {
        "relu": (F32, ["mm", "relu"], (), transient, False),
        "tanh": (F32, ["mm_1", "tanh"], (0,), transient, False),
    }
    relu, tanh = planning.candidates
    nodes = [n.name for n in planning.schedule.nodes]
    assert nodes[relu.produced] == "relu" and nodes[tanh.produced] == "tanh"
    assert nodes[relu.last_forward_use] == "mm_1" and nodes[tanh.last_forward_use] == "mm_2"
    assert relu.first_backward_use >= planning.backward_start and relu.last_use >= relu.first_backward_use


def pointwise_chain_step(x, w0):
    return torch.tanh((x @ w0) * 2 + 1).sum()


@pytest.mark.parametrize("compiler, transient", [("eager", F32), ("inductor", 0)])
def test_a_remake_counts_its_value_from_its_making(compiler, transient):
    """tanh is made again by re-running mm, mul and add (the backward reads none of them). Eager holds two F32
    buffers at once along the re-run, tanh's own one of them once it is made: one F32 beyond tanh, where the
    transient counted as if tanh were alive all through the re-run was two. Inductor fuses mul and add into
    tanh's kernel and writes tanh over mm's dying output: nothing beyond tanh."""
    x = torch.randn(ROWS, D)
    w = torch.randn(D, D, requires_grad=True)
    planning, _ = planning_of(trace_training(pointwise_chain_step, x, w), compiler, parameter_indices=(1,))
    rows = {c.holder.name: ([n.name for n in c.recompute_nodes], c.transient) for c in planning.candidates}
    assert rows == {"tanh": (["mm", "mul", "add", "tanh"], transient)}


def shared_input_step(x, w0, w1, w2):
    h = x @ w0
    return (torch.tanh(h) @ w1).sum() + (torch.sigmoid(h) @ w2).sum()


def test_a_remake_is_not_counted_in_place_over_a_value_another_remake_reads():
    """Inductor writes sigmoid over h, whose last reader it is in the forward. Remade, h can be read by tanh's
    remake after sigmoid's (the partition re-runs h once for both): sigmoid's remake counts h beside it."""
    x = torch.randn(ROWS, D)
    weights = [torch.randn(D, D, requires_grad=True) for _ in range(3)]
    planning, _ = planning_of(trace_training(shared_input_step, x, *weights), "inductor", parameter_indices=(1, 2, 3))
    rows = {c.holder.name: ([n.name for n in c.recompute_nodes], c.transient) for c in planning.candidates}
    assert rows == {"tanh": (["mm", "tanh"], F32), "sigmoid": (["mm", "sigmoid"], F32)}
    live = planning.live
    (sigmoid,) = [b for b in live.buffers if b.producer.name == "sigmoid"]
    assert live.reuses.get(sigmoid) is not None  # the forward does write it in place


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_saving_everything_reproduces_the_joint_timeline(compiler):
    w = workload("gpt", 2)
    graphs = trace_module_training(w.model, w.inputs, w.loss_fn)
    planning, cache = planning_of(graphs, compiler, parameter_indices=range(len(list(w.model.parameters()))))
    problem = planning.memory_problem(lambda node: 1e-6)
    joint = cache.get(memory_timeline, planning.schedule)
    assert len(problem.candidates) > 10
    planned = plan_memory(problem, (SAVE,) * len(problem.candidates)).bytes_during
    assert (planned - RUNTIME_ALLOWANCE_BYTES).tolist() == [s.during for s in joint.steps]


def test_random_values_are_never_recomputed():
    x = torch.randn(64, 32)
    w = torch.randn(32, 32, requires_grad=True)

    def step(x, w):
        return torch.nn.functional.dropout(torch.relu(x @ w), p=0.5, training=True).sum()

    planning, _ = planning_of(trace_training(step, x, w), parameter_indices=(1,))
    assert any(c.random for c in planning.candidates)
    problem = planning.memory_problem(lambda node: 1e-6)
    assert [c.can_recompute for c in problem.candidates] == [not c.random for c in planning.candidates]


def test_saved_pointwise_values_are_materialized_under_inductor():
    """relu's output is read by threshold_backward: after partitioning it is a forward output, never fused."""
    planning, _ = planning_of(mlp_graphs(), "inductor", parameter_indices=(1, 2, 3))
    assert {c.holder.name for c in planning.candidates} >= {"relu", "tanh"}
    assert not {n.name for n in planning.schedule.fused} & {"relu", "tanh"}


def test_recomputations_that_would_outlive_their_inputs_are_ruled_out(monkeypatch):
    """In a residual conv net a block's sum reads a convolution whose own backward uses end earlier:
    recomputing the sum would keep the convolution alive longer than the model counts, so it is not offered."""
    import dpcs_compiler.stages.memory_plan as memory_plan
    from dpcs_compiler.models import bench_workload

    seen = []

    def capture(schedule, analyses=None):
        seen.append(planning_graph(schedule, analyses))
        return seen[-1]

    monkeypatch.setattr(memory_plan, "planning_graph", capture)
    w = bench_workload("convnet", quick=True)
    compiled = torch.compile(w.model, backend="dpcs", options={"compiler": "eager", "strict": True, "memory_budget": 2**40})
    w.loss_fn(compiled(*w.inputs)).backward()
    (planning,) = seen
    problem = planning.memory_problem(lambda node: 1e-6, transfer_seconds=lambda nbytes: 1e-6, offload_ops_seconds=0.0)
    late = [
        i for i, c in enumerate(planning.candidates)
        if any(planning.candidates[j].last_use < c.first_backward_use for j in c.recompute_inputs)
    ]
    assert late, "the residual net should have such sums"
    for i, candidate in enumerate(problem.candidates):
        assert candidate.can_recompute == (not planning.candidates[i].random and i not in late)
        read = any(i in c.recompute_inputs for c in problem.candidates)
        assert candidate.can_offload == (not read)


def cross_entropy_step(logits, target):
    return -(torch.log_softmax(logits, -1) * target).sum()


def test_the_inputs_and_outputs_a_backward_does_not_read_are_freeable_with_the_recomputations_that_read_them():
    """A loss graph after a graph break: its logits input is read by no backward node (the log-softmax's
    backward reads its output), only by the recomputation of that output; the target is read by the backward;
    the loss it returns is read by nothing."""
    logits = torch.randn(ROWS, D, requires_grad=True)
    graphs = trace_training(cross_entropy_step, logits, torch.randn(ROWS, D))
    planning, _ = planning_of(graphs)
    sharing = step_sharing(planning, graphs.num_fwd_outputs)
    assert sharing.held_inputs == (1,)
    inputs = [f for f in sharing.freeable if f.inputs]
    outputs = [f for f in sharing.freeable if f.outputs]
    assert [(f.nbytes, f.inputs, f.outputs) for f in inputs] == [(F32, (0,), ())]
    assert [(f.nbytes, f.outputs, f.readers) for f in outputs] == [(4, (0,), ())]
    # The readers: the candidates whose recomputation starts from the logits (the log-softmax output among them).
    (freeable,) = inputs
    reading = {c.holder.name for c in planning.candidates
               if any(a.name == "primals_1" for n in c.recompute_nodes for a in n.all_input_nodes)}
    assert reading and set(freeable.readers) == reading
    assert sharing.shared_bytes == F32 + 4  # what the step's other graphs do not count as this one's holdings


def cache_step(x, w0, w1):
    """k is returned (a key cache, as attention layers return one) and read on: its square feeds a matmul."""
    k = torch.tanh(x @ w0)
    u = k * k
    return (u @ w1).sum(), k


def cache_view_step(x, w0, w1):
    k = torch.tanh(x @ w0)
    u = k * k
    return (u @ w1).sum(), k.t()


@pytest.mark.parametrize("step", [cache_step, cache_view_step])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_remake_reads_the_graphs_outputs_where_the_forward_made_them(step, compiler):
    """u (read by the matmul's backward) is made again from k, which the graph returns: the remake reads the
    output, which the model counts alive to the step's end, and does not re-run the matmul and tanh behind it.
    Re-running them left the forward's k unread by the backward, freed where the caller drops it, which no plan
    counts. The partition by a plan that recomputes u saves k (the output itself), re-runs only the mul."""
    x = torch.randn(ROWS, D)
    weights = [torch.randn(D, D, requires_grad=True) for _ in range(2)]
    graphs = trace_training(step, x, *weights)
    planning, _ = planning_of(graphs, compiler, parameter_indices=(1, 2))
    rows = {c.holder.name: [n.name for n in c.recompute_nodes] for c in planning.candidates}
    assert rows == {"mul": ["mul"]}
    sharing = step_sharing(planning, graphs.num_fwd_outputs)
    assert sharing.held_outputs == (1,)  # the backward reads k, the output, in every plan
    forward, backward = partition_by_plan(graphs.joint, None, planning, [RECOMPUTE], num_fwd_outputs=graphs.num_fwd_outputs)
    targets = [n.target for n in backward.graph.nodes if n.op == "call_function"]
    # the backward's three matmuls (x needs no gradient), none re-run; no tanh made again
    assert targets.count(torch.ops.aten.mm.default) == 3 and torch.ops.aten.tanh.default not in targets
    assert "tanh" in saved_names(forward, graphs.num_fwd_outputs)
