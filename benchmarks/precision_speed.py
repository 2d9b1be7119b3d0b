"""Training tokens/s of bf16 against fp8 linears through dpcs, on a Llama-style model (issue target: fp8 >= 1.2x bf16).

    python benchmarks/precision_speed.py [--device cpu|cuda] [--preset small|8b_slice] [--hidden 2048]
        [--intermediate 5632] [--layers 4] [--heads 16] [--kv-heads 16] [--vocab 32000] [--seq 2048] [--batch 4]
        [--steps 20] [--warmup 5] [--strategies bf16,fp8_tensorwise,fp8_rowwise,torchao_tensorwise]
        [--compiler inductor|eager] [--fp8-matmul auto|scaled_mm|emulated] [--fp8-select auto|faster|all]
        [--quick] [--out benchmarks/results]

Presets: `small` (default), the model above; `8b_slice`, two layers of an 8B-class Llama (hidden 4096, FFN
14336, 32 heads, 8 key/value heads, vocabulary 32000), batch 2 x 4096 tokens. Size flags override a preset.

One `dpcs_compiler.models.LlamaLM` (transformers Llama, random weights, fp32 master parameters, forward(ids)
returns the LM loss) is deep-copied per strategy, so every strategy trains the same weights; a step is zero
grads, forward, backward (no optimizer):

  bf16                 dpcs, options {"precision": "bf16"}
  fp8_tensorwise       dpcs, bf16 plus {"fp8": {"recipe": "tensorwise", "min_size": 1024 (16 with --quick),
  fp8_rowwise            "matmul": "auto", "select": --fp8-select}}: eligible linears become torch._scaled_mm
                         with dynamic scaling (with select "auto" on a GPU, those the hardware profile says
                         are faster in fp8 at their shape)
  fp8all_tensorwise    the same with select "all": every eligible linear, whatever its shape
  fp8all_rowwise
  torchao_tensorwise   torchao.float8.convert_to_float8_training with the recipe of that name, torch.compile
  torchao_rowwise        (Inductor), under torch.autocast(bf16); the same linears as dpcs's rule picks (both
                         dims multiples of 16 and >= min_size). Recorded as skipped when torchao is missing.

Each strategy is compiled and warmed up, its peak measured (`dpcs_compiler.measure`: CUDA
max_memory_allocated, or CPU profiler memory events), then all are timed interleaved round-robin
(`bench.py`'s `time_interleaved`, synchronizing CUDA around every step): tokens/s = batch * seq / median
step time, and its ratio to bf16. The dpcs strategies report how many linears went fp8 (compile records);
the torchao ones how many modules torchao converted. A strategy that fails is recorded with its error and
left out of the timing. Writes precision_speed_<device>.json and .png (tokens/s per strategy) under --out
(precision_speed_<device>_8b_slice.* for that preset); `--quick` uses tiny sizes and writes
precision_speed_<device>_quick.*.

On CPU the figures say nothing about speed: bf16 and fp8 matmuls there are far slower than fp32 ones, and
the quick sizes are dominated by overheads. CPU runs only check that the script and the strategies work;
the speed question needs a GPU with fp8 matmuls (sm89 or newer).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without the package installed
    sys.path.insert(0, str(REPO))

from dpcs_compiler.models import LlamaLM, LlamaSize  # noqa: E402
from dpcs_compiler.report import compile_records  # noqa: E402
from dpcs_compiler.options import Fp8Options  # noqa: E402
from dpcs_compiler.types import LinearShape, OpSite  # noqa: E402
from dpcs_compiler.solve.precision import FP8_ALIGNMENT, fp8_eligibility  # noqa: E402


def _load_bench():
    """bench.py, next to this file: its strategy runner, interleaved timing and output helpers."""
    name = "dpcs_benchmarks_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = _load_bench()

MiB = 2**20
STRATEGIES = ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8all_tensorwise", "fp8all_rowwise", "torchao_tensorwise",
              "torchao_rowwise")
DEFAULT_STRATEGIES = ("bf16", "fp8_tensorwise", "fp8_rowwise", "torchao_tensorwise")
FULL_SIZES = {"hidden": 2048, "intermediate": 5632, "layers": 4, "heads": 16, "kv_heads": 16, "vocab": 32000,
              "seq": 2048, "batch": 4, "steps": 20, "warmup": 5}
PRESETS = {
    "small": FULL_SIZES,
    "8b_slice": {"hidden": 4096, "intermediate": 14336, "layers": 2, "heads": 32, "kv_heads": 8, "vocab": 32000,
                 "seq": 4096, "batch": 2, "steps": 10, "warmup": 3},
}
QUICK_SIZES = {"hidden": 64, "intermediate": 176, "layers": 2, "heads": 2, "kv_heads": 2, "vocab": 128, "seq": 32,
               "batch": 2, "steps": 2, "warmup": 1}
FP8_MIN_SIZE, FP8_MIN_SIZE_QUICK = 1024, 16  # torchao's usual threshold; the quick model's linears are tiny
TARGET_RATIO = 1.2  # the target: fp8 tokens/s >= 1.2x bf16
PRECISION_FIELDS = ("graph", "mode", "compiler", "precision", "cast_ops", "fp8_linears", "fp8_matmul", "fp8_select",
                    "fp8_slower", "fallback")


# --- strategies -------------------------------------------------------------------------------------------


def fp8_eligible(module: nn.Module, min_size: int, tokens: int = FP8_ALIGNMENT) -> bool:
    """dpcs's fp8 rule (`solve.precision.fp8_eligibility`) on a module that `tokens` rows go through: given to
    torchao so that both convert the same linears."""
    if not isinstance(module, nn.Linear):
        return False
    site = OpSite("linear", "linear", ("",), LinearShape(module.in_features, module.out_features, tokens))
    return fp8_eligibility(site, Fp8Options(min_size=min_size), kept=None) is None


def dpcs_strategy(name: str, options: dict[str, Any], compiler: str) -> bench.Strategy:
    options = {**options, "compiler": compiler, "strict": True}  # a failing dpcs stage is this strategy's error
    strategy = bench.Strategy(
        name, "dpcs", lambda m: torch.compile(m, backend="dpcs", options=dict(options), dynamic=False), compiled=True
    )
    strategy.result["options"] = options
    return strategy


def torchao_strategy(recipe: str, *, device: torch.device, min_size: int, compiler: str) -> bench.Strategy:
    """torchao's float8 training: convert the eligible linears, torch.compile, run forward under autocast."""
    name = f"torchao_{recipe}"
    backend = bench.StrategyBackend("inductor" if compiler == "inductor" else "aot_eager", name)

    def build(module: nn.Module) -> Callable[..., torch.Tensor]:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(module, config=config,
                                   module_filter_fn=lambda mod, fqn: fp8_eligible(mod, min_size))
        compiled = torch.compile(module, backend=backend, dynamic=False)

        def forward(*inputs: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, torch.bfloat16):
                return compiled(*inputs)

        return forward

    return bench.Strategy(name, "upstream", build, compiled=True)


