"""`benchmarks/compile_time.py`: one measurement in-process on a tiny GPT-2 (dpcs with a budget, compiler
"eager": Inductor's cold compiles are what the script measures, too slow for the suite), its subprocess
wrapper, and the results file and plot from synthetic runs."""

from __future__ import annotations

import json

import pytest

from dpcs_testing import benchmark_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def compile_time():
    with benchmark_script("compile_time") as module:
        yield module


def test_one_run_reports_the_first_steps_and_dpcs_passes(compile_time):
    r = compile_time.one_run(2, "dpcs_budget", 2, 32, 2**30, "eager", quick=True)
    assert r["graphs"] == 2 and r["compiles"] >= 2  # GPT-2's own loss breaks the graph; step variants follow
    assert r["joint_nodes"] > 100 and 0 < r["pass_s"] < r["first_step_s"] < r["steps_s"]
    assert "plan/solve" in r["passes"] and set(r["solvers"]) <= {"torch min-cut", "exact", "fast"}
    assert 0 < r["peak_bytes"] <= 2**30


def test_a_failing_run_names_its_command(compile_time):
    class Args:
        batch, seq, quick = 2, 32, True

    with pytest.raises(RuntimeError, match=r"(?s)compile_time.py --one 2 bogus .*mode 'bogus' is not valid"):
        compile_time.run(2, "bogus", Args, compiler="eager")


def test_results_file_and_plot(compile_time, monkeypatch, tmp_path):
    drift = iter([1.0, 1.0, 1.0, 1.3, 1.3, 1.3, 0.9, 0.9, 0.9])  # the machine slows, then speeds up

    def fake_run(layers, mode, args, *, budget=None, compiler="inductor"):
        seconds = {"inductor": 10.0, "dpcs": 10.5, "dpcs_budget": 11.0}[mode]
        if compiler == "inductor":  # the interleaved rounds of the ratio
            seconds *= next(drift)
        return {"layers": layers, "mode": mode, "first_step_s": seconds * layers / 2, "steps_s": seconds * layers,
                "peak_bytes": 1000,
                "graphs": 2, "compiles": 2, "joint_nodes": 100 * layers, "pass_s": 0.0 if mode == "inductor" else 0.01 * layers,
                "passes": {"plan/solve": 0.01 * layers}, "replans": 0, "solvers": ["exact"], "recomputed_values": [1],
                "plan_feasible": [True]}

    monkeypatch.setattr(compile_time, "run", fake_run)
    assert compile_time.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "compile_time_cpu_quick.json").read_text())
    assert payload["torch"] and payload["device"].startswith("cpu")
    # Each mode's median run of three interleaved rounds: the drift cancels.
    assert payload["repeats"] == 3
    assert payload["targets"]["budget_ratio"] == pytest.approx(1.1) and payload["targets"]["budget_ratio_holds"]
    budgeted = payload["first_step"][2]
    assert budgeted["steps_s_all"] == pytest.approx([22.0, 28.6, 19.8]) and budgeted["steps_s"] == pytest.approx(22.0)
    assert budgeted["paired_ratios"] == pytest.approx([1.1] * 3)
    assert payload["targets"]["us_per_node_growth"] == pytest.approx(1.0)
    assert payload["targets"]["pass_time_exponent"] == pytest.approx(1.0)  # linear: pass_s and nodes both ~ layers
    assert [r["layers"] for r in payload["pass_scaling"]] == [2, 4]
    assert [len(r["pass_s_all"]) for r in payload["pass_scaling"]] == [3, 3]  # each size in every round
    assert (tmp_path / "compile_time_cpu_quick.png").read_bytes()[:8] == PNG_MAGIC


def test_the_pass_time_exponent_tells_linear_from_quadratic(compile_time):
    sizes = [(1000, 1.0), (2000, 2.0), (4000, 4.0)]
    linear = [{"joint_nodes": n, "pass_s": s} for n, s in sizes]
    quadratic = [{"joint_nodes": n, "pass_s": s * n / 1000} for n, s in sizes]
    assert compile_time.pass_time_exponent(linear) == pytest.approx(1.0)
    assert compile_time.pass_time_exponent(quadratic) == pytest.approx(2.0)
    assert compile_time.pass_time_exponent(linear[:1]) is None
