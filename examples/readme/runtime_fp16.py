"""docs/runtime.md twin: the Runtime with fp16 and a GradScaler. The block word for word on a small GPT, on CUDA when
there is one, else on the CPU."""

import torch

from dpcs_compiler import PrecisionPolicy, Runtime
from dpcs_compiler.models import workload

device = "cuda" if torch.cuda.is_available() else "cpu"
w = workload("gpt", 2, layers=1)
model = w.model.to(device)
data = [tuple(t.to(device) for t in w.inputs)] * 3
optimizer = torch.optim.AdamW(model.parameters())

compiled = torch.compile(model, backend="dpcs", options={"precision": "fp16"})
scaler = torch.amp.GradScaler(device)
rt = Runtime(model, policies=[PrecisionPolicy(modes=("fp32", "fp16"))])
for batch in data:
    optimizer.zero_grad(set_to_none=True)
    loss = compiled(*batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    rt.step(loss=loss, optimizer=optimizer, scaler=scaler)

rt.close()
assert rt.step_count == 3 and scaler.is_enabled()
print(f"fp16 with a GradScaler on {device}: scale {scaler.get_scale()}, the Runtime stepped {rt.step_count} times")
