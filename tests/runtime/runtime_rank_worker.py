"""One rank of the 2-process gloo runtime tests in test_runtime_ranks.py (run as a script, not collected).

    python runtime_rank_worker.py RANK WORLD STORE_FILE SCENARIO RESULT_FILE

overflow: each rank trains its own Blocks through dpcs in bf16 under a Runtime; at step 3 only rank 1's
    gradients overflow. Writes per step the dtype the step ran in and the runtime's decisions.
ddp: a DDP-wrapped Blocks compiled with dpcs under a Runtime whose decisions are forced per step through a
    switch sequence (fp32, bf16, budgets); each rank takes its half of a global batch. Writes the gradients
    of every step (torch.save).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import join, leave, report_crashes, see_dpcs_warnings  # noqa: E402
from runtime_scenarios import SWITCHES, WIDTH, Blocks, apply_switch, global_batch  # noqa: E402
from dpcs_compiler import PrecisionPolicy, Runtime  # noqa: E402


def overflow(rank: int) -> dict:
    torch.manual_seed(0)
    model = Blocks()
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": True, "precision": "bf16"})
    runtime = Runtime(model, policies=[PrecisionPolicy(modes=("fp32", "bf16"), per_region=False)], signal_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64) + rank
    steps = []
    for step in range(1, 7):
        optimizer.zero_grad(set_to_none=True)
        out = compiled(x)
        out.float().square().mean().backward()
        if step == 3 and rank == 1:
            model.head.weight.grad[0, 0] = float("nan")
        if step != 3:
            optimizer.step()
        runtime.step()
        steps.append({"dtype": str(out.dtype), "decisions": runtime.decisions.key(), "precision": runtime.decisions.precision})
    return {"steps": steps, "compiles": [g.compiles for g in runtime.graphs],
            "plan_hashes": [e.plan_hashes for e in runtime.compile_events]}


def ddp(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Blocks(width=WIDTH)
    # Small buckets: DDPOptimizer splits the graph at bucket boundaries, so the runtime drives several graphs.
    wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    compiled = torch.compile(wrapped, backend="dpcs", options={"compiler": "eager", "strict": True})
    runtime = Runtime(wrapped, policies=[])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = global_batch().chunk(world)[rank]
    grads, params = [], []
    for switch in SWITCHES:
        params.append([p.detach().clone() for p in model.parameters()])
        apply_switch(runtime, switch)
        optimizer.zero_grad(set_to_none=True)
        compiled(x).float().square().mean().backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        runtime.step()
    from dpcs_compiler import compile_records

    return {"grads": grads, "params": params, "compiles": [g.compiles for g in runtime.graphs], "graphs": len(runtime.graphs),
            "plan_hashes": [e.plan_hashes for e in runtime.compile_events],
            "recomputed": [r.recomputed_values for r in compile_records()]}


def main() -> None:
    report_crashes()
    rank, world, store, scenario, result = sys.argv[1:6]
    rank, world = int(rank), int(world)
    join(store, rank, world)
    with warnings.catch_warnings():
        see_dpcs_warnings()
        out = overflow(rank) if scenario == "overflow" else ddp(rank, world)
    torch.save(out, result)
    leave()


if __name__ == "__main__":
    main()
