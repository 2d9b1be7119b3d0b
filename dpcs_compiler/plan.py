"""The Plan: every decision dpcs made for one graph, serialisable to JSON, with a stable hash.

Rewrites read their decisions from the plan only. Without a memory budget the partition is torch's
min-cut and the plan records its outcome (which forward values are saved for backward); with one, the
memory planner writes a SAVE / RECOMPUTE / OFFLOAD decision for every candidate, the budget in bytes and
the hardware profile it was costed with. `compile_key` hashes the inputs the plan is derived from
(options, including the budget as given; partitioner; dpcs's own source) and is the partitioner's uuid in
Inductor's cache keys, so a graph compiled for one budget option is never handed back for another. It
does not cover what a budget resolves to ("auto", a fraction) on a device, nor the hardware profile: the
FX-graph and AOTAutograd caches therefore stay off for dpcs graphs (pipeline.aot_compile). `plan_hash`
covers the resolved budget, the hardware key and the decisions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

SAVE = "save"
RECOMPUTE = "recompute"
OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class ValueDecision:
    """What happens to one forward value the backward needs."""

    name: str
    nbytes: int
    decision: str = SAVE
    reload_before: str | None = None  # OFFLOAD: the backward node before which the reload starts
    release_after: str | None = None  # OFFLOAD: the forward node after which its device memory is freed


@dataclasses.dataclass(frozen=True)
class Plan:
    graph: str
    options_fingerprint: str
    partitioner: str = "min_cut"
    values: tuple[ValueDecision, ...] = ()
    budget_bytes: int | None = None
    hardware: str | None = None  # the hardware profile's device key the plan was costed with
    predicted_peak_bytes: int | None = None
    feasible: bool | None = None
    peak_node: str | None = None  # where the plan's predicted peak is

    def with_values(self, values: tuple[ValueDecision, ...]) -> Plan:
        return dataclasses.replace(self, values=values)

    @property
    def decisions(self) -> tuple[str, ...]:
        """Each value's decision, in the order of `values` (the solver's candidate order)."""
        return tuple(v.decision for v in self.values)

    def decided(self, decision: str) -> tuple[ValueDecision, ...]:
        return tuple(v for v in self.values if v.decision == decision)

    def plan_hash(self) -> str:
        """Hash of the whole plan, decisions included (two plans with one hash compile the same graphs)."""
        fields = {k: v for k, v in self._fields().items() if k != "graph"}
        payload = json.dumps([self.compile_key(), fields], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {"hash": self.compile_key(), "plan_hash": self.plan_hash(), **self._fields()}

    def _fields(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "options_fingerprint": self.options_fingerprint,
            "partitioner": self.partitioner,
            "budget_bytes": self.budget_bytes,
            "hardware": self.hardware,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "feasible": self.feasible,
            "peak_node": self.peak_node,
            "values": [dataclasses.asdict(v) for v in self.values],
        }

    def compile_key(self) -> str:
        """Hash of everything that decides the compiled code before partitioning (cache-key material)."""
        payload = json.dumps([self.options_fingerprint, self.partitioner, dpcs_source_hash()])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@functools.cache
def dpcs_source_hash() -> str:
    """Hash of dpcs's own source files: a code change invalidates cached graphs."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
