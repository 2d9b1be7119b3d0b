"""benchmarks/precision_numerics.py: its fp8 linear table (the figures the README quotes) and its plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpcs_testing import benchmark_script

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def numerics():
    with benchmark_script("precision_numerics") as module:
        yield module


def test_fp8_linear_table(numerics):
    rows = numerics.fp8_linear_table(quick=True)
    assert len(rows) == 8  # 2 recipes x 2 gradient formats x 2 input dtypes
    for row in rows:
        assert row["out_sqnr_db"] >= 28.0, row
        floor = 28.0 if row["grad_dtype"] == "e4m3" else 23.0  # e5m2's 2-bit mantissa: ~24.6 dB
        assert min(row["grad_x_sqnr_db"], row["grad_w_sqnr_db"]) >= floor, row


def test_plot_and_tables(numerics, tmp_path, capsys):
    memory = {"predicted_peak_bytes": 2**20, "measured_peak_bytes": 2**20, "relative_error": 0.0}
    results = {
        "device_name": "cpu", "torch": "x",
        "fp8_linear": numerics.fp8_linear_table(quick=True)[:1],
        "step": [{"model": "gpt", "config": "bf16", "loss_rel_error": 0.0, "grad_sqnr_min_db": 40.0,
                  "grad_sqnr_median_db": 45.0, "grad_max_rel_error": 0.01}],
        "loss_curves": {"fp32_eager": {"losses": [2.0, 1.0]},
                        "bf16": {"losses": [2.0, 1.01], "max_rel_gap": 0.01, "mean_rel_gap": 0.005}},
        "memory": [{"compiler": "eager", "budget": None, "config": c, **memory} for c in ("fp32", "bf16")],
    }
    numerics.plot(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)
    numerics.print_tables(results)
    assert "1.00% / 0.50%" in capsys.readouterr().out
