"""Writes a compiled graph's artefacts under one folder: graphs as text, plan, timeline, summary."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import torch.fx as fx

from dpcs_compiler.debug.render import plot_timeline, timeline_table
from dpcs_compiler.passes.analysis.memory_timeline import MemoryTimeline

SUMMARY_FILE = "summary.json"
_folder_lock = threading.Lock()


def graph_text(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def new_graph_folder(root: Path, graph: str) -> Path:
    """A fresh folder for one graph under `root` (a suffix keeps runs into the same root apart)."""
    with _folder_lock:
        root.mkdir(parents=True, exist_ok=True)
        for suffix in itertools.chain([""], (f"_{i}" for i in itertools.count(1))):
            folder = root / f"{graph}{suffix}"
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                continue
    raise AssertionError("unreachable")


class GraphDumper:
    """An instrument and a writer: every file is numbered in the order it was written.

    JSON written again under the same name (the plan, after each stage) overwrites its first file; graphs
    and timelines always get a new number (a rewrite that runs twice in a stage keeps both snapshots).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._counter = itertools.count()
        self._paths: dict[str, Path] = {}

    def _path(self, name: str, overwrite: bool = False) -> Path:
        if overwrite and name in self._paths:
            return self._paths[name]
        self._paths[name] = self.folder / f"{next(self._counter):02d}_{name}"
        return self._paths[name]

    def write_graph(self, name: str, gm: fx.GraphModule) -> Path:
        path = self._path(f"{name}.txt")
        path.write_text(graph_text(gm))
        return path

    def write_json(self, name: str, payload: Any) -> Path:
        path = self.folder / name if name == SUMMARY_FILE else self._path(name, overwrite=True)
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        return path

    def write_timeline(self, name: str, timeline: MemoryTimeline, title: str) -> None:
        self._path(f"{name}.txt").write_text(timeline_table(timeline))
        plot_timeline(timeline, self._path(f"{name}.png"), title=title)

    def before_pass(self, stage: str, name: str, gm: fx.GraphModule | None) -> None:
        if gm is not None:
            self.write_graph(f"{stage}.{name}.before", gm)

    def after_pass(self, stage: str, name: str, gm: fx.GraphModule | None, seconds: float, modified: bool) -> None:
        if gm is not None:
            self.write_graph(f"{stage}.{name}.after", gm)


def write_summary(record: Any) -> None:
    """(Re)write a graph's summary.json from its CompileRecord, if the graph is being dumped."""
    if record.dump_dir is not None:
        (Path(record.dump_dir) / SUMMARY_FILE).write_text(json.dumps(record.to_json(), indent=2, default=str) + "\n")
