"""Between steps: signals, policies, plan variants and telemetry. The model-state levers are in
`dpcs_compiler.model_states`, what ranks share (agreement, combined signals, the cadence) in
`dpcs_compiler.distributed`, the step planner in `dpcs_compiler.step`.

    rt = dpcs_compiler.Runtime(model, telemetry="telemetry.jsonl")
    ...; optimizer.step(); rt.step(loss=loss, optimizer=optimizer, scaler=scaler)
"""

from dpcs_compiler.runtime.curvature import CurvatureProbe
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
    "CurvatureProbe",
    "Decisions",
    "MemoryPolicy",
    "MemoryPolicyConfig",
    "Policy",
    "PrecisionPolicy",
    "PrecisionPolicyConfig",
    "Runtime",
    "RuntimeConfig",
    "Signals",
    "Telemetry",
    "default_regions",
    "read_telemetry",
]
