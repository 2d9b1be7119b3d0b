"""What the step planner needs of a graph that takes part in step planning: the runtime's `GraphDispatcher`
(`runtime/variants.py`) is one. Named here so the step planner does not import the runtime that calls it."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from dpcs_compiler.cost.step_model import StepContext
from dpcs_compiler.options import DpcsOptions


class VersionedControl(Protocol):
    version: int  # raised whenever the runtime's decisions change the variant a graph runs


class Participant(Protocol):
    """A compiled graph with a memory budget and budget_scope "step", as the recorder sees it."""

    name: str  # the graph's name in step records
    options: DpcsOptions
    bucket: tuple[int, ...]  # its size bucket now (dynamic shapes): a size per symbol of `size_symbols`
    size_symbols: tuple[Any, ...]  # its shape symbols (`runtime.variants.SizeSymbol`: each has a `name`)
    provisional: set[tuple[int, ...]]  # buckets whose step context was set before their step was seen
    root: weakref.ref[torch.nn.Module] | None  # the module torch.compile wrapped
    forward_only: bool  # a watched call made no autograd graph
    control: VersionedControl
    _watch: bool  # its calls go to the recorder (`StepRecorder.call`)
    _fn: Callable[..., Any]  # the variant it runs now
    _version: int  # the control version its variant was selected at

    @property
    def step_context(self) -> StepContext | None: ...

    @property
    def current_budget_bytes(self) -> int | None: ...

    @property
    def current_reserved_budget_bytes(self) -> int | None: ...

    def _select(self, args: Sequence[Any]) -> None: ...

    def current_job(self) -> Any | None: ...

    def step_graph(self, credit: bool = False, as_compiled: bool = False) -> Any | None: ...

    def step_was_planned(self) -> None: ...

    def set_step_context(self, context: StepContext | None) -> None: ...

    def take_deferred_infeasible(self) -> str | None: ...
