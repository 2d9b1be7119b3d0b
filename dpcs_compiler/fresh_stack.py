"""Run a pure function on a fresh Python stack: in a thread of its own, joined at once.

CPython 3.11 and 3.12 keep a thread's Python frames in 16 KiB chunks and free a chunk as soon as its first
frame returns (CPython issue gh-142183, fixed in 3.13.3 and 3.14 by caching one chunk). Code that loops while
its calls cross a chunk's boundary maps and unmaps a chunk on every such call. dpcs's passes run deep inside
Dynamo's and Inductor's compile, at a depth that depends on the model: on HF GPT-2 with 12 layers the fast
solver's 0.5 s solve mapped and unmapped a 16 KiB chunk 34,872 times there (36,000 page faults, 0.2 s of
system time), 0.86 s in all against 0.48 s for the same problem at a shallow stack (Xeon, CPython 3.11.7).
That is what made dpcs's pass time per node jump between runs and graph sizes (`benchmarks/compile_time.py`).

A thread starts with an empty stack, so a function that does not recurse deeply never crosses a boundary.
Only for pure functions: torch's thread-local state (grad mode, dispatch modes, Dynamo's tracing context) is
not carried over, which is why the solvers (numpy and scipy on a `MemoryProblem`) use it and the FX passes do
not. The caller waits for the result; an exception is raised again in the caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def on_fresh_stack(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a new thread (daemon: a caller interrupted while waiting does not keep the
    process alive); its result, or its exception raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            outcome.append((False, error))

    worker = threading.Thread(target=run, name=f"dpcs-{getattr(fn, '__name__', 'call')}", daemon=True)
    worker.start()
    worker.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