def build_strategies(names: Sequence[str], *, device: torch.device, fp8_min_size: int, fp8_matmul: str,
                     compiler: str, fp8_select: str = "auto") -> tuple[list[bench.Strategy], dict[str, dict[str, Any]]]:
    """The strategies to run, and those skipped (name -> result with the reason)."""
    strategies, skipped = [], {}
    torchao_missing = _torchao_missing()
    for name in names:
        kind, recipe = name.partition("_")[::2]
        if name == "bf16":
            strategies.append(dpcs_strategy(name, {"precision": "bf16"}, compiler))
        elif kind in ("fp8", "fp8all"):
            select = "all" if kind == "fp8all" else fp8_select
            fp8 = {"recipe": recipe, "min_size": fp8_min_size, "matmul": fp8_matmul, "select": select}
            strategies.append(dpcs_strategy(name, {"precision": "bf16", "fp8": fp8}, compiler))
        elif torchao_missing is not None:
            skipped[name] = {"kind": "upstream", "skipped": torchao_missing, "error": None}
        else:
            strategies.append(torchao_strategy(recipe, device=device, min_size=fp8_min_size, compiler=compiler))
    return strategies, skipped


def _torchao_missing() -> str | None:
    """Why torchao's float8 training cannot run here, or None when it can."""
    try:
        float8 = importlib.import_module("torchao.float8")
    except Exception as error:  # noqa: BLE001 - not installed, or built against another torch
        return f"torchao is not available ({type(error).__name__}: {error})"
    missing = [name for name in ("Float8LinearConfig", "convert_to_float8_training") if not hasattr(float8, name)]
    return f"torchao.float8 has no {', '.join(missing)}" if missing else None


