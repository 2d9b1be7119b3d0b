"""The overflow_check rewrite on real AOTAutograd backward graphs: structure, the plan switch, numerics,
Inductor, and GradScaler end to end."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from dpcs_compiler.passes.infra import AnalysisCache, PassContext, run_rewrites
from dpcs_compiler.passes.rewrite.overflow_check import OverflowCheck, floating_outputs
from dpcs_compiler.plan import Plan
from dpcs_compiler.ops.overflow import NOTE_NONFINITE, overflowed, reset_overflow, take_overflow

INF, NAN = float("inf"), float("nan")
Compiler = Callable[[fx.GraphModule, Sequence[torch.Tensor]], Callable]


@pytest.fixture(autouse=True)
def clear_flags():
    reset_overflow()
    yield
    reset_overflow()


def context(detect_overflow: bool = True) -> PassContext:
    return PassContext(plan=Plan("g", "f", detect_overflow=detect_overflow), analyses=AnalysisCache())


def keep(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
    return make_boxed_func(gm)


def mlp(x, w1, w2, rows):
    """Gradients for x, w1, w2; none for the integer `rows`."""
    h = torch.tanh(x @ w1)
    return (h @ w2)[rows].sum()


def mlp_inputs() -> list[torch.Tensor]:
    x, w1, w2 = (torch.randn(s, requires_grad=True) for s in [(4, 6), (6, 8), (8, 3)])
    return [x, w1, w2, torch.tensor([0, 2])]


@dataclasses.dataclass
class Step:
    before: str  # the backward's code before the rewrite
    backward: fx.GraphModule  # after it
    grads: list[torch.Tensor | None]


def train_step(
    inputs: Sequence[torch.Tensor], ctx: PassContext, *, grad_output: float = 1.0, final: Compiler = keep
) -> Step:
    """One step of `mlp` through aot_function; the backward is rewritten by `ctx`, then compiled by `final`.

    Inductor's decompositions, as in the dpcs pipeline, so that `final` may be Inductor.
    """
    captured: dict[str, object] = {}

    def compile_backward(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
        captured["before"] = gm.code
        captured["backward"] = run_rewrites("backward", gm, [OverflowCheck()], ctx)
        return final(gm, example_inputs)

    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    loss = aot_function(
        mlp, fw_compiler=keep, bw_compiler=compile_backward, decompositions=select_decomp_table()
    )(*leaves)
    loss.backward(torch.tensor(grad_output))
    return Step(captured["before"], captured["backward"], [t.grad for t in leaves])


def eager_grads(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    mlp(*leaves).backward()
    return [t.grad for t in leaves]


def output_args(gm: fx.GraphModule) -> tuple:
    return gm.graph.find_nodes(op="output")[0].args[0]


# --- structure ---------------------------------------------------------------------------------------------


def test_one_check_over_the_gradients_right_before_the_return():
    step = train_step(mlp_inputs(), context())
    outputs = output_args(step.backward)
    grads = [node.name for node in outputs if node is not None]
    assert len(grads) == 3 and outputs[3] is None  # x, w1, w2; nothing for the integer rows
    FileCheck().check_count("torch.ops.dpcs.note_nonfinite.default", 1, exactly=True).run(step.backward.code)
    FileCheck().check(f"torch.ops.dpcs.note_nonfinite.default([{', '.join(grads)}])").check_next("return (").run(
        step.backward.code
    )
    (note,) = step.backward.graph.find_nodes(op="call_function", target=NOTE_NONFINITE)
    assert note.next.op == "output"
    assert note.meta["val"] is None and note.meta["dpcs"] == {"pass": "overflow_check"}


def test_everything_but_the_check_is_unchanged():
    step = train_step(mlp_inputs(), context())
    without_check = [line for line in step.backward.code.splitlines() if "note_nonfinite" not in line]
    assert without_check == step.before.splitlines()


def test_plan_without_detect_overflow_changes_nothing():
    step = train_step(mlp_inputs(), context(detect_overflow=False))
    assert step.backward.code == step.before
    assert not step.backward.graph.find_nodes(op="call_function", target=NOTE_NONFINITE)


def test_graph_without_floating_outputs_is_left_alone():
    gm = make_fx(lambda x: (x.argmax(), x.shape[0] > 2), tracing_mode="fake")(torch.randn(4))
    before = gm.code
    assert floating_outputs(gm) == []
    assert not OverflowCheck().run(gm, context())
    assert gm.code == before


def test_outputs_returned_twice_are_checked_once():
    gm = make_fx(lambda x: (x.sin(), x.sin().cos(), x.long()), tracing_mode="fake")(torch.randn(4))
    sin, cos, _ = output_args(gm)
    gm.graph.find_nodes(op="output")[0].args = ((sin, cos, sin, None),)
    assert floating_outputs(gm) == [sin, cos]


def test_running_twice_adds_no_second_check():
    step = train_step(mlp_inputs(), context())
    code = step.backward.code
    assert not OverflowCheck().run(step.backward, context())
    assert step.backward.code == code


# --- numerics ----------------------------------------------------------------------------------------------


def test_finite_gradients_leave_the_flag_clear_and_match_eager():
    inputs = mlp_inputs()
    step = train_step(inputs, context())
    assert not overflowed("cpu")
    for got, expected in zip(step.grads, eager_grads(inputs)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("grad_output", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
def test_non_finite_gradients_set_the_flag(grad_output):
    step = train_step(mlp_inputs(), context(), grad_output=grad_output)
    assert not all(torch.isfinite(g).all() for g in step.grads if g is not None)
    assert overflowed("cpu")


def test_without_the_check_non_finite_gradients_go_unnoticed():
    train_step(mlp_inputs(), context(detect_overflow=False), grad_output=INF)
    assert not overflowed("cpu")


@pytest.mark.inductor
def test_check_survives_inductor_on_the_backward():
    from torch._inductor.compile_fx import compile_fx_inner

    codes: list[str] = []

    def inductor(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
        compiled = compile_fx_inner(gm, example_inputs)
        codes.append(compiled.source_code)
        return compiled

    inputs = mlp_inputs()
    with torch._inductor.config.patch(force_disable_caches=True):
        step = train_step(inputs, context(), final=inductor)
        assert not overflowed("cpu")
        for got, expected in zip(step.grads, eager_grads(inputs)):
            torch.testing.assert_close(got, expected)
        train_step(inputs, context(), grad_output=NAN, final=inductor)
    assert overflowed("cpu")
    for code in codes:
        FileCheck().check_count("torch.ops.dpcs.note_nonfinite.default(", 1, exactly=True).run(code)


# --- GradScaler end to end ---------------------------------------------------------------------------------


def scaled_step(model: torch.nn.Module, init_scale: float, x: torch.Tensor, target: torch.Tensor) -> float:
    """One fp16-autocast training step under a GradScaler on the CPU; returns the scale after `update`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), target)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale()


@pytest.mark.parametrize("init_scale", [2.0**40, 1024.0], ids=["overflowing", "fitting"])
def test_grad_scaler_skips_exactly_the_steps_the_flag_reports(init_scale):
    def rewrite_backward(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
        return make_boxed_func(run_rewrites("backward", gm, [OverflowCheck()], context()))

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=rewrite_backward))
    x, target = torch.randn(5, 8), torch.randn(5, 4)

    scale = scaled_step(compiled, init_scale, x, target)
    flagged = bool(take_overflow("cpu"))
    expected_scale = scaled_step(reference, init_scale, x, target)

    skipped = expected_scale < init_scale  # GradScaler found inf/NaN in the (fp32) parameter gradients
    assert flagged == skipped == (init_scale == 2.0**40)
    assert scale == expected_scale
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, expected)
        if not skipped:
            torch.testing.assert_close(got.grad, expected.grad)
