"""Partitioning by a plan: the saved set and the recompute placement, and the plan model against the
simulation of the graphs it produces."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import FileCheck

sys.path.insert(0, str(Path(__file__).parents[1] / "analysis"))
from training_graphs import trace_module_training, trace_training  # noqa: E402

from dpcs_compiler.cost.memory_model import RECOMPUTE, SAVE, plan_memory  # noqa: E402
from dpcs_compiler.models import workload  # noqa: E402
from dpcs_compiler.passes.analysis import FORWARD, Schedule, memory_timeline  # noqa: E402
from dpcs_compiler.passes.analysis.planning import (  # noqa: E402
    RUNTIME_ALLOWANCE_BYTES,
    planning_graph,
    planning_schedule,
)
from dpcs_compiler.passes.infra import AnalysisCache  # noqa: E402
from dpcs_compiler.passes.rewrite.partition import partition_by_plan, saved_names  # noqa: E402


def mlp_step(x, w0, w1, w2):
    h = torch.relu(x @ w0)
    h = torch.tanh(h @ w1)
    return (h @ w2).sum()


def planned_partition(fn, inputs, parameter_indices, choose, trace=None, host_link=False):
    """Trace `fn` (or run `trace(partition)`), plan with `choose(problem) -> decisions`, partition by the plan
    (`host_link`: the problem may offload, each copy taking a nanosecond)."""
    out = {}

    def partition(joint, joint_inputs, **kwargs):
        cache = AnalysisCache()
        schedule = planning_schedule(
            joint, num_fwd_outputs=kwargs["num_fwd_outputs"], parameter_indices=parameter_indices, compiler="eager",
            analyses=cache,
        )
        planning = cache.get(planning_graph, schedule)
        problem = planning.memory_problem(lambda node: 1e-6, *((lambda nbytes: 1e-9, 0.0) if host_link else ()))
        decisions = choose(problem)
        forward, backward = partition_by_plan(joint, joint_inputs, planning, decisions, **kwargs)
        step = Schedule.of_partition(
            forward, backward, num_user_outputs=kwargs["num_fwd_outputs"], parameter_indices=parameter_indices
        )
        out.update(
            forward=forward, backward=backward, planning=planning, problem=problem, decisions=decisions,
            predicted=plan_memory(problem, decisions).peak_bytes, simulated=memory_timeline(step).peak_bytes,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
        )
        return forward, backward

    if trace is None:
        trace_training(fn, *inputs, partition=partition)
    else:
        trace(partition)
    return out


def mlp_inputs():
    return torch.randn(512, 256), *[torch.randn(256, 256, requires_grad=True) for _ in range(3)]


def test_saving_everything_saves_the_candidates():
    out = planned_partition(mlp_step, mlp_inputs(), (1, 2, 3), lambda p: (SAVE,) * len(p.candidates))
    saved = saved_names(out["forward"], out["num_fwd_outputs"])
    assert {"relu", "tanh"} <= set(saved)
    assert not [n for n in out["backward"].graph.nodes if n.name in ("mm", "mm_1")]  # nothing recomputed


def test_recomputed_values_are_made_again_just_before_their_first_backward_use():
    out = planned_partition(mlp_step, mlp_inputs(), (1, 2, 3), lambda p: (RECOMPUTE,) * len(p.candidates))
    saved = saved_names(out["forward"], out["num_fwd_outputs"])
    assert not {"relu", "tanh"} & set(saved) and set(saved) <= {"primals_1", "primals_2", "primals_3", "primals_4"}
    code = out["backward"].code
    # The gradient of w2 needs tanh first: relu and tanh are rebuilt there (tanh needs relu), not at the top.
    FileCheck().check("tangents_1").check("torch.ops.aten.mm.default(primals_1, primals_2)").check(
        "torch.ops.aten.relu.default(mm)"
    ).check("torch.ops.aten.tanh.default(mm_1)").check("torch.ops.aten.t.default(tanh)").run(code)
    for node in out["backward"].graph.nodes:
        if node.name in ("mm", "relu", "mm_1", "tanh"):
            assert node.meta["dpcs"]["pass"] == "plan_partition"


@pytest.mark.parametrize("seed", range(6))
def test_plan_model_equals_the_simulation_of_the_partitioned_graphs(seed):
    """The peak the solver sees is the peak of the graphs the plan produces (eager: no fusion to model),
    for plans from saving everything to recomputing everything that can be."""
    w = workload("gpt", 2)
    names = [n for n, _ in w.model.named_parameters()]
    rng = random.Random(seed)
    share = [0.0, 1.0, 0.5, 0.3, 0.7, 0.1][seed]

    def choose(problem):
        return tuple(RECOMPUTE if c.can_recompute and rng.random() < share else SAVE for c in problem.candidates)

    def trace(partition):
        trace_module_training(w.model, w.inputs, w.loss_fn, partition=partition)

    captured = planned_partition(None, (), range(len(names)), choose, trace=trace)
    # Equal but for the other outputs of a recomputed multi-output op (layer-norm statistics, attention's
    # logsumexp): the partition re-makes them with the op, the model each at its own first use (measured:
    # at most 0.22% under, with everything recomputed).
    simulated = captured["simulated"] + RUNTIME_ALLOWANCE_BYTES
    assert captured["predicted"] == pytest.approx(simulated, rel=0.005)



def test_an_offloaded_value_the_backward_reads_through_a_view_is_saved_itself():
    """Under autocast a linear's weight is cast to bf16 in the forward and the backward reads the cast through
    its transpose. A plan that offloads the cast gets the cast saved and its view remade in backward from it (a
    view costs nothing): else the partition saves the view, and the offload ops find no saved value to copy (a
    plan that fell back to plain Inductor on an H200, issue 57)."""
    from dpcs_compiler.cost.memory_model import OFFLOAD
    from dpcs_compiler.passes.rewrite.offload import offload_nodes, insert_offloads

    def step(x, w):
        return (x @ w.to(torch.bfloat16).t()).float().sum()

    x, w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True), torch.randn(64, 32, requires_grad=True)

    def offload_the_cast(problem):
        return tuple(OFFLOAD if c.nbytes == 64 * 32 * 2 else SAVE for c in problem.candidates)

    out = planned_partition(step, (x, w), (1,), offload_the_cast, host_link=True)
    (index,) = [i for i, d in enumerate(out["decisions"]) if d == OFFLOAD]
    cast = out["planning"].candidates[index].holder
    assert out["planning"].live.schedule.phase[cast] == FORWARD and cast.meta["val"].dtype == torch.bfloat16
    assert cast.name in saved_names(out["forward"], out["num_fwd_outputs"])
    (view,) = node_named(out["backward"], cast.name).users  # the transpose, remade from the saved cast
    assert view.target is torch.ops.aten.t.default
    schedule = out["planning"].schedule
    reload_before = schedule.nodes[out["problem"].reload_step(index)].name
    insert_offloads(out["forward"], out["backward"], {cast.name: reload_before})
    assert [n.args[0].name for n in offload_nodes(out["forward"]) if n.target is torch.ops.dpcs.offload.default] == [
        cast.name
    ]


def node_named(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_a_decision_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="decisions for"):
        planned_partition(mlp_step, mlp_inputs(), (1, 2, 3), lambda p: (SAVE,))


def test_a_plan_that_recomputes_a_random_value_is_refused():
    def step(x, w):
        return torch.nn.functional.dropout(torch.relu(x @ w), p=0.5, training=True).sum()

    def recompute_everything(problem):
        return (RECOMPUTE,) * len(problem.candidates)  # ignores can_recompute on purpose

    with pytest.raises(ValueError, match="recomputes random values"):
        planned_partition(step, (torch.randn(64, 32), torch.randn(32, 32, requires_grad=True)), (1,), recompute_everything)


def test_user_checkpoint_regions_do_not_override_the_plan():
    """torch's cleanup turns a recomputed node into a saved one when AC region ids say so; the plan's tags
    replace the user's, and the partition is checked against the plan."""

    def step(x, w0, w1, w2):
        return torch.utils.checkpoint.checkpoint(mlp_step, x, w0, w1, w2, use_reentrant=False)

    out = planned_partition(step, mlp_inputs(), (1, 2, 3), lambda p: (SAVE,) * len(p.candidates))
    assert {"relu", "tanh"} <= set(saved_names(out["forward"], out["num_fwd_outputs"]))


