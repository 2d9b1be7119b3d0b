"""docs/options.md twin: "Options". The block runs word for word on a small GPT; the last compile is called."""

from dpcs_compiler import compile_records
from dpcs_compiler.models import workload

w = workload("gpt", 2, layers=1)
model = w.model

import torch
compiled = torch.compile(model, backend="dpcs")                    # registered by the package's entry point
compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": True, "dump_dir": "dumps"})

compiled(*w.inputs).backward()
record = compile_records()[-1]
assert record.compiler == "eager" and record.dump_dir and "dumps" in record.dump_dir, record
print(f"compiled through dpcs, dumped into {record.dump_dir}")
