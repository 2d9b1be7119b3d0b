"""Model-state memory: optimizer state compressed or on the host, parameters offloaded, side by side.

    python benchmarks/model_states.py [--device cpu|cuda] [--models gpt,wide] [--steps 20] [--warmup 3]
        [--chunk-mib 4] [--loss-steps 200] [--dpcs-fractions 0.85,0.7] [--out benchmarks/results]

Per model (the bench's small GPT, a wider GPT: d_model 512; on a GPU `llama`, the GPU-scale benchmark's
transformers Llama of 439M parameters, batch 8 x 2048 tokens; `llama_tiny` is its CPU stand-in for tests)
one training step (forward, loss, backward, optimizer step, zero_grad) under each strategy, each on its own
copy of the model with the same weights. On CUDA the forward runs under `torch.autocast(bfloat16)`, AdamW is
`fused=True` where its parameters are on the device, and dpcs compiles with Inductor:

  stateless      SGD without momentum: no optimizer state (the reference for the optimizer-state part)
  adamw          torch.optim.AdamW, fp32 state on the device
  fp16, int8     CompressedOptimizer(AdamW, states=...): both moments stored compressed on the device
  int8_host      ... int8, on_host=True: the stored state in host memory
  fp32_host      ... fp32, on_host=True: the state in host memory, uncompressed (optimizer offload)
  offload        ParameterOffload on every block + CompressedOptimizer(fp32, on_host): the blocks' parameters
                 and gradients in host memory too, their optimizer step on the host
  offload_overlap ... with overlap=True: the host step on a background thread, overlapped with the next
                 forward (timed as two steps in a row and the wait for the second's host step, halved: the
                 overlap is credited once, never across another strategy's steps)
  torchao_int8   torchao.optim.AdamW8bit, where torchao imports
  dpcs@F         the model through dpcs (final compiler eager) with memory_budget F x adamw's device peak and
                 CompressedOptimizer(states="auto"): dpcs chooses how the state is kept with the activation
                 plan; its budget bounds the whole step, the optimizer step's temporaries included (warmed up
                 at least DPCS_WARMUP steps: the planner measures the first optimizer steps and plans again)

Device peak: what was allocated at the step's start on the device side (parameters, buffers, the input,
optimizer state not in host buffers) plus the step's measured increase (CPU profiler; CUDA allocator). On
CPU, host buffers (pinned memory on a GPU) are the same memory but are kept out of the device figure: they
are allocated once and written in place, so the profiler's increase never contains them. The optimizer-state
part of a peak is its device peak minus the stateless strategy's. Step time: median of `--steps` steps
after `--warmup`, interleaved round-robin; ratios against adamw. On CUDA the allocator's cache is emptied
before each strategy's measured step, and `reserved_increase` is how much the allocator reserved above what
it held then (its segments for that step; other strategies' live segments stay, so this is a lower bound on
the strategy alone). `targets` (CUDA) holds issue 60's: int8 state at most 1.10x AdamW-fused's step with at
least 70% of the state cut, state on the host at most 1.15x with at least 95% cut, and dpcs's choice at 0.7x
of AdamW's peak within its budget.

Numerics (`--loss-steps`): the final loss (mean of the last 10 steps) of a 2-layer GPT trained on a Markov
chain language with fp32 state, int8 state, and torchao's 8-bit AdamW where it imports.
Writes model_states_<device type>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without the package installed
    sys.path.insert(0, str(REPO))
if str(REPO / "benchmarks") not in sys.path:  # its neighbours (gpu_scale), also when loaded from a file
    sys.path.append(str(REPO / "benchmarks"))

from dpcs_compiler.measure import measure_peak_memory, optimizer_state_bytes, resident_bytes  # noqa: E402
from dpcs_compiler.models import (  # noqa: E402
    GPTConfig,
    LlamaLM,
    LlamaSize,
    MiniGPT,
    Workload,
    _identity,
    bench_workload,
    markov_gpt_final_loss,
)
from dpcs_compiler.report import step_records  # noqa: E402
from dpcs_compiler.model_states import CompressedOptimizer, ParameterOffload  # noqa: E402

MiB = 2**20
DPCS_WARMUP = 8  # steps before a dpcs run is measured: first plans, the optimizer step measured, planned again
STRATEGIES = ("stateless", "adamw", "fp16", "int8", "int8_host", "fp32_host", "offload", "offload_overlap",
              "torchao_int8")


def torchao_adamw8bit() -> type | None:
    try:
        from torchao.optim import AdamW8bit
    except Exception:  # not installed, or not for this torch
        return None
    return AdamW8bit


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, which ParameterOffload offloads: a GPT's blocks, a Llama's decoder layers."""
    return list(model.lm.model.layers) if isinstance(model, LlamaLM) else list(model.blocks)


