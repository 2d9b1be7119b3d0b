"""One rank of the gloo tests of `dpcs_compiler.checkpoint` (run as a script, not collected).

    python checkpoint_rank_worker.py RANK WORLD STORE_FILE CHECKPOINT_DIR RESULT_FILE MODE

A two-layer stack sharded with FSDP2 (`fully_shard` per layer) trains with AdamW on batches of its rank.
MODE "save": 3 steps, a checkpoint of step 3 (with extra={"batch": 3}), 2 more steps ("save-async": the
checkpoint saved asynchronously, committed after the last step). MODE "resume": resume
from the newest checkpoint, then the steps after it. MODE "run" (the kill trials): resume if there is a
checkpoint, then up to RUN_STEPS steps with a checkpoint after each (keep 2), on batches fixed by step and
rank ("run-async": each saved asynchronously, committed at the next save or the end); rank 0 touches
READY_FILE (a 7th argument) when its loop starts. The result holds the step resumed,
the extra values and the full parameters at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_process import join, leave, report_crashes, see_dpcs_warnings, sharded_stack  # noqa: E402

from dpcs_compiler import checkpoint  # noqa: E402

STEPS = 5
RUN_STEPS = 8


def model_and_optimizer(world: int):
    model = sharded_stack(world)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(8, 48, generator=generator) for _ in range(STEPS)]


def main() -> None:
    report_crashes()
    rank, world, store, directory, result, mode = sys.argv[1:7]
    ready = sys.argv[7] if len(sys.argv) > 7 else None
    rank, world = int(rank), int(world)
    join(store, rank, world)
    see_dpcs_warnings()
    model, optimizer = model_and_optimizer(world)
    extra = {"batch": 0}
    start = 0
    if mode == "resume":
        start = checkpoint.resume(directory, model=model, optimizer=optimizer, extra=extra)
    if mode in ("run", "run-async"):
        start = checkpoint.resume(directory, model=model, optimizer=optimizer, extra=extra) or 0
        if ready is not None and rank == 0:
            Path(ready).touch()
        for step in range(start, RUN_STEPS):
            x = torch.randn(8, 48, generator=torch.Generator().manual_seed(1000 * rank + step))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            checkpoint.save(directory, step + 1, model=model, optimizer=optimizer, extra={"batch": step + 1},
                            keep=2, asynchronous=mode == "run-async")
    for step, x in enumerate(batches(rank)[start:] if not mode.startswith("run") else [], start=start):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mode.startswith("save") and step + 1 == 3:
            checkpoint.save(directory, 3, model=model, optimizer=optimizer, extra={"batch": 3},
                            asynchronous=mode == "save-async")
    checkpoint.wait()
    torch.save({"start": start, "extra": extra,
                "parameters": [p.full_tensor().detach().clone() for p in model.parameters()]}, result)
    leave()


if __name__ == "__main__":
    main()