def test_parameter_casts_are_tagged_for_recomputation_and_min_cut_saves_no_copy():
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from dpcs_compiler.passes.rewrite.partition import recast_parameters_in_backward

    def step(w, x):
        w16 = w.to(torch.bfloat16)
        scale = w16.abs().amax()
        return ((x.to(torch.bfloat16) @ w16.t()) * scale).float().square().sum()

    w, x = torch.randn(64, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    graphs = trace_training(step, w, x)
    parameters = frozenset([next(n for n in graphs.joint.graph.nodes if n.op == "placeholder")])
    assert recast_parameters_in_backward(graphs.joint, parameters) >= 3  # the cast, abs and amax of w
    tagged = [n for n in graphs.joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE]
    assert all(n.op == "call_function" for n in tagged)
    assert not any(n.target is torch.ops.aten.mm.default for n in tagged)  # matmuls end the chains
    forward, _ = min_cut_rematerialization_partition(graphs.joint, [w, x], num_fwd_outputs=graphs.num_fwd_outputs)
    saved = next(n for n in forward.graph.nodes if n.op == "output").args[0][graphs.num_fwd_outputs:]
    assert not [n for n in saved if n.meta["val"].dtype == torch.bfloat16 and tuple(n.meta["val"].shape) in ((64, 32), (32, 64))]



def test_widening_casts_are_made_again_in_backward_not_saved():
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from dpcs_compiler.passes.rewrite.partition import recompute_upcasts

    def step(x, w, v):
        narrow = (x @ w).to(torch.float8_e4m3fn)  # an fp8 activation [64, 32] ...
        wide = narrow.float()  # ... that an fp32 matmul reads, as the emulated fp8 matmul does
        return (wide @ v).sin().sum()

    x, w, v = (torch.randn(*shape, requires_grad=True) for shape in ((64, 48), (48, 32), (32, 16)))

    def saved_dtypes(tag: bool):
        graphs = trace_training(step, x, w, v)
        if tag:
            schedule = Schedule.of_joint(graphs.joint, num_fwd_outputs=graphs.num_fwd_outputs)
            forward = frozenset(n for n, phase in schedule.phase.items() if phase == FORWARD)
            assert recompute_upcasts(graphs.joint, forward) == 1
        forward, _ = min_cut_rematerialization_partition(
            graphs.joint, [x, w, v], num_fwd_outputs=graphs.num_fwd_outputs
        )
        saved = next(n for n in forward.graph.nodes if n.op == "output").args[0][graphs.num_fwd_outputs:]
        return {(n.meta["val"].dtype, tuple(n.meta["val"].shape)) for n in saved if n.op != "placeholder"}

    wide_copies = {(torch.float32, (64, 32)), (torch.float32, (32, 64))}  # (transposed for v's gradient)
    assert wide_copies & saved_dtypes(tag=False)  # min-cut keeps an fp32 copy
    tagged = saved_dtypes(tag=True)
    assert not wide_copies & tagged and {(torch.float8_e4m3fn, (64, 32)), (torch.float8_e4m3fn, (32, 64))} & tagged
