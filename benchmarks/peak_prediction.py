"""Simulated vs measured peak memory of compiled training steps: the table for issue 2, item 6.

    python benchmarks/peak_prediction.py [--out benchmarks/results]

For MLP and minimal GPT at two batch sizes each, with both final compilers: dpcs's predicted peak of the
step, the peak measured (CPU profiler memory events, or max_memory_allocated on CUDA), the model's own (its
resident bytes plus what the step allocated above the level it began at), and the error, overall and for the part
above the resident parameters and inputs. On CUDA the memory the process held beyond the model when the step
began (cuBLAS's workspaces) is reported apart (`outside_bytes`). Writes JSON and a PNG named after the
device, with the device and torch version inside.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.measure import measure_training_step
from dpcs_compiler.models import workload

CASES = [("mlp", 128), ("mlp", 512), ("gpt", 8), ("gpt", 32)]


def run(device: str) -> list[dict]:
    rows = []
    for compiler in ("eager", "inductor"):
        for name, batch in CASES:
            torch._dynamo.reset()
            w = workload(name, batch)
            model = w.model.to(device)
            inputs = tuple(x.to(device) for x in w.inputs)
            compiled = torch.compile(model, backend="dpcs", options={"compiler": compiler, "strict": True}, dynamic=False)
            m = measure_training_step(model, compiled, inputs, loss_fn=w.loss_fn, device=device, repeats=3)
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "compiler": compiler,
                    "predicted_peak_bytes": m.predicted_peak_bytes,
                    "measured_peak_bytes": m.own_peak_bytes,  # the model's own, as the graph is simulated
                    "resident_bytes": m.resident_bytes,
                    "outside_bytes": m.outside_bytes,  # CUDA: held when the step began beyond the model's own
                    "error": (m.predicted_peak_bytes - m.own_peak_bytes) / m.own_peak_bytes,
                    "error_above_resident": (m.predicted_peak_bytes - m.own_peak_bytes)
                    / (m.own_peak_bytes - m.resident_bytes),
                    "step_seconds": m.step_seconds,
                }
            )
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} b{r['batch']}\n{r['compiler']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar([i - 0.2 for i in x], [r["predicted_peak_bytes"] / 2**20 for r in rows], 0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], [r["measured_peak_bytes"] / 2**20 for r in rows], 0.4, label="measured")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['error'] * 100:+.1f}%", (i, r["measured_peak_bytes"] / 2**20), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("peak MiB")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    rows = run(args.device)
    table = Table(title=f"dpcs simulated vs measured peak - {device_name}, torch {torch.__version__}")
    for column in ("model", "batch", "compiler", "predicted", "measured", "error", "error above resident"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["model"], str(r["batch"]), r["compiler"], format_bytes(r["predicted_peak_bytes"]),
            format_bytes(r["measured_peak_bytes"]), f"{r['error'] * 100:+.2f}%", f"{r['error_above_resident'] * 100:+.2f}%",
        )
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"peak_prediction_{args.device}"
    payload = {"device": device_name, "torch": torch.__version__, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(rows, stem.with_suffix(".png"), f"predicted vs measured peak ({device_name}, torch {torch.__version__})")
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
