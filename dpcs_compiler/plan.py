"""The Plan: every decision dpcs made for one graph, serialisable to JSON, with a stable hash.

Rewrites read their decisions from the plan only. Without a memory budget the partition is torch's
min-cut and the plan records its outcome (which forward values are saved for backward); with one, torch's
min-cut is kept if it fits the budget (`torch_plan`: no cost where there is no pressure), else the memory
planner writes a SAVE / RECOMPUTE / OFFLOAD decision for every candidate, the budget in bytes and
the hardware profile it was costed with. `compile_key` hashes the inputs the plan is derived from
(options, including the budget as given; partitioner; dpcs's own source) and is the partitioner's uuid in
Inductor's cache keys, so a graph compiled for one budget option is never handed back for another. It
does not cover what a budget resolves to ("auto", a fraction) on a device, nor the hardware profile: the
FX-graph and AOTAutograd caches therefore stay off for dpcs graphs (pipeline.aot_compile). `plan_hash`
covers the resolved budget, the hardware profile (its device key and short hash) and the decisions: in a
distributed job the ranks compare it field by field (`distributed/rank_agreement.py`).
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
class PrecisionDecision:
    """The dtype one Dynamo-graph op computes in, and the rule that put it there (`passes/rewrite/precision.py`)."""

    node: str
    module: str  # the innermost module the op belongs to ("" for the top level)
    op: str
    dtype: str  # "fp32", "bf16", "fp16"; "widest" (of the op's inputs); "fp8" (an fp8 linear region)
    rule: str  # e.g. "autocast lower-precision op", "autocast fp32 op", "keep_fp32 'lm_head'"


@dataclasses.dataclass(frozen=True)
class Fp8Decision:
    """One linear of the Dynamo graph and whether it runs as an fp8 matmul (`passes/rewrite/fp8.py`)."""

    node: str
    module: str
    in_features: int
    out_features: int
    tokens: int  # rows of the flattened input at the traced sizes
    fp8: bool
    reason: str  # why it is or is not an fp8 region
    recipe: str | None = None  # "tensorwise" | "rowwise"
    matmul: str | None = None  # "scaled_mm" | "emulated"
    margin: float = 0.0  # scales are amax-based, divided by 2**margin
    grad_dtype: str | None = None  # the output gradient's fp8 format: "e5m2" | "e4m3"
    weight_grad_dtype: str | None = None  # what the weight-gradient matmul outputs, if not the weight's dtype
    speedup: float | None = None  # predicted step seconds in the region's dtype over those in fp8 (select "faster")


@dataclasses.dataclass(frozen=True)
class Plan:
    graph: str
    options_fingerprint: str
    partitioner: str = "min_cut"
    values: tuple[ValueDecision, ...] = ()
    budget_bytes: int | None = None
    hardware: str | None = None  # "<device key>#<short hash>" of the hardware profile the plan was costed with
    predicted_peak_bytes: int | None = None
    feasible: bool | None = None
    peak_node: str | None = None  # where the plan's predicted peak is
    # With a budget: torch's own min-cut partition was kept, as it fits the budget (`values` then map its
    # saved set onto the candidates, for the step planner); no dpcs decision was needed.
    torch_plan: bool = False
    # Precision (pre-autograd): the graph's low-precision dtype, per-op decisions, fp8 linears, and
    # whether the backward raises the overflow flag on non-finite gradients (`ops/overflow.py`).
    precision: str = "fp32"
    precision_ops: tuple[PrecisionDecision, ...] = ()
    fp8_linears: tuple[Fp8Decision, ...] = ()
    detect_overflow: bool = False

    def with_values(self, values: tuple[ValueDecision, ...]) -> Plan:
        return dataclasses.replace(self, values=values)

    @property
    def decisions(self) -> tuple[str, ...]:
        """Each value's decision, in the order of `values` (the solver's candidate order)."""
        return tuple(v.decision for v in self.values)

    @property
    def low_precision(self) -> bool:
        """Whether the graph runs anything below fp32: a bf16/fp16 precision or an fp8 linear."""
        return self.precision != "fp32" or any(d.fp8 for d in self.fp8_linears)

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
            "torch_plan": self.torch_plan,
            "values": [dataclasses.asdict(v) for v in self.values],
            "precision": self.precision,
            "precision_ops": [dataclasses.asdict(d) for d in self.precision_ops],
            "fp8_linears": [dataclasses.asdict(d) for d in self.fp8_linears],
            "detect_overflow": self.detect_overflow,
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
