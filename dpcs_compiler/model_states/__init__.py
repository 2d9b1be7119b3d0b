"""The model-state levers: optimizer state stored compressed or on the host (`compressed_optimizer.py`, its
formats in `state_codec.py`), and blocks' parameters and gradients kept in host memory between uses
(`param_offload.py`). The step planner (`dpcs_compiler.step`) chooses them with the activation plan under one
budget.

    optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters()), states="int8")
    ParameterOffload(list(model.blocks), auto=True)
"""

from dpcs_compiler.model_states.compressed_optimizer import CompressedOptimizer, decompress_state_dict
from dpcs_compiler.model_states.param_offload import ParameterOffload

__all__ = ["CompressedOptimizer", "ParameterOffload", "decompress_state_dict"]
