"""A stand-in's step view: the graph as the compiler it stands in for will run it (`GraphJob.step_view`)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes" / "analysis"))
from training_graphs import trace_training  # noqa: E402

from dpcs_compiler.cost.memory_model import RECOMPUTE, SAVE, Candidate, MemoryProblem  # noqa: E402
from dpcs_compiler.options import DpcsOptions  # noqa: E402
from dpcs_compiler.passes.infra import copy_graph_module  # noqa: E402
from dpcs_compiler.stages.job import GraphJob, StepView  # noqa: E402
from dpcs_compiler.stages.memory_plan import _as_compiler_traces  # noqa: E402


def problem(*names: str) -> MemoryProblem:
    steps = len(names) * 2 + 2
    return MemoryProblem(
        base_bytes=np.zeros(steps, dtype=np.int64),
        base_before_bytes=np.zeros(steps, dtype=np.int64),
        step_seconds=np.ones(steps),
        backward_start=len(names) + 1,
        candidates=tuple(Candidate(n, 8, i, i, len(names) + 1 + i, len(names) + 1 + i) for i, n in enumerate(names)),
    )


def test_a_stand_ins_decisions_read_as_the_views_by_value_name():
    """The view's candidates can differ from the stand-in's (its compiler fuses a value away, or has one the
    stand-in has not): each takes the stand-in's decision for the value of that name, and one it lacks is saved."""
    view = StepView(problem("relu", "mul", "tanh"), sharing=None, node_names=())
    assert view.decisions(problem("tanh", "clone", "relu"), (RECOMPUTE, RECOMPUTE, SAVE)) == (SAVE, SAVE, RECOMPUTE)


def step(x, w0, w1):
    h = torch.relu(x @ w0).clone()  # a copy Inductor's joint-graph passes take out (eager runs it)
    return torch.tanh(h @ w1).sum()


def test_the_view_of_an_inductor_graph_is_its_joint_after_inductors_joint_passes():
    """An eager stand-in runs the joint graph as traced; Inductor partitions it after its joint-graph passes,
    which take out what computes nothing (the clone here: 128 KiB the eager graph holds)."""
    x = torch.randn(256, 128)
    joint = trace_training(step, x, *(torch.randn(128, 128, requires_grad=True) for _ in range(2))).joint
    assert "clone" in [n.name for n in joint.graph.nodes]
    view = _as_compiler_traces(copy_graph_module(joint), "inductor", torch.device("cpu"))
    assert "clone" not in [n.name for n in view.graph.nodes]
    assert _as_compiler_traces(joint, "eager", torch.device("cpu")) is joint


def test_a_deferred_step_view_is_built_once_at_its_first_use():
    """A stand-in's view is built when the step first reads it (`GraphJob.defer_step_view`), once; it counts as
    the job's view from the start (a re-plan does not defer another), and one set directly replaces it."""
    job = GraphJob.start(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [torch.randn(1, 2)],
                         DpcsOptions.from_dict({"compiler": "eager"}))
    built: list[StepView] = []

    def build() -> StepView:
        built.append(StepView(problem("relu"), sharing=None, node_names=("relu",)))
        return built[-1]

    assert not job.has_step_view
    job.defer_step_view(build)
    assert job.has_step_view and not built
    assert job.step_view is built[0] and job.step_node_names == ("relu",)
    assert job.step_view is built[0] and len(built) == 1
    job.defer_step_view(build)
    job.step_view = None  # set: the deferred one is dropped
    assert job.step_view is None and len(built) == 1 and not job.has_step_view
