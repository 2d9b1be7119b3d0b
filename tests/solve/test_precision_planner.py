"""The precision planner on hand-written op sites: autocast's lists, dpcs's additions, keep_fp32, fp8."""

from __future__ import annotations

import pytest

from dpcs_compiler.options import Fp8Options
from dpcs_compiler.types import LinearShape, OpSite
from dpcs_compiler.solve.precision import plan_precision


def site(node, op, *modules, linear=None):
    return OpSite(node, op, modules, linear)


SITES = (
    site("emb", "embedding", "tok"),
    site("ln", "layer_norm", "blocks.0", "blocks.0.norm1"),
    site("qkv", "linear", "blocks.0", "blocks.0.attn", "blocks.0.attn.qkv", linear=LinearShape(64, 192, 128)),
    site("attn", "scaled_dot_product_attention", "blocks.0", "blocks.0.attn"),
    site("act", "gelu", "blocks.0", "blocks.0.mlp"),
    site("var", "mean", "blocks.0", "blocks.0.rms"),
    site("sm", "softmax", "blocks.0"),
    site("head", "linear", "lm_head", linear=LinearShape(64, 100, 128)),
    site("loss", "cross_entropy", ""),
)


def by_node(decisions):
    return {d.node: (d.dtype, d.rule) for d in decisions}


def test_fp32_plans_nothing():
    assert plan_precision(SITES, precision="fp32") == ((), ())
    assert plan_precision(SITES, precision="fp32", keep_fp32=["lm_head"]) == ((), ())


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_autocast_lists_and_dpcs_additions(low):
    ops, linears = plan_precision(SITES, precision=low)
    assert linears == ()
    assert by_node(ops) == {
        "ln": ("fp32", "autocast fp32 op"),
        "qkv": (low, "autocast lower-precision op"),
        "attn": (low, "autocast lower-precision op"),
        "var": ("fp32", "dpcs fp32 op"),  # autocast leaves mean in the low dtype
        "sm": ("fp32", "autocast fp32 op"),
        "head": (low, "autocast lower-precision op"),
        "loss": ("fp32", "autocast fp32 op"),
    }  # embedding and gelu follow their inputs: no decision


def test_keep_fp32_covers_every_op_of_matching_modules_and_their_children():
    ops, _ = plan_precision(SITES, precision="bf16", keep_fp32=["lm_head", "*.attn"])
    decided = by_node(ops)
    assert decided["head"] == ("fp32", "keep_fp32 'lm_head'")
    assert decided["qkv"] == ("fp32", "keep_fp32 '*.attn'")  # a child of blocks.0.attn
    assert decided["attn"] == ("fp32", "keep_fp32 '*.attn'")
    assert decided["ln"] == ("fp32", "autocast fp32 op")


def test_fp8_eligibility_reasons():
    sites = (
        site("big", "linear", "mlp.up", linear=LinearShape(64, 128, 32)),
        site("odd", "linear", "mlp.odd", linear=LinearShape(64, 100, 32)),
        site("rows", "linear", "mlp.rows", linear=LinearShape(64, 128, 30)),
        site("small", "linear", "mlp.small", linear=LinearShape(32, 32, 32)),
        site("head", "linear", "lm_head", linear=LinearShape(64, 128, 32)),
        site("kept", "linear", "norm_proj", linear=LinearShape(64, 128, 32)),
    )
    fp8 = Fp8Options(recipe="rowwise", filter=["mlp.*", "norm_proj"], min_size=64, margin=1)
    ops, linears = plan_precision(sites, precision="bf16", keep_fp32=["norm_proj"], fp8=fp8, fp8_matmul="emulated")
    reasons = {d.node: (d.fp8, d.reason) for d in linears}
    assert reasons == {
        "big": (True, "rowwise fp8 linear (emulated)"),
        "odd": (False, "out_features=100 not a multiple of 16"),
        "rows": (False, "tokens=30 not a multiple of 16"),
        "small": (False, "32x32 is below min_size 64"),
        "head": (False, "module 'lm_head' matches no fp8 filter pattern ['mlp.*', 'norm_proj']"),
        "kept": (False, "kept in fp32 by keep_fp32 'norm_proj'"),
    }
    big = next(d for d in linears if d.node == "big")
    assert (big.recipe, big.matmul, big.margin) == ("rowwise", "emulated", 1.0)
    decided = by_node(ops)
    assert decided["big"] == ("fp8", "fp8 region")
    assert decided["odd"] == ("bf16", "autocast lower-precision op")  # not fp8: the region's dtype
    assert decided["kept"] == ("fp32", "keep_fp32 'norm_proj'")


def test_fp8_with_fp32_regions():
    fp8 = Fp8Options(min_size=16)
    ops, linears = plan_precision(SITES, precision="fp32", fp8=fp8)
    assert [d.node for d in linears if d.fp8] == ["qkv"]  # lm_head: 100 outputs
    assert by_node(ops) == {"qkv": ("fp8", "fp8 region")}


def test_select_faster_runs_in_fp8_only_the_linears_the_profile_says_are_faster():
    """The planner takes each eligible linear's predicted step seconds (cost/fp8.py, here the built-in H100's
    peak rates): the small one stays in the region's dtype with the reason, the large one goes fp8."""
    from dpcs_compiler.cost.fp8 import linear_seconds
    from dpcs_compiler.cost.profiles import BUILTIN_PROFILES

    h100 = BUILTIN_PROFILES["h100"][1]
    sites = [site("small", "linear", "blocks.0.attn", linear=LinearShape(1024, 1024, 2048)),
             site("large", "linear", "blocks.0.mlp", linear=LinearShape(4096, 14336, 16384)),
             site("odd", "linear", "head", linear=LinearShape(4096, 100, 16384))]
    fp8 = Fp8Options(min_size=16, select="faster")

    def speed(shape):
        return linear_seconds(h100, shape.tokens, shape.in_features, shape.out_features, recipe="tensorwise",
                              region="bf16")

    ops, linears = plan_precision(sites, precision="bf16", fp8=fp8, fp8_matmul="scaled_mm", fp8_speed=speed)
    decided = {d.node: d for d in linears}
    assert not decided["small"].fp8 and decided["small"].recipe is None
    assert decided["small"].reason.startswith("stays bf16: tensorwise fp8 would be 0.46x as fast (")
    assert "at M, K, N = 2048, 1024, 1024, casts and scales counted (peak rates)" in decided["small"].reason
    assert decided["large"].fp8 and decided["large"].speedup > 1.4
    assert decided["large"].reason.startswith("tensorwise fp8 linear (scaled_mm), 1.53x as fast as bf16 (")
    assert decided["odd"].speedup is None and "not a multiple of 16" in decided["odd"].reason  # never timed
    assert by_node(ops) == {"small": ("bf16", "autocast lower-precision op"), "large": ("fp8", "fp8 region"),
                            "odd": ("bf16", "autocast lower-precision op")}


def test_select_faster_without_an_fp8_speed_keeps_every_linear():
    from dpcs_compiler.cost.fp8 import LinearSeconds

    _, linears = plan_precision(SITES, precision="bf16", fp8=Fp8Options(min_size=16, select="faster"),
                                fp8_speed=lambda shape: LinearSeconds(None, 1e-3, "peak rates"))
    assert not any(d.fp8 for d in linears)
    assert {d.reason for d in linears if d.node == "qkv"} == {"stays bf16: the hardware profile has no fp8 matmul speed"}
