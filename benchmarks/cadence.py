"""El Che cadence against plain DDP when one rank is slower: samples/s, idle time per rank and the loss, on a
small GPT learning a Markov language, with 2 gloo ranks on the CPU.

    python benchmarks/cadence.py [--reps 11] [--steps 30] [--warmup 6] [--slowdowns 1 2 4] [--out benchmarks/results]

Rank 1 is made `s` times slower than rank 0 by a sleep of (s - 1) x the measured micro-batch time after each of
its micro-batches (the same for both strategies). Per repetition, interleaved, for each slowdown: plain DDP
(one micro-batch per rank per optimizer step, gradients all-reduced in the backward) and El Che
(`dpcs_compiler.Cadence(anchor=1)`: the ranks run micro-batches in proportion to their measured speed, then
one weighted sync), each `--steps` AdamW steps from the same initial model, the order of the two alternating
between repetitions. Throughput is both ranks' samples per second of each optimizer step after `--warmup`,
the median over the steps (the whole run's samples over its wall time is kept beside it); a rank's idle time
is its wall time less the time its own micro-batches and optimizer steps take alone (timed with both ranks
computing, no collective, just before each run). Ratios are El Che / DDP per repetition (run back to back), then the
median over the repetitions. The loss is the held-out loss
of the model each strategy trained (median over repetitions), after the same number of optimizer steps (El
Che has seen more samples when a rank is slow: the curves are also drawn against samples seen and against
time, and El Che's training loss at the time DDP finished is reported beside DDP's).
Writes cadence_<device>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without the package installed
    sys.path.insert(0, str(REPO))

from dpcs_compiler.models import GPTConfig, MiniGPT, markov_text  # noqa: E402

CONFIG = GPTConfig(vocab=128, block_size=64, d_model=128, heads=4, layers=2)
BATCH = 16  # sequences per micro-batch
LR = 3e-3
WORLD = 2
SLOW_RANK = 1


def make_model() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CONFIG)


class Data:
    """This rank's micro-batches of one Markov language (the same chain on every rank, other sequences)."""

    def __init__(self, rank: int, count: int) -> None:
        batches = markov_text(CONFIG.vocab, BATCH, CONFIG.block_size, WORLD * count + 4, seed=0)
        self.batches = batches[rank * count:(rank + 1) * count]
        self.held_out = batches[WORLD * count:]
        self.next = 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.next % len(self.batches)]
        self.next += 1
        return batch

    def loss(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            return statistics.fmean(model(x, y).item() for x, y in self.held_out)


def calibrate(data: Data) -> tuple[float, float]:
    """Seconds of one micro-batch (forward and backward) and of one AdamW step, alone: medians of 7."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch, step = [], []
    for _ in range(9):
        x, y = data.take()
        start = time.perf_counter()
        model(x, y).backward()
        batch.append(time.perf_counter() - start)
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.append(time.perf_counter() - start)
    return statistics.median(batch[2:]), statistics.median(step[2:])


def segment(strategy: str, rank: int, slowdown: float, batch_seconds: float, steps: int, warmup: int, data: Data) -> dict:
    """`steps` optimizer steps of one strategy from the initial model; what this rank measured."""
    import torch.distributed as dist

    from dpcs_compiler import Cadence

    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sleep = (slowdown - 1) * batch_seconds if rank == SLOW_RANK else 0.0
    cadence = Cadence(ddp, anchor=1) if strategy == "elche" else None
    losses, samples, counts, anchors, ends, syncs = [], [], [], [], [], []
    dist.barrier()
    start = measured_from = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            measured_from = time.perf_counter()
            measured_samples = sum(samples)
        count = cadence.count if cadence is not None else 1
        loss_sum, taken = 0.0, 0
        for _ in range(count):
            x, y = data.take()
            loss = ddp(x, y)
            if cadence is not None:
                cadence.backward(loss, samples=x.shape[0])
            else:
                loss.backward()
            if sleep:
                time.sleep(sleep)
            loss_sum += loss.item() * x.shape[0]
            taken += x.shape[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / taken)
        samples.append(taken)
        counts.append(count)
        ends.append(time.perf_counter() - start)
        if cadence is not None:
            anchors.append(cadence.last["anchor_ran"])
            syncs.append(cadence.last)
    dist.barrier()
    end = time.perf_counter()
    if cadence is not None:
        cadence.close()
    return {"wall": end - measured_from, "samples": sum(samples) - measured_samples, "losses": losses,
            "step_samples": samples, "counts": counts, "anchors": anchors, "step_ends": ends, "cadence": syncs, "measured_steps": steps - warmup,
            "micro_batches": sum(counts[warmup:]), "seconds_total": end - start,
            "held_out_loss": data.loss(model) if rank == 0 else None}


def rank_main(rank: int, store: str, out: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    data = Data(rank, 512)
    batch_seconds, step_seconds = calibrate(data)
    shared = torch.tensor([batch_seconds, step_seconds], dtype=torch.float64)
    dist.broadcast(shared, src=0)  # both ranks sleep from rank 0's figure: the slowdown is exactly the one asked
    batch_seconds, step_seconds = shared.tolist()
    results = []
    for rep in range(args.reps):
        for slowdown in args.slowdowns:
            order = ("ddp", "elche") if rep % 2 == 0 else ("elche", "ddp")
            for strategy in order:
                # This rank's own micro-batch and optimizer step, timed now (both ranks at once, no collective).
                own_batch, own_step = calibrate(data)
                data.next = 0
                result = segment(strategy, rank, slowdown, batch_seconds, args.steps, args.warmup, data)
                own = own_batch + (batch_seconds * (slowdown - 1) if rank == SLOW_RANK else 0.0)
                busy = result["micro_batches"] * own + result["measured_steps"] * own_step
                result.update({"rep": rep, "slowdown": slowdown, "strategy": strategy, "rank": rank,
                               "idle_seconds": max(0.0, result["wall"] - busy)})
                results.append(result)
    Path(out).write_text(json.dumps({"rank": rank, "batch_seconds": batch_seconds, "step_seconds": step_seconds,
                                     "results": results}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def summarize(per_rank: list[dict], args: argparse.Namespace) -> dict:
    rows = []
    for slowdown in args.slowdowns:
        row: dict = {"slowdown": slowdown}
        for strategy in ("ddp", "elche"):
            runs = [[r for r in rank["results"] if r["slowdown"] == slowdown and r["strategy"] == strategy]
                    for rank in per_rank]
            throughputs, overall = [], []
            for rep in range(args.reps):
                segments = [rank_runs[rep] for rank_runs in runs]
                # Per optimizer step after the warm-up: both ranks' samples over the step's time on rank 0
                # (the ranks leave each sync together); the median over the steps, as every benchmark here.
                ends = segments[0]["step_ends"]
                rates = [sum(s["step_samples"][i] for s in segments) / (ends[i] - ends[i - 1])
                         for i in range(args.warmup, args.steps)]
                throughputs.append(statistics.median(rates))
                overall.append(sum(s["samples"] for s in segments) / max(s["wall"] for s in segments))
            # Per repetition, each step's loss over both ranks' samples (weighted by them).
            curves = [[sum(rank_runs[rep]["losses"][i] * rank_runs[rep]["step_samples"][i] for rank_runs in runs)
                       / sum(rank_runs[rep]["step_samples"][i] for rank_runs in runs) for i in range(args.steps)]
                      for rep in range(args.reps)]
            row[strategy] = {
                "samples_per_second": statistics.median(throughputs),
                "samples_per_second_reps": throughputs,
                "samples_per_second_whole_run_reps": overall,  # all measured samples over the wall time
                "idle_fraction_per_rank": [statistics.median(s["idle_seconds"] / s["wall"] for s in rank_runs)
                                           for rank_runs in runs],
                "micro_batches_per_step_per_rank": [statistics.median(s["micro_batches"] / s["measured_steps"]
                                                                      for s in rank_runs) for rank_runs in runs],
                "held_out_loss": statistics.median(s["held_out_loss"] for s in runs[0]),
                "step_seconds_reps": [segment["step_ends"] for segment in runs[0]],
                "loss_curve_reps": curves,
                "loss_curve": [statistics.fmean(losses) for losses in zip(*curves)],
                "samples_seen": [sum(sum(rank_runs[0]["step_samples"][:i + 1]) for rank_runs in runs)
                                 for i in range(args.steps)],
                "anchors": runs[0][0]["anchors"],
            }
        # The loss each reached in the same wall time: El Che's training loss when DDP finished its steps
        # (each the mean of the 3 steps up to then), the median over the repetitions.
        at_time = {"ddp": [], "elche": []}
        for rep in range(args.reps):
            ddp_end = row["ddp"]["step_seconds_reps"][rep][-1]
            for strategy in ("ddp", "elche"):
                ends = row[strategy]["step_seconds_reps"][rep]
                curve = row[strategy]["loss_curve_reps"][rep]
                last = max([i for i, end in enumerate(ends) if end <= ddp_end * (1 + 1e-9)] or [0])
                at_time[strategy].append(statistics.fmean(curve[max(0, last - 2):last + 1]))
        row["training_loss_at_ddp_wall_time"] = {k: statistics.median(v) for k, v in at_time.items()}
        # Paired per repetition (the two ran back to back), then the median: machine drift cancels.
        ratios = [e / d for e, d in zip(row["elche"]["samples_per_second_reps"], row["ddp"]["samples_per_second_reps"])]
        row["throughput_ratio"] = statistics.median(ratios)
        row["throughput_ratio_reps"] = ratios
        rows.append(row)
    return {"rows": rows}


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    fig, (ax_rate, ax_idle, ax_loss, ax_time) = plt.subplots(1, 4, figsize=(19, 4.2))
    labels = [f"{r['slowdown']:g}x" for r in rows]
    xs = range(len(rows))
    width = 0.38
    for offset, strategy, color in ((-width / 2, "ddp", "tab:gray"), (width / 2, "elche", "tab:green")):
        bars = ax_rate.bar([x + offset for x in xs], [r[strategy]["samples_per_second"] for r in rows], width,
                           label="plain DDP" if strategy == "ddp" else "El Che", color=color)
        if strategy == "elche":
            for bar, row in zip(bars, rows):
                ax_rate.annotate(f"{row['throughput_ratio']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                 ha="center", va="bottom", fontsize=8)
        for rank in range(WORLD):
            ax_idle.bar([x + offset + (rank - 0.5) * width / 2 for x in xs],
                        [100 * r[strategy]["idle_fraction_per_rank"][rank] for r in rows], width / 2, color=color,
                        alpha=1.0 if rank == 0 else 0.55, label=f"{'DDP' if strategy == 'ddp' else 'El Che'} rank {rank}")
    ax_rate.set_xticks(list(xs), labels)
    ax_rate.set_xlabel(f"rank {SLOW_RANK} slowdown")
    ax_rate.set_ylabel("samples/s (both ranks)")
    ax_rate.legend(fontsize=8)
    ax_idle.set_xticks(list(xs), labels)
    ax_idle.set_xlabel(f"rank {SLOW_RANK} slowdown")
    ax_idle.set_ylabel("idle % of wall time")
    ax_idle.legend(fontsize=7)
    for row in rows:
        for strategy, style in (("ddp", "--"), ("elche", "-")):
            ax_loss.plot(row[strategy]["samples_seen"], row[strategy]["loss_curve"], style,
                         label=f"{'DDP' if strategy == 'ddp' else 'El Che'} {row['slowdown']:g}x")
    ax_loss.set_xlabel("samples seen")
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize=7)
    for row in rows:  # the first repetition, against the wall time
        for strategy, style in (("ddp", "--"), ("elche", "-")):
            ax_time.plot(row[strategy]["step_seconds_reps"][0], row[strategy]["loss_curve_reps"][0], style,
                         label=f"{'DDP' if strategy == 'ddp' else 'El Che'} {row['slowdown']:g}x")
    ax_time.set_xlabel("seconds (repetition 1)")
    ax_time.set_ylabel("training loss")
    ax_time.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps or args.reps < 1 or any(s < 1 for s in args.slowdowns):
        parser.error("need --warmup < --steps, --reps >= 1 and every slowdown >= 1")
    if args.rank is not None:
        rank_main(args.rank, args.store, args.rank_out, args)
        return 0
    with tempfile.TemporaryDirectory() as work:
        store = Path(work) / "store"
        outs = [Path(work) / f"rank{rank}.json" for rank in range(WORLD)]
        forwarded = ["--reps", str(args.reps), "--steps", str(args.steps), "--warmup", str(args.warmup),
                     "--slowdowns", *map(str, args.slowdowns)]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        processes = [subprocess.Popen([sys.executable, __file__, *forwarded, "--rank", str(rank), "--store", str(store),
                                       "--rank-out", str(outs[rank])], env=env) for rank in range(WORLD)]
        codes = [p.wait() for p in processes]
        if any(codes):
            print(f"a rank failed: exit codes {codes}", file=sys.stderr)
            return 1
        per_rank = [json.loads(o.read_text()) for o in outs]
    summary = summarize(per_rank, args)
    device = "cpu"
    meta = {
        "device": f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores), {WORLD} gloo ranks of 1 thread",
        "torch": torch.__version__, "model": f"MiniGPT {CONFIG}", "micro_batch": BATCH, "optimizer": f"AdamW lr={LR}",
        "reps": args.reps, "steps": args.steps, "warmup": args.warmup,
        "micro_batch_seconds": per_rank[0]["batch_seconds"], "optimizer_step_seconds": per_rank[0]["step_seconds"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / f"cadence_{device}.json"
    for rank in per_rank:  # each sync's telemetry line stays out of the file: it would be most of it
        for result in rank["results"]:
            result.pop("cadence")
    result_path.write_text(json.dumps({"meta": meta, **summary, "raw": per_rank}, indent=1))
    plot(summary, args.out / f"cadence_{device}.png",
         f"El Che vs plain DDP, rank {SLOW_RANK} slowed; {meta['device']}, torch {meta['torch']}")
    print(f"{'slowdown':>8}  {'DDP samples/s':>14}  {'El Che samples/s':>16}  {'ratio':>6}  {'idle DDP (r0, r1)':>18}  "
          f"{'idle El Che':>14}  {'mb/step El Che':>14}  {'held-out loss DDP / El Che':>26}  {'loss at DDP time':>17}")
    for row in summary["rows"]:
        ddp, elche = row["ddp"], row["elche"]
        print(f"{row['slowdown']:>7g}x  {ddp['samples_per_second']:>14.1f}  {elche['samples_per_second']:>16.1f}  "
              f"{row['throughput_ratio']:>5.2f}x  {', '.join(f'{100 * i:.0f}%' for i in ddp['idle_fraction_per_rank']):>18}  "
              f"{', '.join(f'{100 * i:.0f}%' for i in elche['idle_fraction_per_rank']):>14}  "
              f"{', '.join(f'{m:.1f}' for m in elche['micro_batches_per_step_per_rank']):>14}  "
              f"{ddp['held_out_loss']:>12.3f} / {elche['held_out_loss']:.3f}  "
              f"{row['training_loss_at_ddp_wall_time']['ddp']:>8.3f} / {row['training_loss_at_ddp_wall_time']['elche']:.3f}")
    print(f"wrote {result_path} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
