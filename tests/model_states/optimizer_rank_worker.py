"""One rank of the 2-process gloo test of compressed optimizer state under FSDP2 (run as a script, not collected).

    python optimizer_rank_worker.py RANK WORLD STORE_FILE CHECKPOINT_DIR RESULT_FILE

A two-layer stack sharded with `fully_shard` trains 3 steps with a `CompressedOptimizer` (int8 first moments,
fp16 second moments), saves model and optimizer through `torch.distributed.checkpoint`, loads them into a
fresh model and optimizer, and both take 2 more steps on the same data. The result holds both optimizers'
state dicts (local shards) and the full parameters of both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import join, leave, report_crashes, see_dpcs_warnings, sharded_stack  # noqa: E402

from dpcs_compiler.model_states.compressed_optimizer import CompressedOptimizer  # noqa: E402

POLICY = {"exp_avg": "int8", "exp_avg_sq": "fp16"}


def sharded_model_and_optimizer(world: int):
    model = sharded_stack(world)
    inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    return model, CompressedOptimizer(inner, states=POLICY, block_size=16, min_elements=64)


def train(model, optimizer, batches) -> None:
    for x in batches:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def local_state(optimizer) -> dict:
    def local(value):
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            return (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
        return value

    return local(optimizer.state_dict()["state"])


def main() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    report_crashes()
    rank, world, store, checkpoint, result = sys.argv[1:6]
    rank, world = int(rank), int(world)
    join(store, rank, world)
    see_dpcs_warnings()
    generator = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randn(8, 48, generator=generator) for _ in range(5)]

    model, optimizer = sharded_model_and_optimizer(world)
    train(model, optimizer, batches[:3])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    saved = local_state(optimizer)

    fresh_model, fresh_optimizer = sharded_model_and_optimizer(world)
    model_template, optim_template = get_state_dict(fresh_model, fresh_optimizer)
    loaded = {"model": model_template, "optim": optim_template}
    dcp.load(loaded, checkpoint_id=checkpoint)
    set_state_dict(fresh_model, fresh_optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    restored = local_state(fresh_optimizer)

    train(model, optimizer, batches[3:])
    train(fresh_model, fresh_optimizer, batches[3:])
    torch.save({
        "saved": saved,
        "restored": restored,
        "stored_formats": sorted({v["format"] for entry in saved.values() for v in entry.values()
                                  if isinstance(v, dict)}),
        "continued": [p.full_tensor().detach().clone() for p in model.parameters()],
        "resumed": [p.full_tensor().detach().clone() for p in fresh_model.parameters()],
    }, result)
    leave()


if __name__ == "__main__":
    main()
