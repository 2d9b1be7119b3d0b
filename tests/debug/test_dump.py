"""GraphDumper numbers files in the order written (rewritten JSON in place); new_graph_folder never reuses a folder."""

from __future__ import annotations

import json

import torch
import torch.fx as fx

from dpcs_compiler.debug.dump import SUMMARY_FILE, GraphDumper, new_graph_folder


def test_files_are_numbered_and_rewritten_json_keeps_its_number(tmp_path):
    dumper = GraphDumper(tmp_path)
    gm = fx.symbolic_trace(torch.nn.ReLU())
    dumper.write_graph("dynamo", gm)
    dumper.write_json("plan.json", {"version": 1})
    dumper.write_graph("forward.final", gm)
    dumper.write_json("plan.json", {"version": 2})
    dumper.write_json(SUMMARY_FILE, {"graph": "graph_000"})
    dumper.write_graph("forward.final", gm)  # graphs are never overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00_dynamo.txt", "01_plan.json", "02_forward.final.txt", "03_forward.final.txt", SUMMARY_FILE,
    ]
    assert json.loads((tmp_path / "01_plan.json").read_text()) == {"version": 2}
    assert "relu = torch.nn.functional.relu(" in (tmp_path / "00_dynamo.txt").read_text()


def test_new_graph_folder_adds_a_suffix_when_taken(tmp_path):
    first = new_graph_folder(tmp_path / "dumps", "graph_000")
    second = new_graph_folder(tmp_path / "dumps", "graph_000")
    assert (first.name, second.name) == ("graph_000", "graph_000_1")
    assert first.is_dir() and second.is_dir()
