"""Registration under the name "dpcs", the fail-safe, and the rewrite hooks of every stage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dpcs_testing import dpcs_compile, dynamo_graph
from dpcs_compiler import DpcsFallbackWarning, compile_records, pipeline
from dpcs_compiler.stages import compile_parts
from dpcs_compiler.stages.job import GraphJob, PlanningError
from dpcs_compiler.stages.partition import JointPartitioner
from dpcs_compiler.backend import dpcs_backend
from dpcs_compiler.passes.infra import Rewrite

FRESH_PROCESS_TRAINING = textwrap.dedent(
    """
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    compiled = torch.compile(model, backend="dpcs"{options})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    print("dpcs_compiler imported by the entry point:", "dpcs_compiler" in sys.modules, losses[0], losses[-1])
    """
)


def test_fresh_process_trains_by_backend_name_eager():
    _run_fresh(FRESH_PROCESS_TRAINING.format(options=', options={"compiler": "eager"}'))


@pytest.mark.inductor
def test_fresh_process_trains_by_backend_name_default_options():
    _run_fresh(FRESH_PROCESS_TRAINING.format(options=""))


def _run_fresh(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dpcs_compiler imported by the entry point: True" in result.stdout


def test_backend_is_listed_and_looked_up_by_name():
    assert "dpcs" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("dpcs") is dpcs_backend


def test_torch_compile_mode_is_rejected_with_a_clear_error():
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="dpcs", mode="max-autotune")
    with pytest.raises(Exception, match=r"unexpected torch.compile arguments \['mode'\]"):
        compiled(torch.randn(2, 4))


class Explodes(Rewrite):
    name = "explodes"

    def run(self, gm, ctx):
        raise RuntimeError("boom")


class ScaleOutputByOne(Rewrite):
    """Multiplies the graph's first output by 1.0: changes the graph, not the numbers."""

    name = "scale_output_by_one"

    def __init__(self):
        self.created = []

    def run(self, gm, ctx):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        first = output.args[0][0]
        with gm.graph.inserting_before(output):
            scaled = gm.graph.call_function(torch.mul, (first, 1.0))
        output.args = ((scaled, *output.args[0][1:]),)
        self.created.append(scaled)
        return True


def _mlp_and_reference():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    return model, x, model(x).square().sum()


@pytest.mark.inductor
def test_failing_stage_falls_back_to_plain_inductor_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(pipeline, "PRE_AUTOGRAD_REWRITES", (Explodes(),))
    model, x, expected = _mlp_and_reference()
    compiled = torch.compile(model, backend="dpcs", options={"dump_dir": tmp_path})
    with pytest.warns(DpcsFallbackWarning, match=r"falls back to plain Inductor.*boom.*dump folder: .*graph_"):
        loss = compiled(x).square().sum()
    loss.backward()
    torch.testing.assert_close(loss, expected)
    (record,) = compile_records()
    assert "boom" in record.fallback
    on_disk = json.loads((Path(record.dump_dir) / "summary.json").read_text())
    assert "boom" in on_disk["fallback"]


def test_failing_stage_raises_when_strict(monkeypatch):
    monkeypatch.setattr(pipeline, "PRE_AUTOGRAD_REWRITES", (Explodes(),))
    model, x, _ = _mlp_and_reference()
    with pytest.raises(Exception, match="dpcs rewrite pre_autograd/explodes failed: boom"):
        dpcs_compile(model)(x)


def _partition_stage_explodes(monkeypatch):
    """The partition stage (the plan, under a budget; torch's min-cut without one) raises "boom"."""

    def explode(self, joint, joint_inputs, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(JointPartitioner, "__call__", explode)


@pytest.mark.parametrize("options", [{}, {"strict": True}, {"strict": False, "on_failure": "error"}],
                         ids=["default", "strict", "on_failure_error"])
def test_a_graph_dpcs_cannot_plan_under_a_budget_raises_naming_the_graph_and_the_cause(monkeypatch, options):
    """A fallback to plain Inductor would drop the budget in silence (issue 57): the error says which graph,
    why, and how to ask for the fallback, whatever `strict` says."""
    _partition_stage_explodes(monkeypatch)
    model, x, _ = _mlp_and_reference()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "memory_budget": "1GiB", **options})
    with pytest.raises(Exception) as raised:
        compiled(x)
    error = getattr(raised.value, "inner_exception", raised.value)  # Dynamo wraps a backend's error
    assert isinstance(error, PlanningError) and isinstance(error.__cause__, RuntimeError)
    (record,) = compile_records()
    assert re.search(rf"could not compile {record.graph} under memory_budget=1073741824: RuntimeError: boom", str(error))
    assert ("on_failure': 'fallback'" in str(error)) == (options == {})
    assert record.fallback is None


def _assert_gradients_are_eagers(model, expected_loss):
    """The gradients the compiled step left equal those of the eager loss's backward."""
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected_loss.backward()
    for grad, param in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, param.grad)


