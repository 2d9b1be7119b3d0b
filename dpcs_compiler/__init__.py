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
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "DpcsFallbackWarning": "dpcs_compiler.backend",
    "DpcsWarning": "dpcs_compiler.diagnostics",
    "dpcs_backend": "dpcs_compiler.backend",
    "PeakMemory": "dpcs_compiler.measure",
    "measure_peak_memory": "dpcs_compiler.measure",
    "DpcsOptions": "dpcs_compiler.options",
    "CompileRecord": "dpcs_compiler.report",
    "clear_compile_records": "dpcs_compiler.report",
    "compile_records": "dpcs_compiler.report",
    **{name: "dpcs_compiler.runtime" for name in (
        "MemoryPolicy", "MemoryPolicyConfig", "Policy", "PrecisionPolicy", "PrecisionPolicyConfig", "Runtime",
        "RuntimeConfig", "Telemetry")},
    "Cadence": "dpcs_compiler.distributed",
    "CompressedOptimizer": "dpcs_compiler.model_states",
    "ParameterOffload": "dpcs_compiler.model_states",
}

__all__ = [
    "Cadence",
    "CompileRecord",
    "CompressedOptimizer",
    "DpcsFallbackWarning",
    "DpcsWarning",
    "DpcsOptions",
    "MemoryPolicy",
    "MemoryPolicyConfig",
    "ParameterOffload",
    "PeakMemory",
    "Policy",
    "PrecisionPolicy",
    "PrecisionPolicyConfig",
    "Runtime",
    "RuntimeConfig",
    "Telemetry",
    "clear_compile_records",
    "compile_records",
    "dpcs_backend",
    "measure_peak_memory",
]

if TYPE_CHECKING:
    from dpcs_compiler.backend import DpcsFallbackWarning, dpcs_backend
    from dpcs_compiler.measure import PeakMemory, measure_peak_memory
    from dpcs_compiler.options import DpcsOptions
    from dpcs_compiler.report import CompileRecord, clear_compile_records, compile_records
    from dpcs_compiler.distributed import Cadence
    from dpcs_compiler.model_states import CompressedOptimizer, ParameterOffload
    from dpcs_compiler.runtime import (
        MemoryPolicy,
        MemoryPolicyConfig,
        Policy,
        PrecisionPolicy,
        PrecisionPolicyConfig,
        Runtime,
        RuntimeConfig,
        Telemetry,
    )


def __getattr__(name: str) -> Any:
    """A public name, or a submodule not imported yet (`dpcs_compiler.report.step_records()` after a bare
    `import dpcs_compiler`, as when the package imported its modules itself)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'dpcs_compiler' has no attribute {name!r}; its public names: "
                             f"{', '.join(__all__)} (and its submodules)")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__"})
