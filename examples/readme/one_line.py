"""README twin: the one-line use (first screen, and docs/memory_budget.md). The block runs word for word on a small
GPT; the lines after it check what it did."""

import torch

from dpcs_compiler import compile_records
from dpcs_compiler.models import workload

w = workload("gpt", 2, layers=1)
model = w.model

model = torch.compile(model, backend="dpcs", options={"memory_budget": "6GiB"})

model(*w.inputs).backward()
(record,) = [r for r in compile_records() if r.mode == "training"]
assert record.budget_bytes == 6 * 2**30 and record.plan_feasible, record
print(f"planned within {record.budget_bytes} B: predicted peak {record.predicted_peak_bytes} B")
