#!/usr/bin/env bash
# docs/options.md twin: "Options without code". A train.py and a dpcs.toml in a fresh folder, then the block word for
# word; train.py checks the options reached the compile, and where the record says they came from.
set -euo pipefail
cd "$(mktemp -d)"
cat > train.py <<'PY'
import json, os
import torch
from dpcs_compiler import compile_records
from dpcs_compiler.models import workload

w = workload("gpt", 2, layers=1)
compiled = torch.compile(w.model, backend="dpcs", options={"compiler": "eager"})
compiled(*w.inputs).backward()
record = compile_records()[0]
sources = dict(record.option_sources)
assert record.budget_bytes == 6 * 2**30, record.budget_bytes
assert sources["compiler"] == "code" and "DPCS_OPTIONS" in sources["memory_budget"], sources
print(f"DPCS_OPTIONS={os.environ['DPCS_OPTIONS']}: budget {record.budget_bytes} B, precision {record.precision}; "
      f"sources {json.dumps(sources)}")
PY
printf 'memory_budget = "6GiB"\n' > dpcs.toml

DPCS_OPTIONS='{"memory_budget": "6GiB", "precision": "bf16"}' python train.py
DPCS_OPTIONS=dpcs.toml python train.py      # memory_budget = "6GiB"
