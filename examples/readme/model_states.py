"""docs/model_states.md twin: "Model states". The block word for word on a small GPT (it builds each lever in turn); its
last optimizer, dpcs choosing the state's format and what to offload, then trains three steps."""

import torch

from dpcs_compiler.models import workload

w = workload("gpt", 2, layers=2)
model = w.model

from dpcs_compiler import CompressedOptimizer, ParameterOffload

# Optimizer state stored int8 (blockwise dynamic map) / fp16 / bf16, or kept as is, per state; on the host
# between steps (pinned on CUDA); decoded a chunk of parameters (or a slice of rows of a large one) at a time.
optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters()), states={"exp_avg": "int8", "exp_avg_sq": "fp16"})
# Or let dpcs choose, with the activation plan, under the compiled model's memory_budget:
optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters()), states="auto")
# Blocks' parameters and gradients in host memory between uses, brought back (prefetched) for their forward
# and backward; the optimizer steps them on the host, with their state there too. auto=True: dpcs chooses
# which blocks, with the state's lever and the activation plan; auto=False: every block. Once per model.
offload = ParameterOffload(list(model.blocks), auto=True)
optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters()), states="auto", offload=offload)

compiled = torch.compile(model, backend="dpcs", options={"memory_budget": "6GiB"})
losses = []
for _ in range(3):
    loss = compiled(*w.inputs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
with offload.gathered():  # offloaded parameters readable between steps (their storage is empty otherwise)
    assert all(torch.isfinite(p).all() for p in model.parameters())
print(f"trained 3 steps, dpcs choosing the optimizer state's format and the offloaded blocks: loss {losses}")
