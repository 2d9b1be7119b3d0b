"""Telemetry: one JSON object per line, buffered and written every `every` steps.

A runtime writes a line per signal read (kind "signals": step, signals, decisions, variant, budget, the
plan's predicted peak, measured peak, why the policies moved, a hold by the thrash guard) and one per step
that compiled variants (kind "compiles": each compile event with its time). A training script may add its
own lines through `Runtime.telemetry.record` (kind "measured" with a "step_peak_bytes" is drawn too). `dpcs plot TELEMETRY.jsonl -o out.png` draws them (`debug/telemetry_plot.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Telemetry:
    """Buffered JSONL writer. A resumed run appends to the same file (`append=True`, the default)."""

    def __init__(self, path: str | Path, *, every: int = 10, append: bool = True) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Telemetry every={every!r} is not valid; valid choices: an int >= 1 (steps per write)")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not append or not self.path.exists():
            self.path.write_text("")
        self.every = every
        self._buffer: list[str] = []
        self._last_write_step: int | None = None

    def record(self, entry: dict[str, Any]) -> None:
        """Buffer one entry (it must carry its "step"); write the buffer once `every` steps have passed."""
        self._buffer.append(json.dumps(entry, sort_keys=True, default=str))
        step = int(entry["step"])
        if self._last_write_step is None:
            self._last_write_step = step - 1
        if step - self._last_write_step >= self.every:
            self.flush(step)

    def flush(self, step: int | None = None) -> None:
        if self._buffer:
            with self.path.open("a", encoding="utf-8") as out:
                out.write("\n".join(self._buffer) + "\n")
            self._buffer.clear()
        if step is not None:
            self._last_write_step = step

    def close(self) -> None:
        self.flush()


def read_telemetry(path: str | Path) -> list[dict[str, Any]]:
    """The entries of a telemetry file, in order; a line cut short by a killed process is skipped."""
    entries = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries
