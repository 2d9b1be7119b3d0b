"""benchmarks/precision_speed.py: a quick CPU run through the cheap path (dpcs compiler="eager"), bf16 and
tensorwise fp8 timed, torchao recorded as skipped where it is not installed; the pure helpers on toy input."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dpcs_testing import benchmark_script

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICK_LINEARS = 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head


@pytest.fixture(scope="module")
def precision_speed():
    with benchmark_script("precision_speed") as module:
        yield module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, precision_speed):
    out = tmp_path_factory.mktemp("precision_speed")
    torch._dynamo.reset()
    status = precision_speed.main([
        "--quick", "--device", "cpu", "--compiler", "eager", "--out", str(out),
        "--strategies", "bf16,fp8_tensorwise,torchao_tensorwise", "--fp8-select", "all",  # on a CPU fp8 is never faster
    ])
    torch._dynamo.reset()
    return status, out


@pytest.mark.slow
def test_quick_run_writes_results(quick_run):
    status, out = quick_run
    assert status == 0
    payload = json.loads((out / "precision_speed_cpu_quick.json").read_text())
    assert payload["torch"] == torch.__version__ and payload["device"].startswith("cpu")
    assert payload["device_type"] == "cpu" and payload["quick"] is True and payload["speed_meaningful"] is False
    assert payload["sizes"]["hidden"] == 64 and payload["tokens_per_step"] == 2 * 32
    assert payload["linears"] == QUICK_LINEARS and payload["fp8"]["eligible_linears"] == QUICK_LINEARS
    assert (out / "precision_speed_cpu_quick.png").read_bytes()[:8] == PNG_MAGIC

    results = payload["strategies"]
    assert list(results) == ["bf16", "fp8_tensorwise", "torchao_tensorwise"]
    for name in ("bf16", "fp8_tensorwise"):
        r = results[name]
        assert r["error"] is None, (name, r["error"])
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["peak_bytes"] > r["resident_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(payload["tokens_per_step"] / (r["step_ms"] / 1e3))
        assert [rec["precision"] for rec in r["records"]] == ["bf16"]
    assert results["bf16"]["fp8_linears"] == 0 and results["bf16"]["ratio_vs_bf16"] == pytest.approx(1.0)
    fp8 = results["fp8_tensorwise"]
    assert fp8["fp8_linears"] == QUICK_LINEARS
    assert fp8["options"]["fp8"] == {"recipe": "tensorwise", "min_size": 16, "matmul": "auto", "select": "all"}
    assert fp8["fp8_matmul"] in ("scaled_mm", "emulated")
    assert fp8["ratio_vs_bf16"] == pytest.approx(fp8["tokens_per_s"] / results["bf16"]["tokens_per_s"])
    assert fp8["meets_target"] == (fp8["ratio_vs_bf16"] >= payload["target_ratio_vs_bf16"])


@pytest.mark.slow
def test_quick_run_torchao(quick_run):
    """Without torchao the strategy is skipped with the reason, not an error; with it, it ran and converted
    the same linears dpcs made fp8."""
    _, out = quick_run
    r = json.loads((out / "precision_speed_cpu_quick.json").read_text())["strategies"]["torchao_tensorwise"]
    if importlib.util.find_spec("torchao") is None:
        assert r["error"] is None and "torchao" in r["skipped"] and r["tokens_per_s"] is None
    else:
        assert r.get("skipped") is None and (r["error"] is not None or r["fp8_linears"] == QUICK_LINEARS)


def test_torchao_strategy_with_a_stand_in(precision_speed, monkeypatch, tmp_path):
    """The torchao path (torchao is not installed here): a stand-in `torchao.float8` whose conversion retypes
    the linears its filter accepts; the strategy converts what dpcs's rule picks, compiles and runs."""
    import types

    class Float8Linear(nn.Linear):
        pass

    asked = []

    def convert_to_float8_training(module, *, module_filter_fn=None, config=None):
        assert config == ("recipe", "rowwise")
        for fqn, mod in module.named_modules():
            if isinstance(mod, nn.Linear) and module_filter_fn(mod, fqn):
                asked.append(fqn)
                mod.__class__ = Float8Linear
        return module

    config = types.SimpleNamespace(from_recipe_name=lambda name: ("recipe", name))
    float8 = types.ModuleType("torchao.float8")
    float8.Float8LinearConfig, float8.convert_to_float8_training = config, convert_to_float8_training
    torchao = types.ModuleType("torchao")
    torchao.float8 = float8
    monkeypatch.setitem(sys.modules, "torchao", torchao)
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    torch._dynamo.reset()
    status = precision_speed.main([
        "--quick", "--device", "cpu", "--compiler", "eager", "--out", str(tmp_path), "--strategies", "torchao_rowwise",
        "--vocab", "120",  # an LM head of 64 x 120: not a multiple of 16, left in high precision
    ])
    torch._dynamo.reset()
    assert status == 0
    r = json.loads((tmp_path / "precision_speed_cpu_quick.json").read_text())["strategies"]["torchao_rowwise"]
    assert r["error"] is None and r["tokens_per_s"] > 0 and r["ratio_vs_bf16"] is None
    assert r["fp8_linears"] == len(asked) == QUICK_LINEARS - 1 and "lm.lm_head" not in asked


