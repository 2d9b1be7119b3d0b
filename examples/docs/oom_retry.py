"""docs/oom.md twin: the block word for word on a small GPT (three batches), with one out-of-memory error
injected while AdamW's first step allocates its state; the step must be rerun once, and the telemetry say so."""

import pathlib

import torch

from dpcs_compiler.models import workload
from dpcs_compiler.runtime import read_telemetry

pathlib.Path("runs/telemetry.jsonl").unlink(missing_ok=True)  # the Runtime appends to it

w = workload("gpt", 2, layers=1)
model = w.model
data = [w.inputs] * 3
original = torch.optim.Adam._init_group


def allocates_then_runs_out(self, *args, **kwargs):
    """AdamW's first step: its state allocated, then (simulated) the device is out of memory, once."""
    del torch.optim.AdamW._init_group
    original(self, *args, **kwargs)
    raise torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")


torch.optim.AdamW._init_group = allocates_then_runs_out

import torch
from dpcs_compiler import Runtime

compiled = torch.compile(model, backend="dpcs", options={"memory_budget": "6GiB"})
optimizer = torch.optim.AdamW(model.parameters())
rt = Runtime(model, telemetry="runs/telemetry.jsonl")


def train_step(batch):
    optimizer.zero_grad(set_to_none=True)  # a step starts from no gradients
    loss = compiled(*batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


for batch in data:
    loss = rt.run_step(train_step, batch)  # on an OOM: free, tighten the plan, rerun exactly (or say why not)
    rt.step(loss=loss, optimizer=optimizer)  # once per step, rerun or not
rt.close()

entries = read_telemetry("runs/telemetry.jsonl")
[oom] = [e for e in entries if e["kind"] == "oom"]
[recovered] = [e for e in entries if e["kind"] == "oom_recovered"]
assert (oom["step"], oom["phase"], oom["optimizer"], oom["retried"]) == (1, "optimizer", "AdamW", True)
assert recovered["attempts"] == 2 and oom["decisions"]["budget_scale"] == 0.85
assert rt.step_count == 3 and all(s["step"].item() == 3 for s in optimizer.state.values())  # each update once
print(f"step 1 ran out of memory in the {oom['phase']} step, was rerun with {rt.decisions.describe()}; "
      f"{rt.step_count} steps; telemetry in runs/telemetry.jsonl")
