"""README and docs/runtime.md twin: "Runtime: adapting the plan between steps". The block word for word on a small GPT (three
batches); the Runtime steps after each."""

from dpcs_compiler.models import workload

w = workload("gpt", 2, layers=1)
model = w.model
data = [w.inputs] * 3

import torch
from dpcs_compiler import Runtime, PrecisionPolicy, MemoryPolicy

compiled = torch.compile(model, backend="dpcs", options={"precision": "bf16", "memory_budget": "6GiB"})
optimizer = torch.optim.AdamW(model.parameters())
rt = Runtime(model, policies=[PrecisionPolicy(modes=("fp32", "bf16")), MemoryPolicy()],
             telemetry="runs/telemetry.jsonl")          # the defaults: these two policies, no telemetry
for batch in data:
    optimizer.zero_grad(set_to_none=True)
    loss = compiled(*batch)
    loss.backward()
    optimizer.step()
    rt.step(loss=loss, optimizer=optimizer)             # all arguments optional
rt.close()                                              # writes what telemetry is left

import pathlib

assert rt.step_count == 3 and pathlib.Path("runs/telemetry.jsonl").exists()
print(f"the Runtime stepped {rt.step_count} times; decisions {rt.decisions.describe()}; telemetry in runs/telemetry.jsonl")
