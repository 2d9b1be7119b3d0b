"""The Runtime in a 2-rank gloo job (`runtime_rank_worker.py`): signals combined over the ranks, decisions
taken on rank 0, every rank switching at the same step to the same plans; DDP gradients through switches
equal to a single process's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from dpcs_compiler import Runtime
from dpcs_testing import allowing_best_plan, run_rank_processes
from runtime_scenarios import SWITCHES, WIDTH, Blocks, apply_switch, global_batch

WORKER = Path(__file__).resolve().parent / "runtime_rank_worker.py"


def run_ranks(tmp_path: Path, scenario: str) -> list[dict]:
    store = tmp_path / "store"
    results = [tmp_path / f"result{rank}.pt" for rank in range(2)]
    commands = [[sys.executable, str(WORKER), str(rank), "2", str(store), scenario, str(results[rank])] for rank in range(2)]
    run_rank_processes(commands, [os.environ | {"OMP_NUM_THREADS": "1"}] * 2)
    return [torch.load(r) for r in results]


def test_an_overflow_on_rank_one_only_promotes_both_ranks_at_the_same_step(tmp_path):
    zero, one = run_ranks(tmp_path, "overflow")
    assert zero["steps"] == one["steps"]  # same decisions, same dtypes, every step
    precisions = [s["precision"] for s in zero["steps"]]
    assert precisions[:2] == ["bf16", "bf16"] and precisions[2] == "fp32"  # rank 1's overflow at step 3
    assert [s["dtype"] for s in zero["steps"]][3] == "torch.float32"  # step 4 runs the promoted variant
    assert zero["compiles"] == one["compiles"] == [2]
    assert zero["plan_hashes"] == one["plan_hashes"]


def test_ddp_gradients_through_a_switch_sequence_match_a_single_process(tmp_path):
    """Each step from the parameters the ranks had before it (a bf16 step moves them differently from one
    process's bf16 step), compared with the same variant in one process on the whole batch."""
    zero, one = run_ranks(tmp_path, "ddp")
    graphs = zero["graphs"]
    assert graphs > 1 and zero["compiles"] == one["compiles"] == [4] * graphs  # fp32/bf16 x loose/tight, per bucket
    assert zero["plan_hashes"] == one["plan_hashes"] and len(zero["plan_hashes"]) == 4 * graphs
    assert zero["recomputed"] == one["recomputed"] and sum(zero["recomputed"]) > 0  # the tight plans recompute
    torch.manual_seed(0)
    model = Blocks(width=WIDTH)
    compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": True})
    runtime = Runtime(model, policies=[])
    x = global_batch()
    with allowing_best_plan():  # any other dpcs warning fails the test
        for step, switch in enumerate(SWITCHES):
            with torch.no_grad():  # the same parameters as the ranks had: each step's gradients compare alone
                for p, theirs in zip(model.parameters(), zero["params"][step]):
                    p.copy_(theirs)
            apply_switch(runtime, switch)
            model.zero_grad(set_to_none=True)
            compiled(x).float().square().mean().backward()
            tolerance = {"atol": 2e-2, "rtol": 2e-2} if switch[0] == "bf16" else {"atol": 1e-5, "rtol": 1e-4}
            for rank_grads in (zero["grads"][step], one["grads"][step]):
                for got, expected in zip(rank_grads, (p.grad for p in model.parameters())):
                    torch.testing.assert_close(got, expected, **tolerance, msg=lambda m: f"step {step} {switch}: {m}")
            runtime.step()
    for a, b in zip(zero["grads"][-1], one["grads"][-1]):
        assert torch.equal(a, b)  # DDP: identical on both ranks
