"""What the runtime decides between steps, as a plain record: the precision mode, the regions kept in fp32,
and how tight the memory budget is. Pure Python (no torch): policies produce it, `runtime/variants.py` turns it
into each graph's compile options, and its key names the variant.

Precision modes, highest precision first: "fp32"; "bf16" and "fp16" (matmuls, linears, convolutions and
attention in that dtype: the `precision` option); "fp8" (eligible linears as fp8 matmuls on top of the 16-bit
mode: the `fp8` option).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any

from dpcs_compiler.cost.op_time import Calibration

PRECISION_MODES = ("fp32", "bf16", "fp16", "fp8")
# How much precision a mode keeps: a ladder of modes must strictly decrease in it.
MODE_RANK = {"fp32": 3, "bf16": 2, "fp16": 2, "fp8": 1}


def check_mode(name: str, value: Any) -> str:
    if value not in PRECISION_MODES:
        raise ValueError(f"{name}={value!r} is not valid; valid choices: {', '.join(map(repr, PRECISION_MODES))}")
    return value


@dataclasses.dataclass(frozen=True)
class Decisions:
    """One set of runtime decisions; equal decisions compile to the same variant of every graph.

    precision: a mode of PRECISION_MODES for the whole model.
    fp32_regions: module names (as `model.named_modules()` names them) whose ops stay in fp32 whatever the
        mode: regions that overflowed.
    budget_scale: None (each graph's memory_budget as compiled), or a factor in (0, 1] applied to each
        graph's reference: its compiled budget, or, without one, the peak its first plan predicted.
    budget_bytes: an absolute memory_budget for every graph (`Runtime.force_budget`); wins over the scale.
    calibration: None (each graph's roofline as compiled), or (compute_scale, memory_scale, overhead_s) of the
        roofline fitted to measured step times (`Runtime.calibrate_from_steps`) that budgeted plans are costed
        with (the `calibration` option; overhead_s None: the profile's per-op cost).
    """

    precision: str = "fp32"
    fp32_regions: tuple[str, ...] = ()
    budget_scale: float | None = None
    budget_bytes: int | None = None
    calibration: tuple[float, float, float | None] | None = None

    def __post_init__(self) -> None:
        check_mode("Decisions.precision", self.precision)
        if isinstance(self.fp32_regions, str) or not all(isinstance(r, str) and r for r in self.fp32_regions):
            raise ValueError(
                f"Decisions.fp32_regions={self.fp32_regions!r} is not valid; valid choices: module names (non-empty str)"
            )
        object.__setattr__(self, "fp32_regions", tuple(sorted(set(self.fp32_regions))))
        if self.budget_scale is not None:
            if isinstance(self.budget_scale, bool) or not isinstance(self.budget_scale, (int, float)) or not (
                0.0 < self.budget_scale <= 1.0
            ):
                raise ValueError(
                    f"Decisions.budget_scale={self.budget_scale!r} is not valid; valid choices: None or a number in (0, 1]"
                )
            # Rounded, so the same level reached by two paths is the same variant.
            object.__setattr__(self, "budget_scale", round(float(self.budget_scale), 6))
        if self.budget_bytes is not None and (
            isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) or self.budget_bytes <= 0
        ):
            raise ValueError(f"Decisions.budget_bytes={self.budget_bytes!r} is not valid; valid choices: None or bytes > 0")
        if self.calibration is not None:
            value = self.calibration
            try:
                if isinstance(value, (str, bytes, dict)) or len(value) != 3:
                    raise ValueError("three values expected")
                fields = dataclasses.astuple(Calibration(*value))
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"Decisions.calibration={value!r} is not valid ({error}); valid choices: None or (compute_scale, "
                    "memory_scale, overhead_s), each finite and >= 0 (overhead_s may be None)"
                ) from None
            object.__setattr__(self, "calibration", fields)

    def to_json(self) -> dict[str, Any]:
        data = {**dataclasses.asdict(self), "fp32_regions": list(self.fp32_regions)}
        if self.calibration is None:  # left out, so the keys of decisions without one stay as they were
            del data["calibration"]
        else:
            data["calibration"] = list(self.calibration)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Decisions:
        calibration = data.get("calibration")
        return cls(**{**data, "fp32_regions": tuple(data.get("fp32_regions", ())),
                      "calibration": tuple(calibration) if calibration is not None else None})

    def key(self) -> str:
        """A stable short hash: the variant's name in logs, telemetry and caches."""
        return self._key

    @functools.cached_property
    def _key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:12]

    def describe(self) -> str:
        parts = [self.precision]
        if self.fp32_regions:
            parts.append(f"fp32 regions {', '.join(self.fp32_regions)}")
        if self.budget_bytes is not None:
            parts.append(f"budget {self.budget_bytes} B")
        elif self.budget_scale is not None:
            parts.append(f"budget x{self.budget_scale:g}")
        if self.calibration is not None:
            compute, memory, overhead = self.calibration
            per_op = "profile's" if overhead is None else f"{overhead * 1e6:.3g} us"
            parts.append(f"costs calibrated (compute x{compute:.3g}, memory x{memory:.3g}, per op {per_op})")
        return "; ".join(parts)
