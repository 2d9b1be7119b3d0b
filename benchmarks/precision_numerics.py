"""The numerics and memory table of dpcs's precision rewrites (issue 4), measured in one process run.

    python benchmarks/precision_numerics.py [--steps 50] [--out benchmarks/results] [--quick]

1. One fp8 linear (M=256, K=512, N=256, randn) against fp32 `F.linear`: SQNR of the output and of each
   gradient, per recipe, gradient format and input dtype.
2. One training step of a 2-layer GPT (d=64, loss in the graph) and of a 2-layer transformers Llama through
   dpcs, against the same step in fp32 eager: relative loss error, gradient SQNR (min and median over
   parameters), and the largest gradient error relative to that gradient's largest value.
3. Loss curves: `--steps` steps of AdamW (lr 3e-3) on 4 fixed batches, fp32 eager against each dtype
   through dpcs (fp16 with torch.amp.GradScaler); the largest and mean relative gap per step.
4. Memory: the same GPT step (batch 8) in fp32, bf16 and bf16 + fp8 through dpcs, predicted against the
   profiler's peak: with the eager compiler (no budget), under Inductor without a budget (the prediction
   follows the partitioned FX graphs), and under Inductor at a 40 MiB budget (where dpcs reads Inductor's
   schedule and holds the plan to it).

The fp8 matmuls run "emulated" (the same math in fp32): on this CPU `_scaled_mm`'s tensorwise path is
~20x slower, and tests/ops/test_fp8.py shows the two agree. Speed of low precision is not measured
on CPU (see benchmarks/precision_speed.py for the GPU). Writes precision_<device>.json and .png.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from dpcs_compiler import clear_compile_records, compile_records
from dpcs_compiler.measure import measure_training_step
from dpcs_compiler.models import GPTConfig, LlamaLM, LlamaSize, MiniGPT, workload
from dpcs_compiler.ops.fp8 import fp8_linear, sqnr_db

GPT = GPTConfig(vocab=128, block_size=32, d_model=64, heads=4, layers=2, dropout=0.0)
FP8 = {"min_size": 16, "matmul": "emulated"}
CONFIGS = {
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "fp8_tensorwise": {"precision": "bf16", "fp8": {**FP8, "recipe": "tensorwise"}},
    "fp8_rowwise": {"precision": "bf16", "fp8": {**FP8, "recipe": "rowwise"}},
    "fp8_tensorwise_e4m3_grads": {"precision": "bf16", "fp8": {**FP8, "grad_dtype": "e4m3"}},
}


def compiled(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": True, **options})


def fp8_linear_table(quick: bool) -> list[dict]:
    m, k, n = (64, 128, 64) if quick else (256, 512, 256)
    rows = []
    generator = torch.Generator().manual_seed(0)
    x0, w0, g0 = (torch.randn(*s, generator=generator) for s in ((m, k), (n, k), (m, n)))
    for recipe in ("tensorwise", "rowwise"):
        for grad_dtype in ("e5m2", "e4m3"):
            for dtype in (torch.float32, torch.bfloat16):
                x, w = x0.to(dtype, copy=True).requires_grad_(), w0.clone().requires_grad_()
                out = fp8_linear(x, w, recipe=recipe, matmul="emulated", grad_dtype=grad_dtype)
                out.backward(g0.to(out.dtype))
                xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                ref = F.linear(xr, wr)
                ref.backward(g0)
                rows.append({
                    "recipe": recipe, "grad_dtype": grad_dtype, "input_dtype": str(dtype).removeprefix("torch."),
                    "out_sqnr_db": sqnr_db(ref, out.float()), "grad_x_sqnr_db": sqnr_db(xr.grad, x.grad.float()),
                    "grad_w_sqnr_db": sqnr_db(wr.grad, w.grad),
                })
    return rows


def llama() -> LlamaLM:
    return LlamaLM(LlamaSize(vocab=128, hidden=64, intermediate=176, layers=2, heads=2, seq=32))


def step_table() -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, GPT.vocab, (4, GPT.block_size), generator=generator)
    torch.manual_seed(0)
    models = {"gpt": (MiniGPT(GPT), (idx, torch.roll(idx, 1, 1))), "llama": (llama(), (idx[:2],))}
    for model_name, (base, inputs) in models.items():
        reference = copy.deepcopy(base)
        ref_loss = reference(*inputs)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for config, options in CONFIGS.items():
            model = copy.deepcopy(base)
            clear_compile_records()
            loss = compiled(model, **options)(*inputs)
            loss.backward()
            sqnr = [sqnr_db(ref_grads[n], p.grad) for n, p in model.named_parameters()]
            worst = max(((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item()
                        for n, p in model.named_parameters())
            (record,) = compile_records()
            rows.append({
                "model": model_name, "config": config, "loss_rel_error": abs(loss.item() / ref_loss.item() - 1),
                "grad_sqnr_min_db": min(sqnr), "grad_sqnr_median_db": statistics.median(sqnr),
                "grad_max_rel_error": worst, "fp8_linears": record.fp8_linears, "cast_ops": record.cast_ops,
            })
    return rows


def loss_curves(steps: int) -> dict:
    torch.manual_seed(0)
    base = MiniGPT(GPT)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, GPT.vocab, (8, GPT.block_size + 1), generator=generator) for _ in range(4)]

    def curve(options):
        model = copy.deepcopy(base)
        run = compiled(model, **options) if options is not None else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scaler = torch.amp.GradScaler("cpu", enabled=bool(options) and options.get("precision") == "fp16")
        losses = []
        for i in range(steps):
            batch = batches[i % len(batches)]
            loss = run(batch[:, :-1], batch[:, 1:])
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        return losses

    reference = curve(None)
    curves = {"fp32_eager": {"losses": reference}}
    for config, options in {"fp32": {"precision": "fp32"}, **CONFIGS}.items():
        losses = curve(options)
        gaps = [abs(a - b) / b for a, b in zip(losses, reference)]
        curves[config] = {"losses": losses, "max_rel_gap": max(gaps), "mean_rel_gap": statistics.fmean(gaps)}
    return curves


def memory_table(quick: bool) -> list[dict]:
    rows = []
    configs = {"fp32": {}, "bf16": {"precision": "bf16"}, "fp8_tensorwise": CONFIGS["fp8_tensorwise"]}
    compilers = [("eager", None)] + ([] if quick else [("inductor", None), ("inductor", "40MiB")])
    for compiler, budget in compilers:
        for config, options in configs.items():
            w = workload("gpt", 8)
            torch._dynamo.reset()
            clear_compile_records()
            model = torch.compile(w.model, backend="dpcs", dynamic=False, options={
                "compiler": compiler, "strict": True, "memory_budget": budget, **options})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = measure_training_step(w.model, model, w.inputs, loss_fn=w.loss_fn, warmup=1, repeats=1)
            rows.append({
                "compiler": compiler, "budget": budget, "config": config,
                "predicted_peak_bytes": result.predicted_peak_bytes, "measured_peak_bytes": result.measured_peak_bytes,
                "relative_error": result.relative_error, "resident_bytes": result.resident_bytes,
            })
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves_ax, gap_ax, memory_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, curve in results["loss_curves"].items():
        curves_ax.plot(curve["losses"], label=name, linewidth=1)
        if "max_rel_gap" in curve:
            reference = results["loss_curves"]["fp32_eager"]["losses"]
            gap_ax.plot([abs(a - b) / b * 100 for a, b in zip(curve["losses"], reference)], label=name, linewidth=1)
    curves_ax.set(title="training loss (2-layer GPT, AdamW)", xlabel="step", ylabel="loss")
    gap_ax.set(title="gap to fp32 eager", xlabel="step", ylabel="|loss - fp32| / fp32 (%)")
    curves_ax.legend(fontsize=7)
    gap_ax.legend(fontsize=7)
    rows = results["memory"]
    labels = [f"{r['config']}\n{r['compiler']}" + (f" @{r['budget']}" if r["budget"] else "") for r in rows]
    positions = range(len(rows))
    memory_ax.bar([p - 0.2 for p in positions], [r["predicted_peak_bytes"] / 2**20 for r in rows], 0.4, label="predicted")
    memory_ax.bar([p + 0.2 for p in positions], [r["measured_peak_bytes"] / 2**20 for r in rows], 0.4, label="measured")
    memory_ax.set_xticks(list(positions), labels, fontsize=6, rotation=30, ha="right")
    memory_ax.set(title="peak memory of one GPT step (batch 8)", ylabel="MiB")
    memory_ax.legend(fontsize=7)
    fig.suptitle(f"dpcs precision numerics - {results['device_name']}, torch {results['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps, no Inductor (tests)")
    args = parser.parse_args(argv)
    steps = min(args.steps, 5) if args.quick else args.steps
    results = {
        "device": "cpu", "device_name": platform.processor() or platform.machine(), "torch": torch.__version__,
        "python": platform.python_version(), "steps": steps,
        "fp8_linear": fp8_linear_table(args.quick),
        "step": step_table(),
        "loss_curves": loss_curves(steps),
        "memory": memory_table(args.quick),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "precision_cpu_quick" if args.quick else "precision_cpu"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / f"{stem}.png")
    print_tables(results)
    return 0


def print_tables(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(title="one fp8 linear against fp32 F.linear (SQNR, dB)")
    for column in ("recipe", "grads", "input", "output", "grad x", "grad w"):
        table.add_column(column)
    for r in results["fp8_linear"]:
        table.add_row(r["recipe"], r["grad_dtype"], r["input_dtype"], *(f"{r[k]:.1f}" for k in (
            "out_sqnr_db", "grad_x_sqnr_db", "grad_w_sqnr_db")))
    console.print(table)
    table = Table(title="one training step through dpcs against fp32 eager")
    for column in ("model", "config", "loss error", "grad SQNR min / median (dB)", "max grad error", "curve gap max / mean"):
        table.add_column(column)
    for r in results["step"]:
        curve = results["loss_curves"].get(r["config"], {}) if r["model"] == "gpt" else {}
        gap = f"{curve['max_rel_gap']:.2%} / {curve['mean_rel_gap']:.2%}" if curve else "-"
        table.add_row(r["model"], r["config"], f"{r['loss_rel_error']:.2e}",
                      f"{r['grad_sqnr_min_db']:.1f} / {r['grad_sqnr_median_db']:.1f}", f"{r['grad_max_rel_error']:.2e}", gap)
    console.print(table)
    table = Table(title="peak memory of one GPT step (batch 8)")
    for column in ("compiler", "budget", "config", "predicted MiB", "measured MiB", "error"):
        table.add_column(column)
    for r in results["memory"]:
        table.add_row(r["compiler"], str(r["budget"]), r["config"], f"{r['predicted_peak_bytes'] / 2**20:.2f}",
                      f"{r['measured_peak_bytes'] / 2**20:.2f}", f"{r['relative_error']:+.2%}")
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