def build(model: torch.nn.Module, strategy: str, chunk_bytes: int) -> tuple[torch.optim.Optimizer, object]:
    """The strategy's optimizer for `model` (and its ParameterOffload, or None)."""
    fused = next(model.parameters()).is_cuda  # the GPU baseline users run; CPU keeps the default

    def adamw(params, *, on_device: bool = True) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if fused and on_device else {}))

    wrap = dict(chunk_bytes=chunk_bytes)
    if strategy == "stateless":
        return torch.optim.SGD(model.parameters(), lr=1e-3), None
    if strategy == "adamw":
        return adamw(model.parameters()), None
    if strategy in ("fp16", "int8"):
        return CompressedOptimizer(adamw(model.parameters()), states=strategy, **wrap), None
    if strategy in ("int8_host", "fp32_host"):
        return CompressedOptimizer(adamw(model.parameters()), states=strategy.split("_")[0], on_host=True, **wrap), None
    if strategy in ("offload", "offload_overlap"):
        offload = ParameterOffload(blocks(model))
        # Not fused: the offloaded blocks step on the host, the rest on the device
        return CompressedOptimizer(adamw(model.parameters(), on_device=False), states="fp32", on_host=True,
                                   offload=offload, overlap=strategy == "offload_overlap", **wrap), offload
    if strategy == "torchao_int8":
        cls = torchao_adamw8bit()
        if cls is None:
            raise RuntimeError("torchao does not import here")
        return cls(model.parameters(), lr=1e-3), None
    raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")


