"""The Dynamo backend "dpcs": validates options, returns the graph's variant dispatcher, and fails safe.

Registered through the `torch_dynamo_backends` entry point, so `torch.compile(m, backend="dpcs")` works in
a process that never imported dpcs_compiler. If a dpcs stage raises while compiling a graph, that graph
falls back to plain Inductor with a warning naming the error and the dump folder, unless the options say
otherwise (`DpcsOptions.falls_back`): with a `memory_budget` (a fallback would drop it), `"strict": True`
or `"on_failure": "error"`, a `PlanningError` names the graph and the error. `"on_failure": "fallback"`
falls back under a budget too. Bad options always raise.

What it returns is a `GraphDispatcher` (`runtime/variants.py`): the graph compiled with its options, which a
`Runtime` can switch to variants compiled under other decisions between steps, without Dynamo.
"""

from __future__ import annotations

import logging
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._dynamo.exc import RestartAnalysis, ShortenTraceback, SkipFrame

from dpcs_compiler.debug import progress
from dpcs_compiler.debug.dump import write_summary
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.options import DpcsOptions
from dpcs_compiler.pipeline import compile_graph
from dpcs_compiler.distributed.rank_agreement import RankDisagreementError
from dpcs_compiler.report import compile_records, records_since
from dpcs_compiler.passes.infra import copy_graph_module
from dpcs_compiler.runtime.variants import GraphDispatcher
from dpcs_compiler.stages.job import BudgetInfeasibleError, PlanningError

log = logging.getLogger("dpcs.backend")


class DpcsFallbackWarning(DpcsWarning):
    """A graph could not go through dpcs and was compiled by plain Inductor instead."""


def dpcs_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None, **unexpected: Any
) -> Callable:
    """`torch.compile(model, backend="dpcs", options={...})`."""
    if unexpected:
        raise ValueError(
            f"the dpcs backend got unexpected torch.compile arguments {sorted(unexpected)}; "
            "pass dpcs settings through options={...} (mode= is not supported)"
        )
    return GraphDispatcher(gm, example_inputs, DpcsOptions.from_dict(options), compile_with_fallback)


def compile_with_fallback(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: DpcsOptions, fallback: bool) -> Callable:
    """The dpcs pipeline on `gm`. If it fails on the graph's first compile (`fallback`): plain Inductor with a
    warning where the options allow (`DpcsOptions.falls_back`), else a `PlanningError` naming the graph and the
    error. A runtime variant's failure is raised as it is (the dispatcher keeps its current variant)."""
    records_before = compile_records()
    try:
        # Inductor takes ownership of the graph it compiles and mutates it: dpcs gets a copy, so the
        # fallback compiles the graph exactly as Dynamo made it.
        with progress.task("dpcs: compiling a graph"):
            return compile_graph(copy_graph_module(gm), example_inputs, opts)
    except (RestartAnalysis, SkipFrame, ShortenTraceback, BudgetInfeasibleError, RankDisagreementError):
        # Dynamo's own control flow, or an answer for the user (no plan fits the budget; the ranks compiled
        # different plans, on every rank alike): not a failure to hide behind a fallback
        raise
    except Exception as error:
        if not fallback:
            raise
        new_records = records_since(records_before)
        graph = new_records[0].graph if new_records else "a graph"
        dump = new_records[0].dump_dir if new_records and new_records[0].dump_dir else "none (set dump_dir)"
        cause = f"{type(error).__name__}: {error}"
        if not opts.falls_back:
            budget = "" if opts.memory_budget is None else f" under memory_budget={opts.memory_budget!r}"
            hint = ""
            if opts.on_failure is None and not opts.strict:  # raised for the budget's sake
                hint = "; options={'on_failure': 'fallback'} compiles it with plain Inductor, without the budget"
            raise PlanningError(f"dpcs could not compile {graph}{budget}: {cause} (dump folder: {dump}{hint})") from error
        for record in new_records:
            record.fallback = cause
            write_summary(record)
        warnings.warn(
            f"dpcs failed to compile {graph} and falls back to plain Inductor for it: {cause} (dump folder: {dump}; "
            + ("its memory_budget is NOT applied; on_failure='error' raises)" if opts.memory_budget is not None
               else "pass options={'strict': True} to raise)"),
            DpcsFallbackWarning,
            stacklevel=3,
        )
        log.warning("dpcs fallback traceback:\n%s", traceback.format_exc())
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
