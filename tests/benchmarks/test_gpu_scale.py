"""benchmarks/gpu_scale.py: its runs' names and the issue-57 targets read from rows; the GPU figures come only
from a GPU (`benchmarks/gpu_session.sh scale`)."""

from __future__ import annotations

import json

import pytest

from dpcs_testing import load_benchmark

GiB = 2**30


def test_a_run_is_parsed_from_its_name_and_a_bad_one_names_the_valid_forms():
    RunSpec = load_benchmark("gpu_scale").RunSpec
    assert RunSpec.parse("amb:0.5") == RunSpec("amb", 0.5)
    assert RunSpec.parse("dpcs@15GiB+uncapped+expandable") == RunSpec("dpcs", None, 15 * GiB, False, True)
    assert RunSpec.parse("compile+history").history
    assert RunSpec.parse("dpcs@15GiB").strategy == "dpcs@15.00GiB"
    assert RunSpec.parse("dpcs@15GiB+uncapped+lifted").strategy == "dpcs@15.00GiB +lifted"
    explored = RunSpec.parse("dpcs@15GiB+uncapped+slack0.05")
    assert explored.slack == 0.05 and explored.explores and explored.strategy == "dpcs@15.00GiB +slack0.05"
    for bad, says in (("amb", "ratio"), ("sac@3GiB", "only dpcs"), ("fast", "valid choices"), ("dpcs+loud", r"\+uncapped"),
                      ("dpcs+slackx", "slackF")):
        with pytest.raises(ValueError, match=says):
            RunSpec.parse(bad)


def _row(strategy, kind, *, capped=True, ok=True, tokens=None, step=None, reserved=None, budget=None, first3=None,
         predicted=None, at_peak_of=(), lifted=False, group="group_0"):
    return {"strategy": strategy, "kind": kind, "capped": capped, "ok": ok, "tokens_per_s": tokens, "step_s": step,
            "lifted": lifted, "group": group,
            "peak_reserved_bytes": reserved, "budget_bytes": budget, "first3_s": first3,
            "predicted_reserved_bytes": predicted, "at_peak_of": list(at_peak_of)}


def test_the_targets_compare_dpcs_with_the_best_torch_run_that_fits_and_at_each_torch_peak():
    targets = load_benchmark("gpu_scale").targets
    rows = [
        _row("compile", "compile", ok=False),
        _row("compile", "compile", capped=False, step=0.090, reserved=16 * GiB, first3=20.0, group="group_5"),
        _row("amb 0.5", "amb", tokens=160_000, step=0.100, reserved=12 * GiB),
        _row("sac", "sac", tokens=150_000, step=0.110, reserved=11 * GiB),
        _row("dpcs", "dpcs", tokens=180_000, step=0.091, reserved=15.5 * GiB, budget=16 * GiB, first3=30.0,
             predicted=15.2 * GiB),
        _row("dpcs@12.00GiB", "dpcs", capped=False, step=0.085, reserved=11.9 * GiB, budget=12 * GiB, first3=36.0,
             predicted=12.1 * GiB, at_peak_of=["amb 0.5"], group="group_6"),
        _row("compile", "compile", capped=False, step=0.088, reserved=16 * GiB, first3=27.0, group="group_6"),
        _row("dpcs@12.00GiB +lifted", "dpcs", capped=False, step=0.080, reserved=12.4 * GiB, budget=12 * GiB,
             lifted=True),
    ]
    for row in rows[-1:]:
        row["explores"] = True
    result = targets(rows)
    assert result["under_cap"] == {"dpcs_ok": True, "best_torch": "amb 0.5", "tokens_ratio": 1.125, "holds": True}
    (pair,) = result["at_torch_peaks"]
    assert pair["torch"] == "amb 0.5" and pair["step_ratio"] == pytest.approx(0.85) and pair["holds"]
    assert result["reserved_prediction_error"]["max"] == pytest.approx(0.3 / 15.5)  # the larger miss of the two
    assert result["reserved_prediction_error"]["holds"]
    # against plain Inductor compiling beside it; the capped dpcs run's group has none that ran three steps
    assert result["first3_ratio"]["by_run"] == {"dpcs@12.00GiB": pytest.approx(36 / 27)}
    assert not result["first3_ratio"]["holds"]
    assert result["cap_cost"]["step_ratio"] == pytest.approx(0.085 / 0.080)  # the cap at the budget against none
    json.dumps(result)  # written to the results file as it is
