"""A step plan as it is written and said: its line in the steps file (kept, updated in place, under a file
lock), the refusal of a budget no plan meets, and the verdicts a process ended without giving."""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.files import write_text_atomic
from dpcs_compiler.report import StepRecord, compile_records
from dpcs_compiler.stages.job import BudgetInfeasibleError
from dpcs_compiler.step.participant import Participant

log = logging.getLogger("dpcs.step")

Dumped = tuple[Path, int, str]  # a step plan's line in a STEPS_FILE: the file, the line's index, its text


@contextlib.contextmanager
def _steps_file_lock(path: Path) -> Iterator[None]:
    """Hold a lock on `path` for a read-then-write (ranks of one job may share a dump folder): an advisory
    lock on a hidden file beside it, where the platform has fcntl."""
    try:
        import fcntl
    except ImportError:  # not POSIX: unlocked
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _dump_step_record(path: Path, record: StepRecord, at: Dumped | None = None) -> Dumped | None:
    """Write `record` to the STEPS_FILE `path`: appended (`at` None; on a line of its own even after a line a
    killed process left unended), or in place of the line `at` says it wrote before, if that line is still
    its text (the file rewritten whole through a temporary beside it: a reader never sees half a file).
    Returns where the line is; None if it could not be written: a dump is a report, and training goes on
    (logged)."""
    text = json.dumps(record.to_json())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _steps_file_lock(path):
            data = path.read_text() if path.is_file() else ""
            if at is None:
                lead = "\n" if data and not data.endswith("\n") else ""
                with open(path, "a") as f:
                    f.write(lead + text + "\n")
                return path, len((data + lead).splitlines()), text
            lines = data.splitlines()
            line, written = at[1], at[2]
            if line >= len(lines) or lines[line] != written:
                log.warning("dpcs: the step plan's line in %s is gone; not updated", path)
                return None
            lines[line] = text
            write_text_atomic(path, "\n".join(lines) + "\n")
            return path, line, text
    except OSError as error:
        log.warning("dpcs: the step plan could not be written to %s: %s", path, error)
        return None


def _say_infeasible(message: str, dispatchers: Iterable[Participant]) -> None:
    """on_infeasible's verdict on a step's plan (or on a graph's own, left to the step): the error if any of its
    graphs asks for one, else a warning (from the step planner, called in a graph's first call of the step)."""
    if any(d.options.on_infeasible == "error" for d in dispatchers):
        raise BudgetInfeasibleError(f"{message}; raise the budget, or pass on_infeasible='best' to compile that plan")
    warnings.warn(f"{message}; compiling that plan (on_infeasible='best')", category=DpcsWarning, stacklevel=5)


def warn_verdicts_never_given() -> list[str]:
    """At exit: the budget verdicts graphs' compiles left to a step that never came (`GraphJob.defers_infeasible`:
    a script that ran one step, or stopped before its second). That step may have gone over the budget, unless
    it dropped the graphs' outputs before their backward; nothing said so. Warned, not raised (the steps ran);
    the messages, for tests."""
    left = [r.infeasible_deferred for r in compile_records() if r.infeasible_deferred]
    for message in left:
        warnings.warn(f"{message}, unless the step dropped the graph's outputs before its backward; the verdict waited "
                      "for the step's plan at the second step, which never ran", category=DpcsWarning, stacklevel=1)
    return left


def _describe(option: tuple, candidates: int) -> str:
    lever, k = option
    parts = [lever.describe()] if lever is not None else []
    if candidates:
        parts.append(f"{k} of {candidates} blocks offloaded")
    return ", ".join(parts)


def _split(record: StepRecord) -> str:
    """The predicted peak's parts, for a message."""
    parts = record.split()
    lever = record.optimizer_state or {}
    kept = f" kept {lever['format']}{' in host memory' if lever.get('on_host') else ''}" if lever.get("chosen") else ""
    buckets, gathered = parts["buckets"], parts["gathered"]
    shards = " (FSDP2: this rank's shards)" if gathered else ""
    return (f"; of it: parameters {format_bytes(parts['parameters'])}{shards}, "
            f"optimizer state{kept} {format_bytes(parts['optimizer_state'])}, "
            + (f"DistributedDataParallel's gradient buckets {format_bytes(buckets)}, " if buckets else "")
            + (f"FSDP2's gathered parameters (the running block's and those in flight beside it) "
               f"{format_bytes(gathered)}, " if gathered else "")
            + f"other memory alive through the step {format_bytes(parts['outside_graphs'])}, gradients "
            f"{format_bytes(parts['gradients'])}, activations {format_bytes(parts['activations'])}"
            + (f", the optimizer step's temporaries {format_bytes(parts['optimizer_step'])}"
               if parts["optimizer_step"] else ""))
