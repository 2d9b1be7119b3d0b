"""docs/cadence.md twin: "Ranks of unequal speed". Two gloo ranks on this machine (spawned here; the test runs this
script as its own process: see the marker below), each running the block word for word on a small regression model; the ranks
end with the same parameters.

    python examples/readme/cadence.py
"""

# readme-twin: own process

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.mse_loss
    runtime, steps = None, 4
    generator = torch.Generator().manual_seed(rank)
    batches = iter(lambda: (torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)), None)

    from dpcs_compiler import Cadence

    ddp = torch.nn.parallel.DistributedDataParallel(model)       # or torch.compile(ddp, backend="dpcs"), or a plain module
    cadence = Cadence(ddp, anchor=1, telemetry=runtime)            # runtime: a dpcs Runtime (its JSONL), a path, or None
    for step in range(steps):
        for _ in range(cadence.count):                             # this rank's micro-batches this round
            x, y = next(batches)
            cadence.backward(loss_fn(ddp(x), y), samples=len(x))   # the last one syncs
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], other) for other in gathered), "the ranks' parameters differ"
    if rank == 0:
        print(f"{steps} steps on {world} ranks: counts per round {cadence.counts}, parameters equal on every rank")
    cadence.close()
    # Every rank past its last collective before the group goes: a gloo thread still releasing the all-gather's
    # tensors while the interpreter finalizes aborts the rank (tests/rank_process.py, `leave`).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(2, os.path.join(folder, "store")), nprocs=2)
