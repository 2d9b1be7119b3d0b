"""How long a checkpoint stalls training: a synchronous and an asynchronous `dpcs_compiler.checkpoint.save`
against the training step, on the bench's small GPT with AdamW (single process).

    python benchmarks/checkpoint_stall.py [--device cpu|cuda] [--rounds 7] [--steps 3] [--out benchmarks/results]

Per round, interleaved: `--steps` plain training steps (timed), then one step followed by a synchronous save
(the save timed: the step stalls for all of it), then one step followed by an asynchronous save (timed until
`save` returns: the tensors copied out into the host copies kept from the last asynchronous save), `--steps`
steps while its files are written in the background (timed: they share the CPU with the writer), its commit
(`checkpoint.wait()`: what is left of the writing, the manifest and the rename), and one step followed by an
asynchronous save whose host copies are made afresh (`checkpoint.release_staging()` first, untimed: as every
save staged before they were kept), committed untimed. Medians over the rounds after a warm-up round; stalls reported as multiples of the
step time. On CUDA every timed region ends with `torch.cuda.synchronize()`, so a step's time is its kernels'
and an asynchronous save's stall includes the copy to pinned host memory it started.
Writes checkpoint_stall_<device>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without the package installed
    sys.path.insert(0, str(REPO))

from dpcs_compiler import checkpoint  # noqa: E402
from dpcs_compiler.models import bench_workload  # noqa: E402


def measure(rounds: int, steps: int, directory: Path, device: torch.device) -> dict:
    w = bench_workload("gpt")
    model = w.model.to(device)
    inputs = tuple(x.to(device) for x in w.inputs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        w.loss_fn(model(*inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"step": [], "sync_save": [], "async_save": [], "step_while_writing": [],
                                     "async_commit": [], "async_save_fresh_copies": []}
    saved = 0
    for round_ in range(rounds + 1):  # the first is a warm-up
        step_times = [timed(step) for _ in range(steps)]
        step()
        saved += 1
        sync = timed(lambda: checkpoint.save(directory, saved, model=model, optimizer=optimizer, keep=2))
        step()
        saved += 1
        asynchronous = timed(lambda: checkpoint.save(directory, saved, model=model, optimizer=optimizer, keep=2,
                                                     asynchronous=True))
        during = [timed(step) for _ in range(steps)]
        commit = timed(checkpoint.wait)
        step()
        saved += 1
        checkpoint.release_staging()
        fresh = timed(lambda: checkpoint.save(directory, saved, model=model, optimizer=optimizer, keep=2,
                                              asynchronous=True))
        checkpoint.wait()
        if round_ == 0:
            continue
        times["step"].extend(step_times)
        times["step_while_writing"].extend(during)
        times["sync_save"].append(sync)
        times["async_save"].append(asynchronous)
        times["async_commit"].append(commit)
        times["async_save_fresh_copies"].append(fresh)
    medians = {k: statistics.median(v) for k, v in times.items()}
    checkpoint_bytes = sum(p.stat().st_size for p in checkpoint.latest(directory).rglob("*") if p.is_file())
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": checkpoint_bytes,
        "seconds": times,
        "median_seconds": medians,
        "stall_in_steps": {k: medians[k] / medians["step"]
                           for k in ("sync_save", "async_save", "async_commit", "async_save_fresh_copies")},
        "async_save_over_fresh_copies": medians["async_save"] / medians["async_save_fresh_copies"],
        "step_while_writing_ratio": medians["step_while_writing"] / medians["step"],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = results["median_seconds"]
    names = ["step", "sync_save", "async_save_fresh_copies", "async_save", "step_while_writing", "async_commit"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [medians[n] * 1e3 for n in names], color=["gray", "tab:red", "tab:cyan", "tab:green", "tab:olive", "tab:blue"])
    ax.tick_params(axis="x", labelsize=8)
    for i, n in enumerate(names):
        ax.annotate(f"{medians[n] * 1e3:.1f} ms", (i, medians[n] * 1e3), ha="center", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"checkpoint stall, small GPT ({results['checkpoint_bytes'] / 2**20:.1f} MiB checkpoint)\n"
                 f"{results['device']}, torch {results['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.device == "cuda":
        device = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        device = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    with tempfile.TemporaryDirectory() as directory:
        results = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                   **measure(args.rounds, args.steps, Path(directory), torch.device(args.device))}
    medians, stall = results["median_seconds"], results["stall_in_steps"]
    print(f"small GPT, {results['parameters'] / 1e6:.2f}M parameters, checkpoint "
          f"{results['checkpoint_bytes'] / 2**20:.1f} MiB, {device}: step {medians['step'] * 1e3:.1f} ms; "
          f"synchronous save {medians['sync_save'] * 1e3:.1f} ms ({stall['sync_save']:.2f} steps); asynchronous "
          f"save returns in {medians['async_save'] * 1e3:.1f} ms ({stall['async_save']:.2f} steps; "
          f"{results['async_save_over_fresh_copies']:.2f}x one making its host copies afresh, "
          f"{medians['async_save_fresh_copies'] * 1e3:.1f} ms), steps while it "
          f"writes {results['step_while_writing_ratio']:.2f}x, its commit {medians['async_commit'] * 1e3:.1f} ms "
          f"({stall['async_commit']:.2f} steps)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"checkpoint_stall_{args.device}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