def state_device_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer state bytes on the device side (outside dpcs's host buffers; torchao's subclass unflattened)."""
    if isinstance(optimizer, CompressedOptimizer):
        return optimizer_state_bytes(optimizer)
    tensors = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                inner = getattr(type(value), "__tensor_flatten__", None)
                tensors += [getattr(value, n) for n in inner(value)[0]] if inner else [value]
    return resident_bytes([t for t in tensors if t.dim() > 0])


def host_bytes(optimizer: torch.optim.Optimizer, offload: ParameterOffload | None) -> int:
    held = optimizer.state_bytes()["host"] if isinstance(optimizer, CompressedOptimizer) else 0
    return held + (offload.host_bytes() if offload is not None else 0)


def device_resident(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    live = [t for t in (*model.parameters(), *model.buffers(), *inputs) if t.untyped_storage().nbytes()]
    return resident_bytes(live)


MODELS = ("gpt", "wide", "llama", "llama_tiny")


def workload(name: str, device: torch.device) -> Workload:
    if name == "gpt":
        w = bench_workload("gpt")
    elif name == "wide":
        w = wide_gpt()
    elif name in ("llama", "llama_tiny"):
        w = gpu_scale_llama(tiny=name == "llama_tiny")
    else:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    return Workload(w.name, w.model.to(device), tuple(x.to(device) for x in w.inputs), w.loss_fn)


def measure_model(name: str, strategies: list[str], args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    w = workload(name, device)
    runs: dict[str, dict] = {}

    def measure(strategy: str, model: torch.nn.Module, run: Callable, optimizer, offload, warmup: int) -> dict:
        overlapped = getattr(optimizer, "overlap", False)

        def one() -> None:
            with torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext():
                loss = w.loss_fn(run(*w.inputs))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def step() -> int:
            """Steps taken: an overlapped host step is waited for, after a second step it overlapped."""
            one()
            if not overlapped:
                return 1
            one()
            optimizer.wait()
            return 2

        for _ in range(warmup):
            step()
        baseline = device_resident(model, w.inputs) + state_device_bytes(optimizer)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the strategy's own segments, as far as one process allows
            reserved_before = torch.cuda.memory_reserved(device)
        _, peak = measure_peak_memory(step, device=device)
        measured = {
            "step": step, "device_peak": peak.absolute(baseline), "optimizer_state_device": state_device_bytes(optimizer),
            "host": host_bytes(optimizer, offload), "parameters_device": device_resident(model, ()), "times": [],
        }
        if cuda and peak.reserved_peak_bytes is not None:
            measured["reserved_increase"] = peak.reserved_peak_bytes - reserved_before
        return measured

    for strategy in strategies:
        model = copy.deepcopy(w.model)
        try:
            optimizer, offload = build(model, strategy, args.chunk_mib * MiB)
        except RuntimeError as error:
            runs[strategy] = {"error": str(error)}
            continue
        runs[strategy] = measure(strategy, model, model, optimizer, offload, args.warmup)
    # dpcs's own choice: the model through dpcs with a budget of a fraction of plain AdamW's measured peak, the
    # optimizer's state kept as dpcs's step planner chooses (states="auto"), jointly with the activation plan.
    for fraction in (float(f) for f in args.dpcs_fractions.split(",") if f) if "adamw" in runs else ():
        budget = int(fraction * runs["adamw"]["device_peak"])
        model = copy.deepcopy(w.model)
        optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if cuda else {})),
                                        states="auto", chunk_bytes=args.chunk_mib * MiB)
        compiled = torch.compile(model, backend="dpcs", options={
            "compiler": "inductor" if cuda else "eager", "memory_budget": budget, "on_infeasible": "best"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an infeasible budget warns: recorded below
            run = measure(f"dpcs@{fraction}", model, compiled, optimizer, None, max(args.warmup, DPCS_WARMUP))
        record = step_records()[-1] if step_records() else None
        run["budget"] = budget
        run["chosen"] = (record.optimizer_state or {}).get("format") if record else None
        run["predicted_peak"] = record.predicted_peak_bytes if record else None
        run["peak_phase"] = record.peak_phase if record else None
        run["feasible"] = record.feasible if record else None
        runs[f"dpcs@{fraction}"] = run
    timed = [s for s in runs if "step" in runs[s]]
    for _ in range(args.steps):  # interleaved round-robin
        for strategy in timed:
            start = time.perf_counter()
            taken = runs[strategy]["step"]()
            runs[strategy]["times"].append((time.perf_counter() - start) / taken)
    stateless = runs.get("stateless", {}).get("device_peak")
    plain = runs.get("adamw", {})
    rows = {}
    for strategy, run in runs.items():
        if "error" in run:
            rows[strategy] = run
            continue
        row = {k: run[k] for k in ("device_peak", "reserved_increase", "optimizer_state_device", "host",
                                   "parameters_device", "budget", "chosen", "predicted_peak", "peak_phase",
                                   "feasible") if k in run}
        row["step_seconds"] = statistics.median(run["times"])
        if plain.get("times"):
            row["time_ratio"] = row["step_seconds"] / statistics.median(plain["times"])
        if stateless is not None:
            row["optimizer_state_part"] = row["device_peak"] - stateless
        rows[strategy] = row
    base_part = rows.get("adamw", {}).get("optimizer_state_part")
    for row in rows.values():
        if base_part and "optimizer_state_part" in row:
            row["optimizer_state_cut"] = 1 - row["optimizer_state_part"] / base_part
    result = {"parameters": sum(p.numel() for p in w.model.parameters()), "strategies": rows}
    if cuda:
        result["targets"] = targets(rows)
    return result


def targets(rows: dict[str, dict]) -> dict[str, dict]:
    """Issue 60's targets on a GPU, each with what was measured and whether it holds (None: not measured)."""
    def check(strategy: str, most_time: float, least_cut: float) -> dict:
        row = rows.get(strategy, {})
        ratio, cut = row.get("time_ratio"), row.get("optimizer_state_cut")
        holds = None if ratio is None or cut is None else ratio <= most_time and cut >= least_cut
        return {"strategy": strategy, "time_ratio": ratio, "state_cut": cut, "most_time": most_time,
                "least_cut": least_cut, "holds": holds}

    out = {"int8_state": check("int8", 1.10, 0.70),
           "state_on_host": check("offload_overlap" if "offload_overlap" in rows else "fp32_host", 1.15, 0.95)}
    chosen = rows.get("dpcs@0.7")
    if chosen and "budget" in chosen:
        out["dpcs_choice_at_0.7"] = {"budget": chosen["budget"], "device_peak": chosen["device_peak"],
                                     "chosen": chosen.get("chosen"), "holds": chosen["device_peak"] <= chosen["budget"]}
    return out


