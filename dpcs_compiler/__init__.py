"""dpcs: a torch.compile backend that plans memory and precision for training.

    model = torch.compile(model, backend="dpcs", options={"compiler": "inductor"})

The backend is registered under the name "dpcs" by the package's entry point; importing this package is
not needed to use it. `Runtime` adapts the compiled plans between steps (`runtime/`).
"""

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

__version__ = "0.1.0"

__all__ = [
    "Cadence",
    "CompileRecord",
    "CompressedOptimizer",
    "MemoryPolicy",
    "MemoryPolicyConfig",
    "ParameterOffload",
    "Policy",
    "PrecisionPolicy",
    "PrecisionPolicyConfig",
    "Runtime",
    "RuntimeConfig",
    "Telemetry",
    "DpcsFallbackWarning",
    "DpcsOptions",
    "PeakMemory",
    "clear_compile_records",
    "compile_records",
    "dpcs_backend",
    "measure_peak_memory",
]