# --- running ----------------------------------------------------------------------------------------------


def prepare(strategy: bench.Strategy, model: nn.Module, ids: torch.Tensor, *, device: torch.device, warmup: int,
            log: Callable[[str], None]) -> None:
    """bench.py's prepare (copy, build, compile, warm up, peak), then the fp8 linears the strategy has."""
    options = strategy.result.get("options")
    bench.prepare_with_retry(strategy, model, (ids,), device=device, warmup=warmup, sgd=False, log=log)
    if options is not None:
        strategy.result["options"] = options
    if strategy.kind == "dpcs":
        # bench records the graphs this attempt compiled; their precision fields are in the compile records
        graphs = {row["graph"] for row in strategy.result.get("records", [])}
        records = [r for r in compile_records() if r.graph in graphs]
        strategy.result["records"] = [{f: getattr(r, f, None) for f in PRECISION_FIELDS} for r in records]
        training = [r for r in records if r.mode == "training"]
        strategy.result["fp8_linears"] = sum(r.fp8_linears for r in training) if training else None
        strategy.result["fp8_slower"] = sum(r.fp8_slower for r in training) if training else None
        strategy.result["cast_ops"] = sum(r.cast_ops for r in training) if training else None
        for key in ("predicted_peak_bytes", "plan_feasible", "recomputed_values", "offloaded_values"):
            strategy.result.pop(key, None)  # memory-plan fields: no memory budget here
        if (options or {}).get("fp8") is not None:
            strategy.result["fp8_matmul"] = next((r.fp8_matmul for r in training), None)
    elif strategy.module is not None:
        strategy.result["fp8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in strategy.module.modules())


def summarize(results: dict[str, dict[str, Any]], tokens_per_step: int) -> None:
    """tokens/s, step ms and the ratio to bf16 for each strategy that was timed."""
    for r in results.values():
        step_s = r.get("step_s")
        r["step_ms"] = step_s * 1e3 if step_s else None
        r["tokens_per_s"] = tokens_per_step / step_s if step_s else None
    reference = results.get("bf16", {}).get("tokens_per_s")
    for name, r in results.items():
        r["ratio_vs_bf16"] = r["tokens_per_s"] / reference if r.get("tokens_per_s") and reference else None
        if "fp8" in name:
            r["meets_target"] = None if r["ratio_vs_bf16"] is None else r["ratio_vs_bf16"] >= TARGET_RATIO


# --- output -----------------------------------------------------------------------------------------------


def print_table(payload: dict[str, Any], console) -> None:
    from rich.table import Table

    s = payload["sizes"]
    table = Table(title=f"Llama {s['layers']}x{s['hidden']} (ffn {s['intermediate']}, vocab {s['vocab']}), "
                        f"batch {s['batch']} x seq {s['seq']} - {payload['device']}, torch {payload['torch']}, "
                        f"compiler {payload['compiler']}")
    for column in ("strategy", "tokens/s", "step ms", "vs bf16", "peak MiB", "fp8 linears", "note"):
        table.add_column(column, justify="left" if column in ("strategy", "note") else "right", overflow="fold")
    for name, r in payload["strategies"].items():
        note = r.get("skipped") or r.get("error") or ""
        if r.get("meets_target") is not None:
            note = f"{r.get('fp8_matmul')}; target >= {TARGET_RATIO}x: " + ("holds" if r["meets_target"] else "fails")
        fp8 = r.get("fp8_linears")
        table.add_row(
            name,
            "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}",
            "-" if r.get("step_ms") is None else f"{r['step_ms']:.1f}",
            "-" if r.get("ratio_vs_bf16") is None else f"{r['ratio_vs_bf16']:.2f}x",
            "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / MiB:.1f}",
            "-" if fp8 is None else f"{fp8}/{payload['linears']}",
            note[:160] + ("..." if len(note) > 160 else ""),
        )
    console.print(table)
    if payload["device_type"] == "cpu":
        console.print("CPU: bf16 and fp8 matmuls are far slower than fp32 here; these figures only show that the "
                      "strategies run", style="yellow", highlight=False)


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {n: r for n, r in payload["strategies"].items() if r.get("tokens_per_s")}
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(payload["strategies"]) + 2), 4.5))
    colors = ["tab:blue" if n == "bf16" else "tab:red" if n.startswith("fp8") else "tab:gray" for n in ran]
    bars = ax.bar(list(ran), [r["tokens_per_s"] for r in ran.values()], color=colors, zorder=3)
    for bar, r in zip(bars, ran.values()):
        label = f"{r['tokens_per_s']:,.0f}" + (f"\n{r['ratio_vs_bf16']:.2f}x" if r.get("ratio_vs_bf16") else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, textcoords="offset points", xytext=(0, 2))
    reference = payload["strategies"].get("bf16", {}).get("tokens_per_s")
    if reference:
        ax.axhline(reference * TARGET_RATIO, color="tab:green", linestyle="--", linewidth=1,
                   label=f"target: {TARGET_RATIO}x bf16")
        ax.legend(fontsize=8, loc="upper right")
    left_out = [f"{n}: {'skipped' if r.get('skipped') else 'failed'}" for n, r in payload["strategies"].items()
                if n not in ran]
    if left_out:
        fig.text(0.01, 0.01, "not run: " + "; ".join(left_out), fontsize=7, va="bottom", wrap=True)
    if not ran:
        ax.text(0.5, 0.5, "no strategy ran", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("training tokens/s (higher is better)")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    s = payload["sizes"]
    ax.set_title(f"Llama {s['layers']}x{s['hidden']}, {s['batch']}x{s['seq']} tokens - {payload['device']}\n"
                 f"torch {payload['torch']}, compiler {payload['compiler']}", fontsize=9)
    ax.margins(y=0.15)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- entry point ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precision_speed",
        description="Training tokens/s of bf16 against fp8 linears (dpcs and torchao) on a Llama-style model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__[__doc__.index("One `dpcs"):],
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="small",
                        help="model sizes (default small); size flags override them")
    for key, value in FULL_SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=None,
                            help=f"default {value} (small); {QUICK_SIZES[key]} with --quick")
    parser.add_argument("--strategies", type=bench._csv(str), default=list(DEFAULT_STRATEGIES),
                        help=f"comma-separated, from {','.join(STRATEGIES)} (default: {','.join(DEFAULT_STRATEGIES)})")
    parser.add_argument("--compiler", choices=("inductor", "eager"), default="inductor",
                        help="inductor (default), or eager: dpcs option compiler='eager', aot_eager for torchao")
    parser.add_argument("--fp8-matmul", choices=("auto", "scaled_mm", "emulated"), default="auto",
                        help="dpcs option fp8.matmul (default auto: torch._scaled_mm where the device runs it)")
    parser.add_argument("--fp8-select", choices=("auto", "faster", "all"), default="auto",
                        help="dpcs option fp8.select (default auto: the linears the profile says are faster in fp8 "
                             "where the matmuls are real fp8; all: every eligible linear)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = QUICK_SIZES if args.quick else PRESETS[args.preset]
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    for name in args.strategies:
        if name not in STRATEGIES:
            parser.error(f"unknown strategy {name!r}; valid choices: {', '.join(STRATEGIES)}")
    if len(set(args.strategies)) != len(args.strategies):
        parser.error(f"--strategies names a strategy twice: {','.join(args.strategies)}")
    if any(value < 1 for value in sizes.values()):
        parser.error("sizes, --steps and --warmup must be >= 1")
    if sizes["hidden"] % sizes["heads"]:
        parser.error(f"--hidden {sizes['hidden']} is not a multiple of --heads {sizes['heads']}")
    if sizes["heads"] % sizes["kv_heads"]:
        parser.error(f"--heads {sizes['heads']} is not a multiple of --kv-heads {sizes['kv_heads']}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    device = torch.device(args.device)
    log = lambda text: console.print(text, style="dim", highlight=False, markup=False)  # noqa: E731
    fp8_min_size = FP8_MIN_SIZE_QUICK if args.quick else FP8_MIN_SIZE

    torch.manual_seed(0)
    size = LlamaSize(vocab=sizes["vocab"], hidden=sizes["hidden"], intermediate=sizes["intermediate"],
                     layers=sizes["layers"], heads=sizes["heads"], seq=sizes["seq"], kv_heads=sizes["kv_heads"])
    model = LlamaLM(size).to(device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size.vocab, (sizes["batch"], size.seq), generator=generator).to(device)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    payload: dict[str, Any] = {
        "device": bench.device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "transformers": bench._version("transformers"),
        "torchao": bench._version("torchao"),
        "python": platform.python_version(),
        "compiler": args.compiler,
        "quick": args.quick,
        "preset": None if args.quick else args.preset,
        "sizes": sizes,
        "tokens_per_step": sizes["batch"] * sizes["seq"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "linears": len(linears),
        "fp8": {"min_size": fp8_min_size, "matmul": args.fp8_matmul, "select": args.fp8_select,
                "eligible_linears": sum(fp8_eligible(m, fp8_min_size) for m in model.modules())},
        "target_ratio_vs_bf16": TARGET_RATIO,
        "speed_meaningful": device.type == "cuda",
        "strategies": {},
        "load_average_before": bench._load_average(),
    }
    load = payload["load_average_before"]
    if device.type == "cpu" and load is not None and load > (os.cpu_count() or 1):
        log(f"warning: the 1-minute load average is {load:.1f} on {os.cpu_count()} CPUs: "
            "other processes compete for the CPU and step times will be noisy")
    strategies, skipped = build_strategies(args.strategies, device=device, fp8_min_size=fp8_min_size,
                                           fp8_matmul=args.fp8_matmul, compiler=args.compiler,
                                           fp8_select=args.fp8_select)
    for name, reason in skipped.items():
        log(f"{name}: skipped: {reason['skipped']}")
    torch._dynamo.reset()
    with bench.compile_afresh():
        for s in strategies:
            log(f"{s.name}: compiling / warming up")
            prepare(s, model, ids, device=device, warmup=sizes["warmup"], log=log)
            if s.result.get("error"):
                log(f"{s.name}: {s.result['error'][:300]}")
        log(f"timing {sum(s.ok for s in strategies)} strategies interleaved, {sizes['steps']} steps each")
        bench.time_interleaved(strategies, steps=sizes["steps"], warmup=sizes["warmup"], device=device)
    for s in strategies:
        s.module = s.step = None  # free the copies
    torch._dynamo.reset()
    results = {name: {} for name in args.strategies}  # in the order asked for
    results.update({s.name: s.result for s in strategies}, **skipped)
    summarize(results, payload["tokens_per_step"])
    payload["strategies"] = results
    payload["load_average_after"] = bench._load_average()

    print_table(payload, console)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"precision_speed_{device.type}" + ("_quick" if args.quick else "")
                       + ("_8b_slice" if not args.quick and args.preset == "8b_slice" else ""))
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=_plain) + "\n")
    plot(payload, stem.with_suffix(".png"))
    console.print(f"wrote {stem}.json and {stem}.png", highlight=False, markup=False)
    return 0


def _plain(value: Any) -> Any:
    """JSON for what the results hold besides plain values (dataclasses, paths)."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
