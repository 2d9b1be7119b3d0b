"""Human-readable renderings: byte sizes, memory timelines as text tables and PNG plots."""

from __future__ import annotations

from pathlib import Path

from dpcs_compiler.passes.analysis.memory_timeline import CATEGORIES, MemoryTimeline


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def timeline_table(timeline: MemoryTimeline) -> str:
    """One line per node: live bytes while it runs and after it frees, per category; the peak marked."""
    header = ["#", "node", "phase", "during", "after", *CATEGORIES]
    rows = []
    peak = timeline.peak_index
    for i, step in enumerate(timeline.steps):
        mark = " <- peak" if i == peak else ""
        rows.append(
            [str(i), step.node, step.phase, str(step.during), str(step.after)]
            + [str(step.by_category[c]) for c in CATEGORIES]
            + ([mark] if mark else [])
        )
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [
        f"resident before the step: {timeline.resident_bytes} B ({format_bytes(timeline.resident_bytes)}); "
        f"peak {timeline.peak_bytes} B ({format_bytes(timeline.peak_bytes)}) at "
        f"{timeline.peak_step.node if timeline.peak_step else '-'}",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
    ]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths + [0])).rstrip())
    return "\n".join(lines) + "\n"


def plot_timeline(timeline: MemoryTimeline, path: Path, title: str = "") -> Path:
    """Stacked live bytes per category over the step's nodes, with the peak and the backward start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(timeline.steps)))
    stacks = [[s.by_category[c] / 2**20 for s in timeline.steps] for c in CATEGORIES]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if x:
        ax.stackplot(x, stacks, labels=CATEGORIES, step="mid", alpha=0.85)
        peak = timeline.peak_index
        ax.axhline(timeline.peak_bytes / 2**20, color="black", linestyle=":", linewidth=1)
        ax.annotate(
            f"peak {format_bytes(timeline.peak_bytes)}\n{timeline.steps[peak].node}",
            (peak, timeline.peak_bytes / 2**20),
            textcoords="offset points",
            xytext=(5, -28),
            fontsize=8,
        )
        backward = next((i for i, s in enumerate(timeline.steps) if s.phase == "backward"), None)
        if backward is not None:
            ax.axvline(backward, color="grey", linestyle="--", linewidth=1, label="backward starts")
    ax.set_xlabel("node (execution order)")
    ax.set_ylabel("live MiB (simulated)")
    ax.set_title(title or "dpcs memory timeline")
    if x:
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
