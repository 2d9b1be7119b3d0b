"""Read-only analyses of aten-level graphs: sizes, liveness, memory timeline, op cost."""

from dpcs_compiler.passes.analysis.liveness import Interval, Liveness, liveness
from dpcs_compiler.passes.analysis.memory_timeline import MemoryTimeline, TimelineStep, memory_timeline
from dpcs_compiler.passes.analysis.op_cost import OpCost, op_cost
from dpcs_compiler.passes.analysis.schedule import BACKWARD, FORWARD, Schedule
from dpcs_compiler.passes.analysis.tensor_bytes import Buffer, TensorBytes, tensor_bytes

__all__ = [
    "BACKWARD", "FORWARD", "Buffer", "Interval", "Liveness", "MemoryTimeline", "OpCost", "Schedule",
    "TensorBytes", "TimelineStep", "liveness", "memory_timeline", "op_cost", "tensor_bytes",
]
