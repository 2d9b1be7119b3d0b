"""docs/precision.md twin: "Precision". The block word for word on a small GPT; then each of its compiles trains a step
(select "all": on a CPU fp8 is never faster, so the default would keep every linear in bf16)."""

import torch

from dpcs_compiler import compile_records



class Net(torch.nn.Module):
    """Linears wide enough for fp8 (the default filter takes those of 1024 or more features)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(1024, 1024)
        self.lm_head = torch.nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.body(x))).float().pow(2).mean()


model = Net()
x = torch.randn(32, 1024)

compiled = torch.compile(model, backend="dpcs", options={"precision": "bf16", "keep_fp32": ["lm_head"]})
compiled = torch.compile(model, backend="dpcs", options={"precision": "bf16", "fp8": {"recipe": "rowwise", "select": "all"}})

compiled(x).backward()
torch._dynamo.reset()
torch.compile(model, backend="dpcs", options={"precision": "bf16", "keep_fp32": ["lm_head"]})(x).backward()
fp8, kept = [r for r in compile_records() if r.mode == "training"]
assert fp8.precision == kept.precision == "bf16" and fp8.fp8_linears > 0 and kept.fp8_linears == 0, (fp8, kept)
print(f"bf16 with fp8 linears: {fp8.fp8_linears}; bf16 with lm_head kept in fp32: {kept.cast_ops} cast ops")
