"""Reading dump folders back: which folders are graphs, their summaries, the tables `dpcs show` prints."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from dpcs_compiler.debug.summary import (
    graph_folders,
    hardware_lines,
    load_summaries,
    pass_seconds,
    pass_table,
    problems,
    summary_table,
)
from dpcs_compiler.report import CompileRecord


def render(table) -> str:
    console = Console(file=io.StringIO(), width=240)
    console.print(table)
    return console.file.getvalue()


def write_record(folder, compile_id=None, attempt=0, **fields):
    folder.mkdir(parents=True)
    record = CompileRecord(graph=folder.name, compiler="eager", dump_dir=str(folder), **fields)
    (folder / "summary.json").write_text(json.dumps(record.to_json() | {"compile_id": compile_id, "attempt": attempt}))


H100 = "cuda:NVIDIA H100 80GB HBM3:9.0: built-in 'h100' (NVIDIA H100 SXM5 80GB, datasheet) #c3bf7dbe9007"
CPU = "cpu:AMD EPYC:2: measured 2026-11-24T18:58:56+00:00, cached at /c/x.json #651e4a27dc3b"


@pytest.fixture
def dumps(tmp_path):
    """Two runs into one root (one nested), a graph that fell back, and one that stopped before its summary."""
    root = tmp_path / "dumps"
    write_record(
        root / "graph_000", compile_id="0/0", dynamo_nodes=9, joint_nodes=31, forward_nodes=11, backward_nodes=25,
        saved_bytes=1024, predicted_peak_bytes=7072, peak_node="sum_2", precision="bf16", fp8_linears=3,
        pass_seconds={"joint/analyses": 0.25, "partition/min_cut": 0.5}, plan_hash="0123456789abcdef",
        hardware_profile=H100, planned_for="cuda:NVIDIA H100 80GB HBM3:9.0",
    )
    write_record(
        root / "run2" / "graph_000", compile_id="1/0", attempt=1, mode="inference", dynamo_nodes=4, forward_nodes=5,
        predicted_peak_bytes=3 * 2**20, peak_node="addmm",
        pass_seconds={"inference/analyses": 0.125, "joint/analyses": 0.25},
    )
    write_record(root / "graph_001", fallback="RuntimeError: boom", hardware_profile=H100,
                 planned_for="cuda:NVIDIA H100 80GB HBM3:9.0")
    write_record(root / "graph_003", hardware_profile=CPU)
    (root / "graph_002").mkdir()
    (root / "graph_002" / "00_dynamo.txt").write_text("graph")
    (root / "not_a_graph").mkdir()
    (root / "not_a_graph" / "notes.txt").write_text("")
    return root


def test_graph_folders_are_found_at_any_depth(dumps):
    assert [f.relative_to(dumps).as_posix() for f in graph_folders(dumps)] == [
        "graph_000", "graph_001", "graph_002", "graph_003", "run2/graph_000",
    ]
    assert graph_folders(dumps / "missing") == []


def test_load_summaries_reads_records_and_names_incomplete_folders(dumps):
    summaries = {s["folder"]: s for s in load_summaries(dumps)}
    first = summaries[str(dumps / "graph_000")]
    assert (first["graph"], first["predicted_peak_bytes"], first["peak_node"]) == ("graph_000", 7072, "sum_2")
    incomplete = summaries[str(dumps / "graph_002")]
    assert incomplete["graph"] == "graph_002"
    assert "no summary.json" in incomplete["error"]


def test_unreadable_summary_is_reported_not_raised(tmp_path):
    (tmp_path / "graph_000").mkdir()
    (tmp_path / "graph_000" / "summary.json").write_text("{not json")
    [summary] = load_summaries(tmp_path)
    assert summary["error"].startswith("unreadable summary.json")


def test_pass_seconds_are_summed_over_graphs_slowest_first(dumps):
    assert pass_seconds(load_summaries(dumps)) == {
        "partition/min_cut": 0.5, "joint/analyses": 0.5, "inference/analyses": 0.125,
    }


def test_summary_table_has_one_row_per_graph(dumps):
    text = render(summary_table(load_summaries(dumps), root=dumps))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]] for line in text.splitlines()
            if line.startswith("│")}
    assert set(rows) == {"graph_000", "graph_001", "graph_002", "graph_003", "run2/graph_000"}
    assert rows["graph_000"] == [
        "0/0", "training", "eager", "bf16, 3 fp8 linears", "9", "31", "11", "25", "1.00 KiB", "6.91 KiB", "-", "-",
        "sum_2", "0123456789abcdef", "0.750 s", "no",
    ]
    assert rows["run2/graph_000"][:8] == ["1/0 (attempt 1)", "inference", "eager", "fp32", "4", "-", "5", "-"]
    assert rows["run2/graph_000"][9:13] == ["3.00 MiB", "-", "-", "addmm"]
    assert rows["graph_001"][0] == "-"
    assert rows["graph_001"][-1] == "yes"
    assert rows["graph_002"][-1] == "incomplete"
    assert "5 compiled graphs" in text


def test_hardware_lines_name_each_profile_its_graphs_and_a_plan_for_another_device(dumps):
    assert hardware_lines(load_summaries(dumps), root=dumps) == [
        f"hardware profile {H100} (plans of graph_000, graph_001); planned for cuda:NVIDIA H100 80GB HBM3:9.0 from "
        "another kind of device: the predicted peaks and step times are that device's, not measured here",
        f"hardware profile {CPU} (plans of graph_003)",
    ]


def test_pass_table_and_problems(dumps):
    summaries = load_summaries(dumps)
    text = render(pass_table(summaries))
    assert "partition/min_cut" in text and "44.4 %" in text and "1.125" in text
    assert problems(summaries, root=dumps) == [
        "graph_001: RuntimeError: boom",
        "graph_002: no summary.json (the compile stopped before the plan)",
    ]


def test_plan_cell_of_a_budgeted_graph():
    from dpcs_compiler.debug.summary import _plan_cell

    assert _plan_cell({}) == "-"
    assert _plan_cell({"budget_bytes": 10, "plan_feasible": True, "recomputed_values": 3}) == (
        "fits: 3 recomputed, 0 offloaded"
    )
    assert _plan_cell({"budget_bytes": 10, "plan_feasible": False, "recomputed_values": 5, "offloaded_values": 1}) == (
        "over budget: 5 recomputed, 1 offloaded"
    )
