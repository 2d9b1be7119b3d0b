"""Draw a runtime's telemetry (`runtime/telemetry.py`): precision mode, memory budget, measured peak and
headroom over the steps, with each variant compile marked and each policy change named; with a `Cadence`
(`distributed/cadence.py`), the micro-batches each rank ran per sync, the anchor and the sync's overhead.

    dpcs plot TELEMETRY.jsonl -o out.png
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpcs_compiler.runtime.decisions import MODE_RANK, PRECISION_MODES


def telemetry_series(entries: Sequence[dict[str, Any]]) -> dict[str, list]:
    """The plotted series: per signal read (step, mode, budget, peak, headroom), and the compile and switch
    events (step, label)."""
    series: dict[str, list] = {"step": [], "mode": [], "budget": [], "planned": [], "peak": [], "headroom": [],
                               "compiles": [], "switches": [], "measured": [], "cadence": []}
    for entry in entries:
        step = entry["step"]
        if entry.get("kind") == "cadence":
            series["cadence"].append((step, entry["ran"], entry["anchor_ran"], entry.get("overhead"), entry.get("idle_seconds")))
            continue
        if entry.get("kind") == "measured" and entry.get("step_peak_bytes") is not None:
            series["measured"].append((step, entry["step_peak_bytes"]))
            continue
        if entry.get("kind") == "compiles":
            for event in entry["compiles"]:
                label = f"{event['decisions']} ({event['seconds']:.2f} s)" + (" FAILED" if event.get("error") else "")
                series["compiles"].append((step, label))
            continue
        if entry.get("kind") != "signals":
            continue
        signals = entry.get("signals", {})
        decisions = entry.get("decisions", {})
        series["step"].append(step)
        series["mode"].append(decisions.get("precision"))
        series["budget"].append(entry.get("budget_bytes"))
        series["planned"].append(entry.get("planned_peak_bytes"))
        series["peak"].append(signals.get("peak_bytes"))
        series["headroom"].append(signals.get("headroom"))
        if entry.get("changed") or entry.get("held"):
            series["switches"].append((step, "; ".join(entry.get("reasons") or []) or entry.get("held") or ""))
    return series


def plot_telemetry(entries: Sequence[dict[str, Any]], out: str | Path, title: str | None = None) -> Path:
    """Write the telemetry plot to `out` (PNG); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = telemetry_series(entries)
    if not series["step"] and not series["compiles"] and not series["cadence"]:
        raise ValueError("the telemetry has no signal reads, compile events or cadence syncs to plot")
    runtime = bool(series["step"] or series["compiles"])
    panels = (3 if runtime else 0) + (1 if series["cadence"] else 0)
    fig, axes = plt.subplots(panels, 1, sharex=True, figsize=(11, 2.7 * panels), squeeze=False)
    axes = list(axes[:, 0])
    if series["cadence"]:
        plot_cadence(axes[-1], series["cadence"])
    if not runtime:
        axes[0].set_title(title or "dpcs cadence: micro-batches per rank per sync")
        return _save(fig, out)
    ax_mode, ax_mem, ax_head = axes[:3]
    steps = series["step"]
    ranks = [MODE_RANK.get(m, 0) + (0.1 if m == "fp16" else 0) for m in series["mode"]]
    ax_mode.step(steps, ranks, where="post", color="tab:blue")
    modes = [m for m in PRECISION_MODES if m in set(series["mode"])] or list(PRECISION_MODES)
    ax_mode.set_yticks([MODE_RANK[m] + (0.1 if m == "fp16" else 0) for m in modes], modes)
    ax_mode.set_ylabel("precision")
    mib = 2**20
    nan = float("nan")
    in_mib = lambda values: [nan if v is None else v / mib for v in values]  # noqa: E731
    if any(b is not None for b in series["budget"]):
        ax_mem.step(steps, in_mib(series["budget"]), where="post", label="budget", color="tab:red")
    if any(p is not None for p in series["planned"]):
        ax_mem.step(steps, in_mib(series["planned"]), where="post", label="plan's predicted peak", color="tab:blue")
    if series["measured"]:
        ax_mem.plot([s for s, _ in series["measured"]], [p / mib for _, p in series["measured"]], "kx", markersize=8,
                    label="measured step peak")
    ax_mem.set_ylabel("MiB (step)")
    ax_mem.legend(loc="upper left", fontsize=8)
    process = ax_mem.twinx()  # the process's own peak: a different scale on the CPU (RSS holds torch itself)
    process.plot(steps, in_mib(series["peak"]), ".-", color="tab:green", alpha=0.4)
    process.set_ylabel("MiB (CUDA allocator / CPU process RSS peak)", color="tab:green", fontsize=8)
    ax_head.plot(steps, [h if h is not None else float("nan") for h in series["headroom"]], ".-", color="tab:purple")
    ax_head.set_ylabel("headroom")
    axes[-1].set_xlabel("step")
    for ax in axes:
        for step, _ in series["compiles"]:
            ax.axvline(step, color="tab:orange", linestyle="--", linewidth=1)
        for step, _ in series["switches"]:
            ax.axvline(step, color="tab:gray", linestyle=":", linewidth=1)
    for i, (step, label) in enumerate(series["compiles"]):
        ax_mode.annotate(f"compile: {label}", (step, 0), xycoords=("data", "axes fraction"), xytext=(3, 6 + 10 * (i % 4)),
                         textcoords="offset points", fontsize=7, color="tab:orange")
    for i, (step, label) in enumerate(series["switches"]):
        ax_head.annotate(label[:80], (step, 0), xycoords=("data", "axes fraction"), xytext=(3, 6 + 10 * (i % 4)),
                         textcoords="offset points", fontsize=7, color="tab:gray")
    ax_mode.set_title(title or "dpcs runtime: decisions over steps (orange: variant compiled; gray: decision changed)")
    return _save(fig, out)


def plot_cadence(ax, cadence: Sequence[tuple]) -> None:
    """Micro-batches each rank ran per sync (one line per rank), the anchor, and the sync's share of a round."""
    steps = [step for step, *_ in cadence]
    for rank in range(len(cadence[0][1])):
        ax.step(steps, [ran[rank] for _, ran, *_ in cadence], where="post", label=f"rank {rank}")
    ax.step(steps, [anchor for _, _, anchor, *_ in cadence], where="post", color="black", linestyle="--", label="anchor")
    ax.set_ylabel("micro-batches per sync")
    ax.legend(loc="upper left", fontsize=8)
    measured = [(step, overhead) for step, _, _, overhead, _ in cadence if overhead is not None]
    if measured:
        share = ax.twinx()
        share.plot([s for s, _ in measured], [100 * o for _, o in measured], ".", color="tab:gray")
        share.set_ylabel("sync overhead %", color="tab:gray", fontsize=8)


def _save(fig, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
