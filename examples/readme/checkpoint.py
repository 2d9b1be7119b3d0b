"""docs/checkpoints.md twin: "Checkpoints". The block word for word, twice: the first run saves at steps 100 and 200 (its
training step is the block's `...`); the second, to step 300, resumes from step 200 and gets the first run's
`extra` back."""

import torch

from dpcs_compiler import Runtime
from dpcs_compiler.models import workload

w = workload("gpt", 2, layers=1)
model = w.model
optimizer = torch.optim.AdamW(model.parameters())
runtime = Runtime(model)

for run, steps in enumerate((200, 300)):
    position = {"batch": 7} if run == 0 else {"batch": -1}
    from dpcs_compiler import checkpoint

    step = checkpoint.resume("ckpt", model=model, optimizer=optimizer, runtime=runtime, extra=position) or 0
    while step < steps:
        ...  # one training step
        step += 1
        if step % 100 == 0:
            checkpoint.save("ckpt", step, model=model, optimizer=optimizer, runtime=runtime, extra=position, keep=3)

    checkpoint.wait()  # an asynchronous save is committed
    assert checkpoint.latest("ckpt").name.endswith(str(steps)), checkpoint.latest("ckpt")
    assert position == {"batch": 7}, position  # the second run's came back from the checkpoint
    print(f"run {run + 1}: ran to step {step}, latest checkpoint {checkpoint.latest('ckpt').name}")
