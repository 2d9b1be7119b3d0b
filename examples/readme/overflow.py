"""docs/precision.md twin: "fp16, loss scaling and the overflow flag". The block word for word on a small GPT, on CUDA
when there is one, else on the CPU; a gradient made infinite at the second step must raise the flag."""

import torch

from dpcs_compiler.models import workload

device = "cuda" if torch.cuda.is_available() else "cpu"
w = workload("gpt", 2, layers=1)
model = w.model.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
flags = []


def batches():
    """Three batches; before the second, lm_head's weight is scaled past fp16's range (restored after)."""
    for i in range(3):
        with torch.no_grad():
            if i == 1:
                saved = model.lm_head.weight.clone()
                model.lm_head.weight.mul_(1e8)
            if i == 2:
                model.lm_head.weight.copy_(saved)
        yield tuple(t.to(device) for t in w.inputs)


data = batches()

from dpcs_compiler.ops import overflow

compiled = torch.compile(model, backend="dpcs", options={"precision": "fp16"})
scaler = torch.amp.GradScaler(device)     # device: "cuda" (or "cpu")
for batch in data:
    optimizer.zero_grad()
    scaler.scale(compiled(*batch)).backward()
    flag = overflow.take_overflow(device)   # a 0-dim bool tensor on the device; no sync
    scaler.step(optimizer)                  # skips the step when the scaled gradients overflowed
    scaler.update()
    flags.append(bool(flag))

assert flags == [False, True, False], flags
print(f"overflow flag per step on {device}: {flags}")
