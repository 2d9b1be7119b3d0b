"""User options of the dpcs backend: one frozen dataclass, validated on construction.

`torch.compile(model, backend="dpcs", options={...})` hands the dict to `DpcsOptions.from_dict`; an unknown
key or a bad value raises a ValueError that names the key, the value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

COMPILERS = ("inductor", "eager")
DUMP_DIR_ENV = "DPCS_DUMP_DIR"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpcsOptions:
    """Every option the backend accepts.

    compiler: the final compiler of the partitioned graphs: "inductor", or "eager" to run them uncompiled
        (for tests and debugging; the graphs are the same ones Inductor would get).
    strict: raise when a dpcs stage fails, instead of warning and falling back to plain Inductor.
    dump_dir: write graphs, plans and memory timelines of every compiled graph under this folder
        (defaults to the DPCS_DUMP_DIR environment variable).
    """

    compiler: str = "inductor"
    strict: bool = False
    dump_dir: Path | None = None

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
