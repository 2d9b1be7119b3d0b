"""User options of the dpcs backend: one frozen dataclass, validated on construction.

`torch.compile(model, backend="dpcs", options={...})` hands the dict to `DpcsOptions.from_dict`; an unknown
key or a bad value raises a ValueError that names the key, the value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

COMPILERS = ("inductor", "eager")
ON_INFEASIBLE = ("error", "best")
DUMP_DIR_ENV = "DPCS_DUMP_DIR"
_BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BUDGET_CHOICES = (
    "None (no plan: torch's min-cut partition), bytes as an int > 0, a size string like '6GiB' or '800MB', "
    "a fraction of the device's total memory as a float in (0, 1], or 'auto'"
)


def parse_memory_budget(value: Any) -> int | float | str | None:
    """Normalise a memory_budget option: None, bytes (int), a fraction of device memory (float), or "auto".

    Raises ValueError naming the value and the valid forms.
    """
    def bad() -> ValueError:
        return ValueError(f"dpcs option 'memory_budget'={value!r} is not valid; valid choices: {_BUDGET_CHOICES}")

    if value is None or value == "auto":
        return value
    if isinstance(value, bool):
        raise bad()
    if isinstance(value, int):
        if value <= 0:
            raise bad()
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise bad()
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _BYTE_UNITS | {"": 1}:
            raise bad()
        nbytes = int(float(match.group(1)) * _BYTE_UNITS.get(match.group(2).lower(), 1))
        if nbytes <= 0:
            raise bad()
        return nbytes
    raise bad()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpcsOptions:
    """Every option the backend accepts.

    compiler: the final compiler of the partitioned graphs: "inductor", or "eager" to run them uncompiled
        (for tests and debugging; the graphs are the same ones Inductor would get).
    strict: raise when a dpcs stage fails, instead of warning and falling back to plain Inductor.
    dump_dir: write graphs, plans and memory timelines of every compiled graph under this folder
        (defaults to the DPCS_DUMP_DIR environment variable).
    memory_budget: bound on the real peak memory of each compiled training step (parameters, gradients,
        inputs, saved activations, temporaries, recomputation): bytes (int), a size string ("6GiB",
        "800MB"), a fraction of the device's total memory (float in (0, 1]), or "auto" (the device's free
        memory less a margin). None: no plan, torch's min-cut partition.
    on_infeasible: when no plan fits the budget: "error" raises, naming the smallest peak dpcs can reach;
        "best" compiles the plan with that smallest peak and warns.
    """

    compiler: str = "inductor"
    strict: bool = False
    dump_dir: Path | None = None
    memory_budget: int | float | str | None = None
    on_infeasible: str = "error"

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ValueError(
                f"dpcs option 'compiler'={self.compiler!r} is not valid; valid choices: {', '.join(map(repr, COMPILERS))}"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(f"dpcs option 'strict'={self.strict!r} is not valid; valid choices: True, False")
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)) or str(self.dump_dir) == "":
                raise ValueError(
                    f"dpcs option 'dump_dir'={self.dump_dir!r} is not valid; valid choices: a folder path (str or "
                    "os.PathLike) or None"
                )
            object.__setattr__(self, "dump_dir", Path(self.dump_dir))
        object.__setattr__(self, "memory_budget", parse_memory_budget(self.memory_budget))
        if self.on_infeasible not in ON_INFEASIBLE:
            raise ValueError(
                f"dpcs option 'on_infeasible'={self.on_infeasible!r} is not valid; valid choices: "
                f"{', '.join(map(repr, ON_INFEASIBLE))}"
            )

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> DpcsOptions:
        """Build options from the dict given to torch.compile; DPCS_DUMP_DIR fills an unset dump_dir."""
        options = dict(options or {})
        if not isinstance(options, dict):
            raise ValueError(f"dpcs options must be a dict, got {type(options).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in valid:
                raise ValueError(f"unknown dpcs option {key!r}; valid options: {', '.join(map(repr, valid))}")
        if options.get("dump_dir") is None and os.environ.get(DUMP_DIR_ENV):
            options["dump_dir"] = os.environ[DUMP_DIR_ENV]
        return cls(**options)

    def to_json(self) -> dict[str, Any]:
        return {
            f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in dataclasses.fields(self)
        }

    def fingerprint(self) -> str:
        """Stable hash of the options that change compiled code (the dump folder and strictness do not)."""
        relevant = {k: v for k, v in self.to_json().items() if k not in ("dump_dir", "strict")}
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]