@pytest.mark.parametrize(
    ("module", "min_size", "eligible"),
    [
        (nn.Linear(64, 176), 16, True),
        (nn.Linear(64, 176), 1024, False),  # below min_size
        (nn.Linear(64, 100), 16, False),  # out_features not a multiple of 16
        (nn.Conv1d(64, 64, 1), 16, False),  # not a linear
    ],
)
def test_fp8_eligible(precision_speed, module, min_size, eligible):
    assert precision_speed.fp8_eligible(module, min_size) is eligible


def test_summarize(precision_speed):
    results = {
        "bf16": {"step_s": 0.5},
        "fp8_tensorwise": {"step_s": 0.4},
        "fp8_rowwise": {"step_s": None, "error": "RuntimeError: x"},
        "torchao_tensorwise": {"skipped": "torchao is not available"},
    }
    precision_speed.summarize(results, tokens_per_step=1000)
    assert results["bf16"]["tokens_per_s"] == pytest.approx(2000) and results["bf16"]["step_ms"] == pytest.approx(500)
    assert results["fp8_tensorwise"]["ratio_vs_bf16"] == pytest.approx(1.25)
    assert results["fp8_tensorwise"]["meets_target"] is True
    assert results["fp8_rowwise"]["tokens_per_s"] is None and results["fp8_rowwise"]["meets_target"] is None
    torchao = results["torchao_tensorwise"]
    assert torchao["ratio_vs_bf16"] is None and "meets_target" not in torchao


def test_fp8_strategies_choose_their_linears_as_asked(precision_speed):
    """fp8_* use --fp8-select (the default "auto": on a GPU, the linears the profile says are faster); fp8all_*
    convert every eligible linear, so a GPU run shows what the choice gained."""
    strategies, skipped = precision_speed.build_strategies(
        ["fp8_tensorwise", "fp8all_rowwise"], device=torch.device("cpu"), fp8_min_size=16, fp8_matmul="auto",
        compiler="eager", fp8_select="faster")
    assert not skipped
    selects = {s.name: s.result["options"]["fp8"]["select"] for s in strategies}
    assert selects == {"fp8_tensorwise": "faster", "fp8all_rowwise": "all"}


def test_the_8b_slice_preset_and_its_checks(precision_speed):
    parser = precision_speed.build_parser()
    args = parser.parse_args(["--preset", "8b_slice", "--layers", "3"])
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in precision_speed.PRESETS[args.preset].items()}
    assert (sizes["hidden"], sizes["intermediate"], sizes["heads"], sizes["kv_heads"], sizes["layers"]) == \
        (4096, 14336, 32, 8, 3)
    with pytest.raises(SystemExit):
        precision_speed.main(["--quick", "--device", "cpu", "--heads", "2", "--kv-heads", "3"])


def test_a_grouped_query_llama_has_fewer_key_value_heads():
    from dpcs_compiler.models import LlamaLM, LlamaSize

    model = LlamaLM(LlamaSize(vocab=64, hidden=64, intermediate=96, layers=1, heads=4, seq=16, kv_heads=2))
    attention = model.lm.model.layers[0].self_attn
    assert (attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features) == (64, 32, 32)
    assert model(torch.randint(0, 64, (2, 16))).isfinite()