def gpu_scale_llama(*, tiny: bool = False) -> Workload:
    """The GPU-scale benchmark's transformers Llama (`benchmarks/gpu_scale.py`: 439M parameters, batch 8 x 2048
    tokens), or a tiny one of the same shape of code for CPU tests. Its forward returns the LM loss."""
    from gpu_scale import Scale  # benchmarks/gpu_scale.py: its model and batch, and its quick stand-in

    scale = Scale.quick() if tiny else Scale()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    size = LlamaSize(vocab=scale.vocab, hidden=scale.hidden, intermediate=scale.intermediate, layers=scale.layers,
                     heads=scale.heads, seq=scale.seq)
    ids = torch.randint(0, size.vocab, (scale.batch, size.seq), generator=generator)
    return Workload("llama_tiny" if tiny else "llama", LlamaLM(size), (ids,), _identity)


def wide_gpt():
    from dpcs_compiler.models import Workload, _identity

    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, block_size=64, d_model=512, heads=8, layers=4)
    idx = torch.randint(0, cfg.vocab, (4, cfg.block_size), generator=generator)
    return Workload("wide", MiniGPT(cfg), (idx, torch.roll(idx, -1, dims=1)), _identity)


def final_losses(steps: int) -> dict[str, float]:
    """Mean of the last 10 losses of a small GPT trained `steps` steps on a Markov language, per optimizer."""
    makers: dict[str, Callable] = {
        "fp32 state (AdamW)": lambda p: torch.optim.AdamW(p, lr=3e-3),
        "int8 state (dpcs)": lambda p: CompressedOptimizer(torch.optim.AdamW(p, lr=3e-3), states="int8"),
    }
    if torchao_adamw8bit() is not None:
        makers["int8 state (torchao AdamW8bit)"] = lambda p: torchao_adamw8bit()(p, lr=3e-3)
    return {name: markov_gpt_final_loss(make, steps) for name, make in makers.items()}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        rows = {s: r for s, r in results["models"][name]["strategies"].items() if "device_peak" in r}
        for strategy, row in rows.items():
            ax.scatter(row["step_seconds"] * 1e3, row["device_peak"] / MiB)
            ax.annotate(strategy, (row["step_seconds"] * 1e3, row["device_peak"] / MiB), fontsize=8,
                        xytext=(4, 2), textcoords="offset points")
        ax.set_xlabel("step time (ms, median)")
        ax.set_ylabel("device peak (MiB)")
        ax.set_title(f"{name} ({results['models'][name]['parameters'] / 1e6:.1f}M parameters)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"model-state strategies: {results['device']}, torch {results['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default="gpt,wide", help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=4, help="CompressedOptimizer chunk_bytes, MiB")
    parser.add_argument("--loss-steps", type=int, default=200)
    parser.add_argument("--dpcs-fractions", default="0.85,0.7",
                        help="dpcs@F: the model through dpcs at a budget of F x plain AdamW's peak, states='auto'")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    device = (f"cuda ({torch.cuda.get_device_name()})" if args.device == "cuda"
              else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    results = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
               "chunk_mib": args.chunk_mib, "models": {}}
    strategies = args.strategies.split(",")
    console = Console()
    for name in args.models.split(","):
        results["models"][name] = measure_model(name, strategies, args)
        table = Table(title=f"{name}: {results['models'][name]['parameters'] / 1e6:.2f}M parameters - {device}")
        for column in ("strategy", "device peak MiB", "opt-state part MiB", "cut vs adamw", "host MiB",
                       "step ms", "x adamw"):
            table.add_column(column, justify="left" if column == "strategy" else "right")
        for strategy, row in results["models"][name]["strategies"].items():
            if "error" in row:
                table.add_row(strategy, row["error"], "", "", "", "", "")
                continue
            if "budget" in row:
                strategy = f"{strategy} ({row['budget'] / MiB:.1f} MiB: {row['chosen']})"
            table.add_row(strategy, f"{row['device_peak'] / MiB:.1f}", f"{row.get('optimizer_state_part', 0) / MiB:.1f}",
                          f"{row['optimizer_state_cut']:.1%}" if "optimizer_state_cut" in row else "",
                          f"{row['host'] / MiB:.1f}", f"{row['step_seconds'] * 1e3:.1f}",
                          f"{row['time_ratio']:.2f}" if "time_ratio" in row else "")
        console.print(table)
    if args.loss_steps:
        results["final_loss"] = {"steps": args.loss_steps, "losses": final_losses(args.loss_steps)}
        fp32 = results["final_loss"]["losses"]["fp32 state (AdamW)"]
        for name, loss in results["final_loss"]["losses"].items():
            console.print(f"final loss after {args.loss_steps} steps, {name}: {loss:.4f} ({loss / fp32 - 1:+.2%})")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"model_states_{args.device}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, path.with_suffix(".png"))
    console.print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
