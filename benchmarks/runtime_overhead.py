"""The Runtime's overhead per training step on the main job's small GPT (issue goal: < 1% of the step).

    python benchmarks/runtime_overhead.py [--device cpu|cuda] [--batch 8] [--layers 2] [--compiler inductor|eager]
        [--configs 1:1,10:1,50:1,10:4] [--pairs 200] [--warmup 5] [--curvature-iterations 8] [--out benchmarks/results]

The GPT is compiled once through dpcs; a training step is zero grads, forward, backward, AdamW step. For each
configuration N:G (`signal_every` N, `grad_norm_every` G) a Runtime (default policies, no telemetry) is
bound to the model and steps run in pairs,
interleaved: one step followed by `rt.step(loss=..., optimizer=...)`, one without. Reported per N, medians
after warm-up: the step time with and without the runtime and their ratio (noisy: the difference is small
against the step's own variation), and the time `rt.step` itself takes on the host (precise; on a GPU its
device work is queued, not waited for), as a fraction of the step. The default `signal_every` is chosen from
these figures. The optional curvature probe (`CurvatureProbe`, power iteration on Hessian-vector products of
the uncompiled model) is timed too: seconds per probe and how many steps one probe costs.
Writes runtime_overhead_<device>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without the package installed
    sys.path.insert(0, str(REPO))

from dpcs_compiler import Runtime  # noqa: E402
from dpcs_compiler.models import workload  # noqa: E402
from dpcs_compiler.runtime import CurvatureProbe  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--compiler", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--configs", default="1:1,10:1,50:1,10:4", help="signal_every:grad_norm_every, comma-separated")
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--curvature-iterations", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    device = args.device
    w = workload("gpt", args.batch, layers=args.layers)
    model = w.model.to(device)
    inputs = tuple(x.to(device) for x in w.inputs)
    compiled = torch.compile(model, backend="dpcs", options={"compiler": args.compiler})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(*inputs)
        loss.backward()
        optimizer.step()
        return loss

    results = []
    for config in args.configs.split(","):
        interval, grad_every = (int(n) for n in config.split(":"))
        runtime = Runtime(model, signal_every=interval, grad_norm_every=grad_every)
        with_rt, without_rt, rt_host = [], [], []
        for i in range(args.warmup + args.pairs):
            for use_runtime in (True, False) if i % 2 == 0 else (False, True):
                sync(device)
                start = time.perf_counter()
                loss = train_step()
                if use_runtime:
                    rt_start = time.perf_counter()
                    runtime.step(loss=loss, optimizer=optimizer)
                    rt_seconds = time.perf_counter() - rt_start
                sync(device)
                seconds = time.perf_counter() - start
                if i >= args.warmup:
                    (with_rt if use_runtime else without_rt).append(seconds)
                    if use_runtime:
                        rt_host.append(rt_seconds)
        runtime.close()
        step = statistics.median(without_rt)
        row = {
            "signal_every": interval,
            "grad_norm_every": grad_every,
            "step_seconds_without": step,
            "step_seconds_with": statistics.median(with_rt),
            "with_over_without": statistics.median(with_rt) / step,
            "runtime_step_host_seconds": statistics.median(rt_host),
            "runtime_step_mean_seconds": statistics.fmean(rt_host),
            "runtime_fraction_of_step": statistics.fmean(rt_host) / step,
            "pairs": args.pairs,
        }
        results.append(row)
        print(f"signal_every={interval:3d} grad_norm_every={grad_every}: step {step * 1e3:.2f} ms without, {row['step_seconds_with'] * 1e3:.2f} ms with "
              f"({row['with_over_without']:.4f}x); rt.step {row['runtime_step_mean_seconds'] * 1e6:.0f} us mean = "
              f"{row['runtime_fraction_of_step']:.3%} of the step")

    probe = CurvatureProbe(lambda: model(*inputs), model.parameters(), every=1, iterations=args.curvature_iterations)
    probe_seconds = []
    for i in range(3):
        sync(device)
        start = time.perf_counter()
        probe.probe(i)
        sync(device)
        probe_seconds.append(time.perf_counter() - start)
    step = results[0]["step_seconds_without"]
    curvature = {"iterations": args.curvature_iterations, "seconds_per_probe": statistics.median(probe_seconds),
                 "steps_per_probe": statistics.median(probe_seconds) / step, "eigenvalue": probe.last}
    print(f"curvature probe ({args.curvature_iterations} iterations): {curvature['seconds_per_probe']:.3f} s per probe = "
          f"{curvature['steps_per_probe']:.1f} steps; every 100 steps: {curvature['steps_per_probe'] / 100:.1%} of the run")
    summary = {
        "device": device if device != "cpu" else f"cpu ({platform.processor() or platform.machine()}, "
                                                 f"{torch.get_num_threads()} threads)",
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "torch": torch.__version__, "compiler": args.compiler, "batch": args.batch, "layers": args.layers,
        "intervals": results, "curvature_probe": curvature,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"runtime_overhead_{'cuda' if device.startswith('cuda') else 'cpu'}"
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and .png")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["intervals"]
    labels = [f"read every {r['signal_every']}\nnorms every {r['grad_norm_every']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, [100 * r["runtime_fraction_of_step"] for r in rows], label="rt.step host time / step")
    ax.plot(labels, [100 * (r["with_over_without"] - 1) for r in rows], "o", color="tab:red",
            label="step time with / without - 1 (interleaved medians)")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="goal: 1%")
    ax.set_ylabel("% of a training step")
    ax.set_xlabel("signal_every / grad_norm_every (steps)")
    ax.set_title(f"dpcs Runtime overhead, MiniGPT batch {summary['batch']}, {summary['device']}, torch {summary['torch']}",
                 fontsize=9)
    values = [100 * r["runtime_fraction_of_step"] for r in rows] + [100 * (r["with_over_without"] - 1) for r in rows] + [1.0]
    ax.set_ylim(min(0.0, min(values) * 1.3), max(values) * 1.8)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
