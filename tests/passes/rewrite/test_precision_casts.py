"""Precision casts in the Dynamo graph: where the rules put them, shared per value, dtypes re-derived."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import FileCheck

from dpcs_testing import dynamo_graph
from dpcs_compiler.options import Fp8Options
from dpcs_compiler.passes.analysis.op_sites import module_name, op_sites
from dpcs_compiler.passes.infra import AnalysisCache, PassContext, run_rewrites
from dpcs_compiler.passes.rewrite.fp8 import Fp8Regions
from dpcs_compiler.passes.rewrite.precision import PrecisionCasts
from dpcs_compiler.plan import Plan
from dpcs_compiler.solve.precision import plan_precision


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.norm(self.proj(x))
        a = h @ self.proj.weight  # reads the weight the linear already cast
        return self.head(a.softmax(-1)) * 2.0


def rewritten(model, *inputs, precision="bf16", keep_fp32=(), fp8=None, matmul="scaled_mm"):
    gm = dynamo_graph(model, *inputs)
    ops, linears = plan_precision(op_sites(gm), precision=precision, keep_fp32=keep_fp32, fp8=fp8, fp8_matmul=matmul)
    plan = Plan("g", "f", precision=precision, precision_ops=ops, fp8_linears=linears)
    ctx = PassContext(plan=plan, analyses=AnalysisCache())
    return run_rewrites("pre_autograd", gm, [Fp8Regions(), PrecisionCasts()], ctx), plan


def dtypes_of(gm):
    return {n.name: n.meta["example_value"].dtype for n in gm.graph.nodes if isinstance(n.meta.get("example_value"), torch.Tensor)}


@pytest.mark.parametrize(
    "path, name",
    [("L['self'].blocks.0.attn", "blocks.0.attn"), ("L['self']._modules['blocks']._modules['0']", "blocks.0"),
     ("L['self'].layers[3].mlp", "layers.3.mlp"), ("L['self']", "")],
)
def test_module_names(path, name):
    assert module_name(path) == name


def test_op_sites_name_ops_and_modules():
    gm = dynamo_graph(Toy(), torch.randn(4, 32))
    sites = {s.node: s for s in op_sites(gm)}
    assert [(s.op, s.module) for s in sites.values()] == [
        ("linear", "proj"), ("layer_norm", "norm"), ("matmul", ""), ("softmax", ""), ("linear", "head"), ("mul", ""),
    ]
    head = next(s for s in sites.values() if s.module == "head")
    assert (head.linear.in_features, head.linear.out_features, head.linear.tokens) == (32, 16, 4)


def test_bf16_casts_where_the_rules_put_them():
    gm, _ = rewritten(Toy(), torch.randn(4, 32))
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
    gm, _ = rewritten(Toy(), torch.randn(4, 32), keep_fp32=["head"])
    dtypes = dtypes_of(gm)
    assert dtypes["linear_1"] == torch.float32  # the head
    assert "head_parameters_weight_.to(" not in gm.code


def test_fp32_plan_leaves_the_graph_alone():
    gm, plan = rewritten(Toy(), torch.randn(4, 32), precision="fp32", keep_fp32=["head"])
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
        .check("dpcs_compiler_runtime_fp8_fp8_linear(l_args_0_,").check("recipe = 'tensorwise'").check("matmul = 'emulated'")
        .check("out_dtype = torch.bfloat16").check("gelu")
        .check(".to(torch.bfloat16)").check("torch._C._nn.linear(")  # the 10-wide head: bf16, not fp8
        .run(gm.code))
    assert dtypes_of(gm)["input_1"] == torch.bfloat16


def test_checkpoint_regions_are_refused():
    block = nn.Linear(8, 8)

    def f(x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum()

    with pytest.raises(RuntimeError, match="do not reach into subgraphs"):
        rewritten(f, torch.randn(2, 8))
