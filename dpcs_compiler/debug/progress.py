"""Progress on the terminal for dpcs work that takes more than a couple of seconds (rich), quiet otherwise.

    with progress.task("dpcs bench", total=6) as bar:
        for model in models:
            ...
            bar.advance(detail=model)

Tasks nest (a benchmark's model, the graph it compiles, the pass running): each is a line of one rich
`Progress` on stderr, shown only once the task has run `DELAY` seconds, so that work ending sooner prints
nothing, and erased when it ends. `detail(text)` names what the innermost task is doing now (a pass, a
solver attempt). Quiet unless stderr is a terminal, when `DPCS_PROGRESS` is "0" (or "off"), or when the
user's logging silenced dpcs (the `dpcs` logger set above WARNING); `DPCS_PROGRESS=1` shows it on any stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

DELAY = 2.0  # seconds a task runs before it is shown
ENV = "DPCS_PROGRESS"
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")

_lock = threading.RLock()
_tasks: list[Task] = []
_display: Any = None  # the rich Progress shown now, if any
_timer: threading.Timer | None = None
console: Any = None  # tests set a rich Console to render into; None: stderr


def enabled() -> bool:
    """Whether progress may show: the variable, then the user's logging, then whether stderr is a terminal."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in _OFF:
        return False
    if logging.getLogger("dpcs").getEffectiveLevel() > logging.WARNING:
        return False
    return setting in _ON or console is not None or sys.stderr.isatty()


class Task:
    """One line of progress: a description, an optional total, what it is doing now."""

    def __init__(self, description: str, total: float | None) -> None:
        self.description = description
        self.total = total
        self.completed = 0.0
        self.now = ""
        self.started = time.monotonic()
        self.rich_id: Any = None  # its task in the display, once shown

    def advance(self, amount: float = 1, detail: str | None = None) -> None:
        with _lock:
            self.completed += amount
            if detail is not None:
                self.now = detail
            self._render()

    def detail(self, text: str) -> None:
        with _lock:
            self.now = text
            self._render()

    def _label(self) -> str:
        return f"{self.description}: {self.now}" if self.now else self.description

    def _render(self) -> None:
        if _display is not None and self.rich_id is not None:
            _display.update(self.rich_id, description=self._label(), completed=self.completed, total=self.total,
                            refresh=True)


class _Quiet(Task):
    def advance(self, amount: float = 1, detail: str | None = None) -> None:
        pass

    def detail(self, text: str) -> None:
        pass


@contextlib.contextmanager
def task(description: str, total: float | None = None) -> Iterator[Task]:
    """A task for the `with` body; quiet (a no-op task) where progress is off."""
    if not enabled():
        yield _Quiet(description, total)
        return
    current = Task(description, total)
    with _lock:
        _tasks.append(current)
        _schedule()
    try:
        yield current
    finally:
        with _lock:
            _tasks.remove(current)
            if _display is not None and current.rich_id is not None:
                _display.remove_task(current.rich_id)
            if not _tasks:
                _stop()


def detail(text: str) -> None:
    """What the innermost open task is doing now (a no-op when none is open)."""
    with _lock:
        if _tasks:
            _tasks[-1].detail(text)


def _schedule() -> None:
    global _timer
    if _timer is None:
        _timer = threading.Timer(DELAY, _show_due)
        _timer.daemon = True
        _timer.start()


def _show_due() -> None:
    """Show the tasks that have run DELAY seconds (starting the display), and come back for the others."""
    global _display, _timer
    with _lock:
        _timer = None
        now = time.monotonic()
        due = [t for t in _tasks if t.rich_id is None and now - t.started >= DELAY - 1e-3]
        if due and _display is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            _display = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(),
                                TimeElapsedColumn(),
                                console=console or Console(file=sys.stderr), transient=True)
            _display.start()
        for t in due:
            t.rich_id = _display.add_task(t._label(), total=t.total, completed=t.completed)
        if any(t.rich_id is None for t in _tasks):
            _schedule()


def _stop() -> None:
    global _display, _timer
    if _timer is not None:
        _timer.cancel()
        _timer = None
    if _display is not None:
        _display.stop()
        _display = None


class PassProgress:
    """A pass instrument (`passes/infra.py`): names the pass running in the innermost task."""

    def __init__(self, graph: str) -> None:
        self.graph = graph

    def before_pass(self, stage: str, name: str, gm: Any) -> None:
        detail(f"{self.graph} {stage}/{name}")

    def after_pass(self, stage: str, name: str, gm: Any, seconds: float, modified: bool) -> None:
        pass