@pytest.mark.inductor
@pytest.mark.parametrize("options", [{"memory_budget": "1GiB", "on_failure": "fallback"}, {}], ids=["asked", "no_budget"])
def test_a_graph_dpcs_cannot_plan_falls_back_when_asked_or_without_a_budget(monkeypatch, options):
    _partition_stage_explodes(monkeypatch)
    model, x, expected = _mlp_and_reference()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", **options})
    dropped = "its memory_budget is NOT applied" if options else "pass options=.'strict': True. to raise"
    with pytest.warns(DpcsFallbackWarning, match=rf"compile graph_\d+ and falls back to plain Inductor.*boom.*{dropped}"):
        loss = compiled(x).square().sum()
    loss.backward()
    torch.testing.assert_close(loss, expected)
    _assert_gradients_are_eagers(model, expected)
    assert "boom" in compile_records()[0].fallback


def test_on_failure_error_raises_without_a_budget(monkeypatch):
    _partition_stage_explodes(monkeypatch)
    model, x, _ = _mlp_and_reference()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "on_failure": "error"})
    with pytest.raises(Exception, match=r"PlanningError: dpcs could not compile graph_\d+: RuntimeError: boom"):
        compiled(x)


@pytest.mark.parametrize("strict", [False, True])
def test_failing_backward_rewrite_is_skipped_unless_strict(monkeypatch, strict):
    monkeypatch.setattr(compile_parts, "BACKWARD_REWRITES", (Explodes(),))
    model, x, expected = _mlp_and_reference()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": strict})
    if strict:
        with pytest.raises(Exception, match="boom"):
            compiled(x).square().sum().backward()
        return
    with pytest.warns(UserWarning, match="backward stage failed.*boom"):
        loss = compiled(x).square().sum()
        loss.backward()
    torch.testing.assert_close(loss, expected)
    assert "backward stage skipped" in compile_records()[0].fallback


@pytest.mark.parametrize("stage", ["PRE_AUTOGRAD_REWRITES", "FORWARD_REWRITES", "INFERENCE_REWRITES"])
def test_stage_rewrites_run_stamp_their_nodes_and_keep_numerics(monkeypatch, tmp_path, stage):
    rewrite = ScaleOutputByOne()
    monkeypatch.setattr(pipeline if stage == "PRE_AUTOGRAD_REWRITES" else compile_parts, stage, (rewrite,))
    model, x, expected = _mlp_and_reference()
    compiled = dpcs_compile(model, dump_dir=tmp_path)
    if stage == "INFERENCE_REWRITES":
        with torch.no_grad():
            torch.testing.assert_close(compiled(x).square().sum(), expected.detach())
    else:
        loss = compiled(x).square().sum()
        loss.backward()
        torch.testing.assert_close(loss, expected)
    (record,) = compile_records()
    kind = {"PRE_AUTOGRAD_REWRITES": "pre_autograd", "FORWARD_REWRITES": "forward", "INFERENCE_REWRITES": "inference"}[stage]
    assert f"{kind}/scale_output_by_one" in record.pass_seconds
    folder = Path(record.dump_dir)
    assert folder.parent == tmp_path
    after = next(folder.glob(f"*_{kind}.scale_output_by_one.after.txt")).read_text()
    before = next(folder.glob(f"*_{kind}.scale_output_by_one.before.txt")).read_text()
    assert after.count("torch.mul(") == before.count("torch.mul(") + 1
    (created,) = rewrite.created
    assert created.meta["dpcs"] == {"pass": "scale_output_by_one"}


def test_failing_dump_write_in_the_lazy_backward_stage_does_not_kill_training(monkeypatch, tmp_path):
    real_dump_graph = GraphJob.dump_graph

    def dump_graph(self, name, gm):
        if name == "backward.final":
            raise OSError("disk full")
        return real_dump_graph(self, name, gm)

    monkeypatch.setattr(GraphJob, "dump_graph", dump_graph)
    model, x, expected = _mlp_and_reference()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "dump_dir": tmp_path})
    with pytest.warns(UserWarning, match="backward stage failed.*disk full"):
        loss = compiled(x).square().sum()
        loss.backward()
    torch.testing.assert_close(loss, expected)
    _assert_gradients_are_eagers(model, expected)
    assert "disk full" in compile_records()[0].fallback


@pytest.mark.parametrize("memory_budget", [None, 10**9])
def test_the_partitioner_sees_dynamos_parameters_as_static_inputs_as_torch_compile_does(monkeypatch, memory_budget):
    """dpcs compiles copies of Dynamo's graph (Inductor mutates what it compiles); each copy keeps what Dynamo
    puts beside the graph, so AOTAutograd takes it for Dynamo's and hands the partitioner the parameters as
    static inputs, as for torch.compile. Without it min-cut partitioned differently (8 KiB more at the bench
    GPT's peak than torch.compile, no budget)."""
    from dpcs_compiler.stages.partition import JointPartitioner

    seen = []
    original = JointPartitioner.__call__

    def spy(self, joint, joint_inputs, **kwargs):
        seen.append(kwargs.get("static_lifetime_input_indices"))
        return original(self, joint, joint_inputs, **kwargs)

    monkeypatch.setattr(JointPartitioner, "__call__", spy)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 16)
    placeholders = [n for n in dynamo_graph(model, x).graph.nodes if n.op == "placeholder"]
    parameters = [i for i, n in enumerate(placeholders) if "_parameters" in n.name]
    assert len(parameters) == 4
    torch._dynamo.reset()
    compiled = dpcs_compile(model, memory_budget=memory_budget)
    compiled(x).sum().backward()
    assert seen and sorted(seen[0] or []) == parameters  # the four parameters; the input is not static
