"""Reads the dump folders of compiled graphs back and summarises them as rich tables (for `dpcs show`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from dpcs_compiler.debug.dump import SUMMARY_FILE
from dpcs_compiler.debug.render import format_bytes

log = logging.getLogger("dpcs.debug.summary")

NODE_COUNTS = ("dynamo", "joint", "forward", "backward")  # the graphs whose node counts a summary has

# A graph folder whose compile stopped before its summary was written still holds its Dynamo graph.
_FIRST_DUMP_GLOB = "*_dynamo.txt"


def graph_folders(root: Path) -> list[Path]:
    """Every graph folder under `root`, at any depth: a folder with summary.json or a dumped Dynamo graph."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = {p.parent for p in root.rglob(SUMMARY_FILE)} | {p.parent for p in root.rglob(_FIRST_DUMP_GLOB)}
    return sorted(found)


def load_summary(folder: Path) -> dict[str, Any]:
    """One graph folder's summary.json (a CompileRecord as JSON) plus `folder`.

    A folder without a readable summary yields the folder name as graph and an `error` saying why.
    """
    folder = Path(folder)
    path = folder / SUMMARY_FILE
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError(f"expected a JSON object, got {type(summary).__name__}")
    except FileNotFoundError:
        summary = {"graph": folder.name, "error": f"no {SUMMARY_FILE} (the compile stopped before the plan)"}
    except (OSError, ValueError) as error:
        log.warning("cannot read %s: %s", path, error)
        summary = {"graph": folder.name, "error": f"unreadable {SUMMARY_FILE}: {error}"}
    summary["folder"] = str(folder)
    return summary


def load_summaries(root: Path) -> list[dict[str, Any]]:
    """The summaries of every graph folder under `root`, in folder order."""
    return [load_summary(folder) for folder in graph_folders(root)]


def total_pass_seconds(summary: dict[str, Any]) -> float:
    return sum((summary.get("pass_seconds") or {}).values())


