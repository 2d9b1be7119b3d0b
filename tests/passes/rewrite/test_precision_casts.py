"""Precision casts in the Dynamo graph: where the rules put them, shared per value, dtypes re-derived."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import FileCheck

from dpcs_testing import PrecisionToy, WritesBetweenReads, dynamo_graph
from dpcs_compiler.options import Fp8Options
from dpcs_compiler.passes.analysis.op_sites import op_sites
from dpcs_compiler.passes.infra import AnalysisCache, PassContext, run_rewrites
from dpcs_compiler.passes.rewrite.fp8 import Fp8Regions
from dpcs_compiler.passes.rewrite.precision import PrecisionCasts
from dpcs_compiler.plan import Plan
from dpcs_compiler.solve.precision import plan_precision


def rewritten(model, *inputs, precision="bf16", keep_fp32=(), fp8=None, matmul="scaled_mm"):
    gm = dynamo_graph(model, *inputs)
    ops, linears = plan_precision(op_sites(gm), precision=precision, keep_fp32=keep_fp32, fp8=fp8, fp8_matmul=matmul)
    plan = Plan("g", "f", precision=precision, precision_ops=ops, fp8_linears=linears)
    ctx = PassContext(plan=plan, analyses=AnalysisCache())
    return run_rewrites("pre_autograd", gm, [Fp8Regions(), PrecisionCasts()], ctx), plan


def dtypes_of(gm):
    return {n.name: n.meta["example_value"].dtype for n in gm.graph.nodes if isinstance(n.meta.get("example_value"), torch.Tensor)}


def test_bf16_casts_where_the_rules_put_them():
    gm, _ = rewritten(PrecisionToy(), torch.randn(4, 32))
    code = gm.code
    weight = "l_self_modules_proj_parameters_weight_"
    (FileCheck()
        .check("l_x_.to(torch.bfloat16)").check(f"{weight}.to(torch.bfloat16)").check("bias_.to(torch.bfloat16)")
        .check("torch._C._nn.linear(")
        .check(".to(torch.float32)").check("torch.nn.functional.layer_norm(")
        .check(".to(torch.bfloat16)").check("@ to_1")  # the norm's fp32 output is cast down; the weight is not re-cast
        .check(".to(torch.float32)").check(".softmax(")
        .check(".to(torch.bfloat16)").check("head_parameters_weight_.to(torch.bfloat16)").check("torch._C._nn.linear(")
        .check_not(".to(").check("* 2.0")
        .run(code))
    assert code.count(f"{weight}.to(") == 1
    dtypes = dtypes_of(gm)
    assert dtypes["linear"] == torch.bfloat16 and dtypes["h"] == torch.float32
    assert dtypes["a"] == torch.bfloat16 and dtypes["softmax"] == torch.float32
    assert dtypes["mul"] == torch.bfloat16  # a pointwise op follows its input
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "to":
            assert node.meta["dpcs"]["pass"] == "precision_casts"


def test_keep_fp32_module_gets_no_low_precision_op():
    gm, _ = rewritten(PrecisionToy(), torch.randn(4, 32), keep_fp32=["head"])
    dtypes = dtypes_of(gm)
    assert dtypes["linear_1"] == torch.float32  # the head
    assert "head_parameters_weight_.to(" not in gm.code


def test_fp32_plan_leaves_the_graph_alone():
    gm, plan = rewritten(PrecisionToy(), torch.randn(4, 32), precision="fp32", keep_fp32=["head"])
    assert plan.precision_ops == () and ".to(" not in gm.code


def test_double_and_integer_inputs_are_not_cast():
    def f(x, y, idx):
        return (x.double() @ y).sum() + F.linear(x, x)[idx].sum()

    gm, _ = rewritten(f, torch.randn(4, 4), torch.randn(4, 4, dtype=torch.float64), torch.tensor([1, 2]))
    code = gm.code
    assert "l_y_.to(" not in code and "l_idx_.to(" not in code
    assert code.count("l_x_.to(torch.bfloat16)") == 1  # both linear operands are the same cast


def test_fp8_regions_replace_eligible_linears():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    gm, plan = rewritten(model, torch.randn(16, 32), fp8=Fp8Options(min_size=16), matmul="emulated")
    assert [(d.node, d.fp8) for d in plan.fp8_linears] == [("input_1", True), ("input_3", False)]
    (FileCheck()
        .check("dpcs_compiler_ops_fp8_fp8_linear(l_args_0_,").check("recipe = 'tensorwise'").check("matmul = 'emulated'")
        .check("out_dtype = torch.bfloat16").check("gelu")
        .check(".to(torch.bfloat16)").check("torch._C._nn.linear(")  # the 10-wide head: bf16, not fp8
        .run(gm.code))
    assert dtypes_of(gm)["input_1"] == torch.bfloat16


def test_checkpoint_regions_are_refused():
    block = nn.Linear(8, 8)

    def f(x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum()

    with pytest.raises(RuntimeError, match="do not reach into the bodies of higher-order ops"):
        rewritten(f, torch.randn(2, 8))


def test_an_in_place_write_drops_the_shared_casts():
    gm, _ = rewritten(WritesBetweenReads(), torch.randn(4, 16))
    # y is cast for the first linear, and cast again after mul_ for the second: not the stale copy.
    FileCheck().check("y.to(torch.bfloat16)").check("torch._C._nn.linear(").check("mul_").check(
        "y.to(torch.bfloat16)"
    ).check("torch._C._nn.linear(").run(gm.code)


def test_what_an_op_writes_to_is_never_cast():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to(torch.bfloat16)
    gm, plan = rewritten(model, torch.randn(2, 3, 8, 8, dtype=torch.bfloat16))
    batch_norm = next(n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "batch_norm")
    # The running statistics are bf16 buffers it updates: it keeps all its inputs as traced.
    assert [d.dtype for d in plan.precision_ops if d.node == batch_norm.name] == ["fp32"]
    assert all(a.op == "placeholder" or a.target != "to" for a in batch_norm.all_input_nodes)

    def in_place(x, w):
        y = F.linear(x, w)
        return y.add_(x)  # a bf16 y written by an fp32 x: stays bf16, x is not cast for it

    gm, _ = rewritten(in_place, torch.randn(4, 4), torch.randn(4, 4))
    add = next(n for n in gm.graph.nodes if n.target == "add_")
    assert add.args[1].name == "l_x_" and dtypes_of(gm)[add.name] == torch.bfloat16


def test_promote_ops_cast_to_the_widest_input():
    def f(x, w):
        y = F.linear(x, w)  # bf16
        return torch.cat([y, x]), torch.lerp(y, x, 0.5), torch.dot(y[0], x[0])

    gm, plan = rewritten(f, torch.randn(4, 4), torch.randn(4, 4))
    assert {d.op: d.dtype for d in plan.precision_ops if d.rule == "autocast promote op"} == {
        "cat": "widest", "lerp": "widest", "dot": "widest"}
    dtypes = dtypes_of(gm)
    assert dtypes["cat"] == dtypes["lerp"] == dtypes["dot"] == torch.float32
    assert gm.code.count("y.to(torch.float32)") == 1  # one cast of y, shared by the three


def test_data_dependent_and_no_grad_in_place_ops_are_not_run_again():
    class ClampsItsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                self.proj.weight.clamp_(-0.1, 0.1)
            y = self.proj(x)
            return y[torch.nonzero(y > 0, as_tuple=True)].sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        gm, _ = rewritten(ClampsItsWeight(), torch.randn(4, 8))
    assert "torch._C._nn.linear(" in gm.code
