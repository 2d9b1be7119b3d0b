"""Between steps: signals, policies, plan variants, telemetry and rank agreement; the El Che cadence of
ranks of unequal speed (`cadence.py`).

    rt = dpcs_compiler.Runtime(model, telemetry="telemetry.jsonl")
    ...; optimizer.step(); rt.step(loss=loss, optimizer=optimizer, scaler=scaler)
"""

from dpcs_compiler.runtime.cadence import Cadence, CadenceConfig, CadenceError
from dpcs_compiler.runtime.compressed_optimizer import CompressedOptimizer, decompress_state_dict
from dpcs_compiler.runtime.curvature import CurvatureProbe
from dpcs_compiler.runtime.param_offload import ParameterOffload
from dpcs_compiler.runtime.decisions import PRECISION_MODES, Decisions
from dpcs_compiler.runtime.policies import (
    MemoryPolicy,
    MemoryPolicyConfig,
    Policy,
    PrecisionPolicy,
    PrecisionPolicyConfig,
    Signals,
)
from dpcs_compiler.runtime.runtime import Runtime, RuntimeConfig, default_regions
from dpcs_compiler.runtime.telemetry import Telemetry, read_telemetry

__all__ = [
    "PRECISION_MODES",
    "Cadence",
    "CadenceConfig",
    "CadenceError",
    "CompressedOptimizer",
    "CurvatureProbe",
    "Decisions",
    "MemoryPolicy",
    "MemoryPolicyConfig",
    "ParameterOffload",
    "Policy",
    "PrecisionPolicy",
    "PrecisionPolicyConfig",
    "Runtime",
    "RuntimeConfig",
    "Signals",
    "Telemetry",
    "decompress_state_dict",
    "default_regions",
    "read_telemetry",
]