def pass_seconds(summaries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Seconds per pass ("stage/name"), summed over graphs, slowest first."""
    total: dict[str, float] = {}
    for summary in summaries:
        for name, seconds in (summary.get("pass_seconds") or {}).items():
            total[name] = total.get(name, 0.0) + seconds
    return dict(sorted(total.items(), key=lambda item: -item[1]))


def _count(value: Any, summary: dict[str, Any], part: str) -> str:
    """A node count; "-" where there is none (an inference graph has no joint or backward graph)."""
    if value is None or (summary.get("mode") == "inference" and part in ("joint", "backward")):
        return "-"
    return str(value)


def _dynamo_id(summary: dict[str, Any]) -> str:
    """Dynamo's frame/compile id (as in TORCH_LOGS), and the attempt when Dynamo restarted the compile."""
    compile_id = summary.get("compile_id")
    if compile_id is None:
        return "-"
    return f"{compile_id} (attempt {summary['attempt']})" if summary.get("attempt") else str(compile_id)


def _fallback_cell(summary: dict[str, Any]) -> str:
    if summary.get("error"):
        return "[red]incomplete[/red]"
    return "[red]yes[/red]" if summary.get("fallback") else "no"


def _graph_label(summary: dict[str, Any], root: Path | None) -> str:
    folder = Path(summary["folder"]) if summary.get("folder") else None
    if folder is None or root is None:
        return str(summary.get("graph", "?"))
    try:
        relative = folder.relative_to(root)
    except ValueError:
        return str(folder)
    return relative.as_posix() if relative != Path(".") else str(summary.get("graph", folder.name))


def summary_table(summaries: Sequence[dict[str, Any]], root: Path | None = None) -> Table:
    """One row per graph: what it is, Dynamo's compile id, node counts, saved bytes, the simulated peak, pass
    time, fallback.

    The graph column is the folder relative to `root` when given (unique even across runs into one root).
    """
    table = Table(title=f"dpcs: {len(summaries)} compiled graph{'s' if len(summaries) != 1 else ''}")
    table.add_column("graph", no_wrap=True)
    table.add_column("dynamo id", no_wrap=True)
    table.add_column("mode")
    table.add_column("compiler")
    table.add_column("precision")
    for header in NODE_COUNTS:
        table.add_column(f"{header}\nnodes", justify="right")
    table.add_column("saved", justify="right", no_wrap=True)
    table.add_column("predicted peak", justify="right", no_wrap=True)
    table.add_column("budget", justify="right", no_wrap=True)
    table.add_column("plan", no_wrap=True)
    table.add_column("peak node")
    table.add_column("plan hash", no_wrap=True)
    table.add_column("pass time", justify="right", no_wrap=True)
    table.add_column("fallback")
    for summary in summaries:
        table.add_row(
            _graph_label(summary, root),
            _dynamo_id(summary),
            str(summary.get("mode", "-")),
            str(summary.get("compiler", "-")),
            _precision_cell(summary),
            *(_count(summary.get(f"{part}_nodes"), summary, part) for part in NODE_COUNTS),
            format_bytes(summary.get("saved_bytes")),
            format_bytes(summary.get("predicted_peak_bytes")),
            format_bytes(summary.get("budget_bytes")),
            _plan_cell(summary),
            str(summary.get("peak_node") or "-"),
            str(summary.get("plan_hash") or "-"),
            f"{total_pass_seconds(summary):.3f} s",
            _fallback_cell(summary),
        )
    return table


def _precision_cell(summary: dict[str, Any]) -> str:
    """The graph's low dtype, and how many of its linears run in fp8 (summaries older than it show "-")."""
    precision = summary.get("precision")
    if precision is None:
        return "-"
    fp8, slower = summary.get("fp8_linears", 0), summary.get("fp8_slower", 0)
    kept = f" ({slower} kept: slower in fp8)" if slower else ""
    return f"{precision}, {fp8} fp8 linears{kept}" if fp8 or slower else precision


def _plan_cell(summary: dict[str, Any]) -> str:
    """"fits" / "over budget" and the counts of recomputed and offloaded values, for budgeted graphs."""
    if summary.get("budget_bytes") is None:
        return "-"
    verdict = "fits" if summary.get("plan_feasible") else "over budget"
    return f"{verdict}: {summary.get('recomputed_values', 0)} recomputed, {summary.get('offloaded_values', 0)} offloaded"


def hardware_lines(summaries: Sequence[dict[str, Any]], root: Path | None = None) -> list[str]:
    """One line per hardware profile the plans were costed with, naming its graphs; a profile of another kind
    of device than the graphs ran on (a GPU planned for from a CPU) says its peaks are predicted only."""
    graphs: dict[tuple[str, str | None], list[str]] = {}
    for summary in summaries:
        if summary.get("hardware_profile"):
            key = (summary["hardware_profile"], summary.get("planned_for"))
            graphs.setdefault(key, []).append(_graph_label(summary, root))
    lines = []
    for (profile, planned_for), names in graphs.items():
        line = f"hardware profile {profile} (plans of {', '.join(names)})"
        if planned_for:
            line += (
                f"; planned for {planned_for} from another kind of device: the predicted peaks and step times are "
                "that device's, not measured here"
            )
        lines.append(line)
    return lines


def pass_table(summaries: Sequence[dict[str, Any]]) -> Table:
    """Seconds per pass summed over the graphs, slowest first, with each pass's share of the total."""
    seconds = pass_seconds(summaries)
    total = sum(seconds.values())
    table = Table(title="time per pass (summed over graphs)")
    table.add_column("pass", no_wrap=True)
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for i, (name, value) in enumerate(seconds.items()):
        share = f"{100 * value / total:.1f} %" if total else "-"
        table.add_row(name, f"{value:.3f}", share, end_section=i == len(seconds) - 1)
    table.add_row("total", f"{total:.3f}", "", style="bold")
    return table


def problems(summaries: Sequence[dict[str, Any]], root: Path | None = None) -> list[str]:
    """One line per graph that fell back to plain Inductor or left no summary, saying why."""
    lines = []
    for summary in summaries:
        reason = summary.get("error") or summary.get("fallback")
        if reason:
            lines.append(f"{_graph_label(summary, root)}: {reason}")
    return lines
