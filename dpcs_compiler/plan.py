"""The Plan: every decision dpcs made for one graph, serialisable to JSON, with a stable hash.

Rewrites read their decisions from the plan only. Today the partition is torch's min-cut, so the plan
records its outcome (which forward values are saved for backward); the memory planner will write
SAVE / RECOMPUTE / OFFLOAD decisions here. `compile_key` hashes the inputs the plan is derived from
(options, partitioner, dpcs's own source) and is the partitioner's uuid in Inductor's cache keys; the
caches are off for dpcs graphs today, and a planner whose decisions depend on more (a hardware profile,
a budget) must add that to the key.
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


@dataclasses.dataclass(frozen=True)
class Plan:
    graph: str
    options_fingerprint: str
    partitioner: str = "min_cut"
    values: tuple[ValueDecision, ...] = ()

    def with_values(self, values: tuple[ValueDecision, ...]) -> Plan:
        return dataclasses.replace(self, values=values)

    def to_json(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "options_fingerprint": self.options_fingerprint,
            "partitioner": self.partitioner,
            "hash": self.compile_key(),
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
