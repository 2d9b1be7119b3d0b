"""The cadence in a 2-rank gloo job (`cadence_rank_worker.py`): the weighted sync equals one big batch of every
sample every rank ran, eager and dpcs-compiled; the counts follow measured speeds; a rank that stops reporting
is a clear error within the timeout, not a hang."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from cadence_scenarios import LR, ROUNDS, SPEEDS, loss_of, make_net, round_batch
from dpcs_compiler.cli import main
from dpcs_compiler.runtime.telemetry import read_telemetry
from dpcs_testing import run_rank_processes

WORKER = Path(__file__).resolve().parent / "cadence_rank_worker.py"


def run_ranks(tmp_path: Path, scenario: str) -> list[dict]:
    store = tmp_path / "store"
    results = [tmp_path / f"result{rank}.pt" for rank in range(2)]
    commands = [[sys.executable, str(WORKER), str(rank), "2", str(store), scenario, str(results[rank]), str(tmp_path)]
                for rank in range(2)]
    run_rank_processes(commands, [os.environ | {"OMP_NUM_THREADS": "1"}] * 2)
    return [torch.load(r) if r.exists() else None for r in results]  # a rank that stopped writes none


@pytest.fixture(scope="module")
def exact_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cadence_exact")


@pytest.fixture(scope="module")
def exact(exact_dir) -> list[dict]:
    return run_ranks(exact_dir, "exact")


def big_batch_steps(uneven: bool) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[list[torch.Tensor]]]:
    """One process: each round's samples of both ranks as one batch. Returns each step's gradients, the final
    parameters, and the gradients an unweighted average of the two ranks' means (what DDP computes) gives."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    counts = tuple(int(s) for s in SPEEDS)
    grads, unweighted = [], []
    for round_ in range(ROUNDS):
        x, y = round_batch(round_, counts, uneven)
        net.zero_grad(set_to_none=True)
        per_rank = []
        for rank, count in enumerate(counts):
            xs, ys = round_batch(round_, tuple(c if r == rank else 0 for r, c in enumerate(counts)), uneven)
            net.zero_grad(set_to_none=True)
            loss_of(net(xs), ys).backward()
            per_rank.append([p.grad.clone() for p in net.parameters()])
        unweighted.append([(a + b) / 2 for a, b in zip(*per_rank)])
        net.zero_grad(set_to_none=True)
        loss_of(net(x), y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        optimizer.step()
    return grads, [p.detach() for p in net.parameters()], unweighted


@pytest.mark.parametrize("variant", ["eager", "compiled"])
def test_weighted_sync_equals_one_big_batch_of_every_rank_s_samples(exact, variant):
    zero, one = exact[0][variant], exact[1][variant]
    assert zero["counts"] == one["counts"] == [(1, 2)] * ROUNDS  # rank 1 runs twice rank 0's micro-batches
    grads, params, unweighted = big_batch_steps(uneven=variant == "eager")
    for step in range(ROUNDS):
        for got_zero, got_one, expected, plain in zip(zero["grads"][step], one["grads"][step], grads[step], unweighted[step]):
            assert torch.equal(got_zero, got_one)
            torch.testing.assert_close(got_zero, expected, rtol=1e-10, atol=1e-12)
            # The check can fail: averaging the ranks' means, as DDP does, is far off here.
            assert (plain - expected).abs().max() > 1e-3
    for got_zero, got_one, expected in zip(zero["params"], one["params"], params):
        assert torch.equal(got_zero, got_one)
        torch.testing.assert_close(got_zero, expected, rtol=1e-10, atol=1e-12)
    # DDP broadcasts rank 0's buffers: rank 0 ran one micro-batch (2 samples, 3 when even) per round, and
    # rank 1's buffer is rank 0's after each sync.
    assert zero["seen"] == one["seen"] == (2 if variant == "eager" else 3) * ROUNDS
    assert zero["state"]["steps"] == ROUNDS and zero["restored"] and one["restored"]
    # The gradients live in the all-reduce buckets: no second copy of them.
    assert zero["in_buckets"] == one["in_buckets"] == [True] * ROUNDS


def test_a_runtime_s_telemetry_carries_the_cadence_and_dpcs_plot_draws_both(exact, exact_dir, capsys):
    entries = read_telemetry(exact_dir / "runtime0.jsonl")
    kinds = [e["kind"] for e in entries]
    assert kinds.count("cadence") == ROUNDS and kinds.count("signals") == ROUNDS and "compiles" in kinds
    assert [e["counts"] for e in entries if e["kind"] == "cadence"] == [[1, 2]] * ROUNDS
    # Dynamo restarts its analysis once here (a Python int added to a buffer): not a failed compile.
    assert all(c["error"] is None for e in entries if e["kind"] == "compiles" for c in e["compiles"])
    assert main(["plot", str(exact_dir / "runtime0.jsonl"), "-o", str(exact_dir / "both.png")]) == 0
    printed = capsys.readouterr().out
    assert f"{ROUNDS} signal reads" in printed and f"{ROUNDS} cadence syncs" in printed


def test_counts_follow_measured_speeds_and_are_recorded(tmp_path, capsys):
    zero, one = run_ranks(tmp_path, "adapt")
    assert zero["counts"] == one["counts"]  # the same decisions on every rank
    assert zero["counts"][0] == (1, 1)
    # Rank 1 sleeps 30 ms per micro-batch, rank 0 6 ms: rank 0 soon runs several micro-batches per sync.
    assert zero["counts"][-1][1] == 1 and zero["counts"][-1][0] >= 3, zero["counts"]
    entries = read_telemetry(tmp_path / "rank0.jsonl")
    assert [e["step"] for e in entries] == list(range(1, 9)) and all(e["kind"] == "cadence" for e in entries)
    last = entries[-1]
    assert last["counts"] == list(zero["last"]["counts"]) and last["anchor"] == 1
    assert len(last["idle_seconds"]) == 2 and last["sync_seconds"] >= 0 and "busy_seconds" in last
    assert read_telemetry(tmp_path / "rank1.jsonl") == entries
    assert main(["plot", str(tmp_path / "rank0.jsonl"), "-o", str(tmp_path / "cadence.png")]) == 0
    assert (tmp_path / "cadence.png").read_bytes()[:4] == b"\x89PNG"
    assert "8 cadence syncs" in capsys.readouterr().out


def test_a_rank_that_stops_reporting_is_a_clear_error_within_the_timeout(tmp_path):
    zero, _ = run_ranks(tmp_path, "hang")
    assert zero["error"] is not None and zero["seconds"] < 7
    assert "got no answer from the other ranks within 2 s" in zero["error"]
    assert "rank 0" in zero["error"] and "stopped reporting" in zero["error"]
