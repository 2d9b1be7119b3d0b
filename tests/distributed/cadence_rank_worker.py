"""One rank of the 2-process gloo cadence tests in test_cadence_ranks.py (run as a script, not collected).

    python cadence_rank_worker.py RANK WORLD STORE_FILE SCENARIO RESULT_FILE TELEMETRY_DIR

exact: rank 1 is declared twice as fast (speeds, report_timing=False): it runs 2 micro-batches per sync to
    rank 0's 1, of other sizes (equal ones when compiled). Three SGD steps of a DDP-wrapped float64 `Net`, then of the same `Net` wrapped in
    DDP and compiled with dpcs under a Runtime (the cadence writes to its telemetry); writes each step's
    gradients and the final parameters and buffer.
adapt: rank 1 sleeps 30 ms per micro-batch; the counts follow the measured times (telemetry written).
hang: rank 1 stops after its first forward, before the sync, and waits 5 s; rank 0's sync has a 2 s timeout.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from cadence_scenarios import LR, ROUNDS, SPEEDS, loss_of, make_net, micro_batch  # noqa: E402
from rank_process import join, leave, report_crashes, see_dpcs_warnings  # noqa: E402
from dpcs_compiler import Runtime  # noqa: E402
from dpcs_compiler.distributed.cadence import Cadence, CadenceError  # noqa: E402


def train(rank: int, compiled: bool, telemetry: Path) -> dict:
    net = make_net()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    model = torch.compile(ddp, backend="dpcs", options={"compiler": "eager", "strict": True}) if compiled else ddp
    # Compiled: under a dpcs Runtime too, the cadence's lines in the runtime's telemetry.
    runtime = Runtime(ddp, policies=[], signal_every=1, telemetry=telemetry / f"runtime{rank}.jsonl",
                      telemetry_every=1) if compiled else None
    cadence = Cadence(model, anchor=1, speeds=SPEEDS, report_timing=False, telemetry=runtime)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    grads, counts, in_buckets = [], [], []
    for round_ in range(ROUNDS):
        counts.append(cadence.counts)
        for index in range(cadence.count):
            x, y = micro_batch(round_, rank, index, uneven=not compiled)
            synced = cadence.backward(loss_of(model(x), y), samples=x.shape[0])
            assert synced == (index == counts[-1][rank] - 1)
        grads.append([p.grad.detach().clone() for p in net.parameters()])
        buffers = {b["buffer"].untyped_storage().data_ptr() for b in cadence._buckets}
        in_buckets.append(all(p.grad.untyped_storage().data_ptr() in buffers for p in net.parameters()))
        optimizer.step()
        if runtime is not None:
            runtime.step()
        optimizer.zero_grad(set_to_none=True)
    if runtime is not None:
        runtime.close()
    state = cadence.state_dict()
    cadence.close()
    resumed = Cadence(model, anchor=1, speeds=SPEEDS, report_timing=False)
    resumed.load_state_dict(state)
    restored = resumed.state_dict() == state
    resumed.close()
    return {"grads": grads, "counts": counts, "params": [p.detach().clone() for p in net.parameters()],
            "seen": net.seen.item(), "state": state, "restored": restored, "in_buckets": in_buckets}


def adapt(rank: int, telemetry: Path) -> dict:
    net = make_net()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    cadence = Cadence(ddp, anchor=1, overhead_target=None, telemetry=telemetry / f"rank{rank}.jsonl")
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    counts = []
    for round_ in range(8):
        counts.append(cadence.counts)
        for index in range(cadence.count):
            x, y = micro_batch(round_, rank, index % 3)
            time.sleep(0.03 if rank == 1 else 0.006)
            cadence.backward(loss_of(ddp(x), y), samples=x.shape[0])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    cadence.close()
    return {"counts": counts, "last": cadence.last}


def hang(rank: int) -> dict:
    net = make_net()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    cadence = Cadence(ddp, timeout=2.0)
    x, y = micro_batch(0, rank, 0)
    loss = loss_of(ddp(x), y)  # DDP's first forward broadcasts the buffers: both ranks get this far
    if rank == 1:  # then stops reporting: never reaches the sync
        time.sleep(5)
        os._exit(0)
    started = time.monotonic()
    try:
        cadence.backward(loss, samples=x.shape[0])
    except CadenceError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def main() -> None:
    report_crashes()
    rank, world, store, scenario, result, telemetry = sys.argv[1:7]
    rank, world = int(rank), int(world)
    join(store, rank, world)
    with warnings.catch_warnings():
        see_dpcs_warnings()
        if scenario == "exact":
            out = {"eager": train(rank, False, Path(telemetry)), "compiled": train(rank, True, Path(telemetry))}
        elif scenario == "adapt":
            out = adapt(rank, Path(telemetry))
        else:
            out = hang(rank)
            torch.save(out, result)
            os._exit(0)  # the group is broken: no barrier to leave through
    torch.save(out, result)
    leave()


if __name__ == "__main__":
    main()
