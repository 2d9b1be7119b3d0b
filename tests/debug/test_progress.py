"""Progress (`debug/progress.py`): shown on a terminal once a task has run DELAY seconds, naming what it is
doing; quiet when not a terminal, when DPCS_PROGRESS says so, or when the user's logging silenced dpcs."""

from __future__ import annotations

import io
import logging
import re
import time

import pytest
import torch
from rich.console import Console

from dpcs_compiler.debug import progress
from dpcs_testing import dpcs_compile


@pytest.fixture
def terminal(monkeypatch):
    """A terminal to render into (rich's escape codes stripped by `text()`), with a short delay."""
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=True, width=150))
    monkeypatch.setattr(progress, "DELAY", 0.05)
    monkeypatch.delenv(progress.ENV, raising=False)
    return lambda: re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())


def test_a_task_longer_than_the_delay_shows_what_it_does_and_a_short_one_nothing(terminal, monkeypatch):
    with progress.task("quick"):
        pass
    assert terminal() == ""
    with progress.task("dpcs bench", total=2) as bar:
        bar.advance(detail="gpt")
        with progress.task("[gpt] strategies"):
            progress.detail("compile_amb=0.5: compiling")
            time.sleep(0.3)
        time.sleep(0.2)
    shown = terminal()
    assert "dpcs bench: gpt" in shown and "[gpt] strategies: compiling" not in shown
    assert "[gpt] strategies: compile_amb=0.5: compiling" in shown
    assert progress._display is None and not progress._tasks  # stopped once the last task ended


def test_a_dpcs_compile_names_the_pass_it_runs(terminal, monkeypatch):
    monkeypatch.setattr(progress, "DELAY", 0.0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    dpcs_compile(model, memory_budget="1GiB")(torch.randn(4, 8)).sum().backward()
    time.sleep(0.05)
    assert re.search(r"dpcs: compiling a graph: graph_\d+ \w+/\w+", terminal())


def test_quiet_when_not_a_terminal_when_turned_off_or_when_logging_silences_dpcs(monkeypatch):
    monkeypatch.setattr(progress, "console", None)
    monkeypatch.delenv(progress.ENV, raising=False)
    assert not progress.enabled()  # pytest's captured stderr is no terminal
    with progress.task("anything") as quiet:
        quiet.advance(detail="x")
    assert progress._display is None and not progress._tasks
    monkeypatch.setenv(progress.ENV, "1")
    assert progress.enabled()
    logging.getLogger("dpcs").setLevel(logging.ERROR)
    try:
        assert not progress.enabled()
    finally:
        logging.getLogger("dpcs").setLevel(logging.NOTSET)
    monkeypatch.setattr(progress, "console", Console(file=io.StringIO(), force_terminal=True))
    monkeypatch.setenv(progress.ENV, "off")
    assert not progress.enabled()
