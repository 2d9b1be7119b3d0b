"""Plain records the graph analyses produce and the cost model and solvers read.

The layers below the graph passes (`cost/`, `solve/`) never import `passes/`: what they need to know of a
graph arrives as these values, which hold no graph nodes. `tests/test_layers.py` enforces the rule.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """The work one graph node does: FLOPs (torch's formulas), bytes it reads and bytes it writes."""

    flops: int
    bytes_read: int
    bytes_written: int


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """A linear's sizes at the traced shapes."""

    in_features: int
    out_features: int
    tokens: int  # rows of the input flattened to 2-D


@dataclasses.dataclass(frozen=True)
class OpSite:
    """One call of the Dynamo graph: its node's name, its op's name, the modules it runs in
    (`passes/analysis/op_sites.py` reads them off a graph, `solve/precision.py` decides from them)."""

    node: str
    op: str
    modules: tuple[str, ...]  # enclosing modules, outermost first: "" (the root model), then its children
    linear: LinearShape | None = None

    @property
    def module(self) -> str:
        return self.modules[-1] if self.modules else ""
