"""Pass infrastructure: cached read-only analyses, rewrites that declare what they preserve, instruments.

- An analysis is a pure function of a subject (a GraphModule, or a Schedule spanning several); the
  `AnalysisCache` computes it on first request and keeps it until a rewrite of one of the subject's graphs
  invalidates it.
- A `Rewrite` changes one graph in place, reads its decisions from the plan only, and lists the analyses
  it preserves; the others are dropped for that graph after it runs. Every node it creates is stamped
  `meta["dpcs"] = {"pass": name}`.
- Instruments run around every pass (rewrite or analysis stage): a timer, and a dumper that writes the
  graph before and after when a dump folder is set.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Protocol, TypeVar

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from dpcs_compiler.heap import paused_collector
from dpcs_compiler.passes.analysis.schedule import Schedule

log = logging.getLogger("dpcs.passes")

T = TypeVar("T")
Subject = fx.GraphModule | Schedule
AnalysisFn = Callable[[Any], Any]


def _graphs_of(subject: Subject) -> tuple[fx.GraphModule, ...]:
    return subject.graphs if isinstance(subject, Schedule) else (subject,)


class AnalysisCache:
    """Lazily computed, cached analysis results, invalidated per graph by rewrites."""

    def __init__(self) -> None:
        self._results: dict[tuple[AnalysisFn, int], tuple[Subject, Any]] = {}
        self.computed: list[str] = []  # analysis names in the order they were computed (for tests, dumps)

    def get(self, analysis: Callable[[Any], T], subject: Subject) -> T:
        key = (analysis, id(subject))
        hit = self._results.get(key)
        if hit is not None and hit[0] is subject:
            return hit[1]
        result = analysis(subject, self)
        self._results[key] = (subject, result)  # keeps the subject alive so its id is not reused
        self.computed.append(analysis.__name__)
        return result

    def invalidate(self, gm: fx.GraphModule, preserved: frozenset[AnalysisFn] = frozenset()) -> None:
        """Drop every cached result over `gm` (alone or inside a schedule) except the preserved analyses."""
        for key, (subject, _) in list(self._results.items()):
            if key[0] not in preserved and any(g is gm for g in _graphs_of(subject)):
                del self._results[key]


class Instrument(Protocol):
    def before_pass(self, stage: str, name: str, gm: fx.GraphModule | None) -> None: ...

    def after_pass(self, stage: str, name: str, gm: fx.GraphModule | None, seconds: float, modified: bool) -> None: ...


@dataclasses.dataclass
class PassTimer:
    """Records the wall time of every pass as `seconds["stage/name"]`."""

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def before_pass(self, stage: str, name: str, gm: fx.GraphModule | None) -> None:
        pass

    def after_pass(self, stage: str, name: str, gm: fx.GraphModule | None, seconds: float, modified: bool) -> None:
        key = f"{stage}/{name}"
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds


@dataclasses.dataclass
class PassContext:
    """What a pass may read: the plan (decisions), the analysis cache, and the instruments around it."""

    plan: Any
    analyses: AnalysisCache
    instruments: Sequence[Instrument] = ()
    check: bool = True  # graph.lint() after every rewrite

    @contextmanager
    def instrumented(self, stage: str, name: str, gm: fx.GraphModule | None = None) -> Iterator[list[bool]]:
        """Run the body as pass `stage/name`: instruments before and after, wall time measured, the garbage
        collector paused (`heap.paused_collector`: a pass's time stays linear in the graph's size).

        The body may set `modified[0] = True`; the after-instruments receive it.
        """
        modified = [False]
        for instrument in self.instruments:
            instrument.before_pass(stage, name, gm)
        start = time.perf_counter()
        with paused_collector():
            yield modified
        seconds = time.perf_counter() - start
        for instrument in self.instruments:
            instrument.after_pass(stage, name, gm, seconds, modified[0])
        log.debug("%s/%s took %.3f s (modified=%s)", stage, name, seconds, modified[0])

    def account(self, stage: str, name: str, seconds: float, gm: fx.GraphModule | None = None) -> None:
        """Report `seconds` as pass `stage/name`, timed by its caller (work that ends inside another's call,
        such as a choice made inside Inductor's compile, which then goes on with the compile's own work)."""
        for instrument in self.instruments:
            instrument.before_pass(stage, name, gm)
        for instrument in self.instruments:
            instrument.after_pass(stage, name, gm, seconds, False)
        log.debug("%s/%s took %.3f s", stage, name, seconds)


class Rewrite(abc.ABC):
    """A graph rewrite. Subclasses set `name` and `preserves`, and implement `run`."""

    name: ClassVar[str]
    preserves: ClassVar[frozenset[AnalysisFn]] = frozenset()

    @abc.abstractmethod
    def run(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        """Change `gm` in place following `ctx.plan`; return True if anything changed."""


# What Dynamo puts on its graph module and placeholders besides the graph. AOTAutograd reads them to know a
# graph came from Dynamo, and which inputs are parameters (static inputs: min-cut partitions by them).
_DYNAMO_MODULE_ATTRIBUTES = ("_param_name_to_source", "_source_to_user_stacks", "compile_subgraph_reason")


def lazy_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph module over a deep copy of `gm`'s graph whose Python code is generated only when it is run or
    its code read (torch's `_LazyGraphModule`, as Dynamo and Inductor make theirs): most copies dpcs makes are
    partitioned, analysed or handed to AOTAutograd, never run as they are. Generating the code of each copy
    took 0.8 s of the first steps of a 12-layer Hugging Face GPT-2 with a budget (benchmarks/compile_time.py).
    A plain graph module where Dynamo's `use_lazy_graph_module` is off, or torch skips lazy ones."""
    from torch._dynamo import config as dynamo_config

    with _use_lazy_graph_module(dynamo_config.use_lazy_graph_module):
        return _make_graph_module(gm, copy.deepcopy(gm.graph))


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a graph module to rewrite or compile that compiles as the original does: a new graph (rewrites
    and Inductor mutate the graph they are given; `lazy_copy`), and, for a Dynamo graph, Dynamo's metadata.
    Without that metadata AOTAutograd takes the copy for an exported graph with no static input, and torch's
    min-cut partitions it differently (measured: 8 KiB more at the bench GPT's peak than `torch.compile`)."""
    copied = lazy_copy(gm)
    copied.meta.update(gm.meta)
    for name in _DYNAMO_MODULE_ATTRIBUTES:
        if hasattr(gm, name):
            setattr(copied, name, getattr(gm, name))
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), copied.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copied


def run_rewrites(stage: str, gm: fx.GraphModule, rewrites: Sequence[Rewrite], ctx: PassContext) -> fx.GraphModule:
    """Apply rewrites in order, stamping new nodes, linting, recompiling and invalidating analyses."""
    for rewrite in rewrites:
        existing = set(gm.graph.nodes)
        with ctx.instrumented(stage, rewrite.name, gm) as modified:
            try:
                modified[0] = bool(rewrite.run(gm, ctx))
            except Exception as error:
                raise RuntimeError(f"dpcs rewrite {stage}/{rewrite.name} failed: {error}") from error
            for node in gm.graph.nodes:
                if node not in existing:
                    node.meta.setdefault("dpcs", {})["pass"] = rewrite.name
            if modified[0]:
                if ctx.check:
                    gm.graph.lint()
                gm.recompile()
                ctx.analyses.invalidate(gm, rewrite.preserves)
    return gm
