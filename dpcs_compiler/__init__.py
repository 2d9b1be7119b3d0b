"""dpcs: a torch.compile backend that plans memory and precision for training.

    model = torch.compile(model, backend="dpcs", options={"compiler": "inductor"})

The backend is registered under the name "dpcs" by the package's entry point; importing this package is
not needed to use it. `Runtime` adapts the compiled plans between steps (`runtime/`).

The names below are imported on first use (PEP 562), not with the package: a process that only needs
`dpcs_compiler.checkpoint` (a rank of a training job resuming from its checkpoint, say) does not pay for
importing Dynamo and Inductor, which the backend needs (seconds per process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "DpcsFallbackWarning": "dpcs_compiler.backend",
    "dpcs_backend": "dpcs_compiler.backend",
    "PeakMemory": "dpcs_compiler.measure",
    "measure_peak_memory": "dpcs_compiler.measure",
    "DpcsOptions": "dpcs_compiler.options",
    "CompileRecord": "dpcs_compiler.report",
    "clear_compile_records": "dpcs_compiler.report",
    "compile_records": "dpcs_compiler.report",
    **{name: "dpcs_compiler.runtime" for name in (
        "Cadence", "CompressedOptimizer", "MemoryPolicy", "MemoryPolicyConfig", "ParameterOffload", "Policy",
        "PrecisionPolicy", "PrecisionPolicyConfig", "Runtime", "RuntimeConfig", "Telemetry")},
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from dpcs_compiler.backend import DpcsFallbackWarning, dpcs_backend
    from dpcs_compiler.measure import PeakMemory, measure_peak_memory
    from dpcs_compiler.options import DpcsOptions
    from dpcs_compiler.report import CompileRecord, clear_compile_records, compile_records
    from dpcs_compiler.runtime import (
        Cadence,
        CompressedOptimizer,
        MemoryPolicy,
        MemoryPolicyConfig,
        ParameterOffload,
        Policy,
        PrecisionPolicy,
        PrecisionPolicyConfig,
        Runtime,
        RuntimeConfig,
        Telemetry,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpcs_compiler' has no attribute {name!r}; its public names: {', '.join(__all__)}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
