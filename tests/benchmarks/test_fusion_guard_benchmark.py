"""`benchmarks/fusion_guard.py`: the three fusion variants of one lowest plan, side by side, on the tiny Llama."""

from __future__ import annotations

import json

import pytest

from dpcs_testing import benchmark_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.inductor
def test_variants_compile_apart_and_the_schedules_choice_is_never_higher(tmp_path):
    with benchmark_script("fusion_guard") as fusion_guard:
        assert fusion_guard.main(["--quick", "--models", "llama", "--fractions", "0.3", "--steps", "1", "--warmup", "1",
                                  "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "fusion_guard_cpu_quick.json").read_text())
    assert payload["torch"] and payload["device"]
    points = {p["rule"]: p for p in payload["models"]["llama"]["points"]}
    assert set(points) == {"by schedule", "inductor's fusions", "producers apart"}
    assert all(p["error"] is None and p["peak_bytes"] and p["step_s"] for p in points.values()), points
    # The budget is under every plan: each variant compiles the lowest plan, and the schedule's choice is the
    # lower of the other two (their fusions as they compile; peaks measured).
    assert not any(p["feasible"] for p in points.values())
    assert points["by schedule"]["backward_fusion"] in (["inductor"], ["producers apart"])
    assert points["inductor's fusions"]["backward_fusion"] == ["inductor"]
    chosen = points["by schedule"]["peak_bytes"]
    assert chosen <= max(points["inductor's fusions"]["peak_bytes"], points["producers apart"]["peak_bytes"])
    assert (tmp_path / "fusion_guard_cpu_quick.png").read_bytes().startswith(PNG_MAGIC)
