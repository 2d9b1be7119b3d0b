"""The `dpcs` command: run a training script with dumps on, and summarise dump folders.

    dpcs dump [--out DIR] SCRIPT.py [ARGS ...]   run SCRIPT.py as __main__ with DPCS_DUMP_DIR=DIR, then summarise
    dpcs show DIR                                 summarise every graph folder under DIR
    dpcs bench [ARGS ...]                         benchmark dpcs against eager/torch.compile (benchmarks/bench.py)
    dpcs hardware [--device D] [--profile P] [--refresh] [--json]
                                                  the hardware profile plans are costed with, and where it came from
    dpcs plot TELEMETRY.jsonl [-o OUT.png]        draw a Runtime's telemetry: precision, budget, peak, headroom, cadence
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import shlex
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dpcs_compiler.cost.op_time import offload_ops_seconds
from dpcs_compiler.cost.profiles import BUILTIN_PROFILES
from dpcs_compiler.debug import progress
from dpcs_compiler.debug.dump import SUMMARY_FILE
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.debug.summary import (
    graph_folders,
    hardware_lines,
    load_summaries,
    pass_table,
    problems,
    summary_table,
)
from dpcs_compiler.options import DUMP_DIR_ENV, HARDWARE_PROFILE_ENV
from dpcs_compiler.report import STEPS_FILE, describe_step

log = logging.getLogger("dpcs.cli")

DEFAULT_DUMP_DIR = "dpcs_dump"
EXIT_USAGE = 2  # like argparse: bad arguments, nothing to show
_WIDE = 240  # columns when stdout is not a terminal, so piped tables keep whole rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpcs",
        description="Inspect what the dpcs torch.compile backend does to your model's graphs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
example:
  dpcs dump --out dumps train.py --epochs 1    # train.py sees sys.argv == ["train.py", "--epochs", "1"]
  dpcs show dumps

Each graph compiled with backend="dpcs" gets a folder graph_NNN/ holding, numbered in the order they
were written: the Dynamo graph, the joint graph, simulated memory timelines (.txt table and .png
plot), the plan, the final forward/backward graphs, before/after graphs of every rewrite; and
summary.json. Without this command, set DPCS_DUMP_DIR (or the backend option dump_dir) to dump.""",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log dpcs progress (-vv: debug)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dump = commands.add_parser(
        "dump",
        help="run a script with dumps on, then summarise the graphs it compiled",
        description=(
            "Run SCRIPT.py in this process as __main__ (sys.argv = [SCRIPT.py, *ARGS], its folder first on "
            "sys.path) with DPCS_DUMP_DIR=DIR, so every graph it compiles with backend='dpcs' is dumped under "
            "DIR; then print where the dumps are and their summary. Everything after SCRIPT.py goes to the "
            "script. Exits with the script's exit status. A dump_dir passed in the script's backend options "
            "takes precedence over --out."
        ),
        usage="dpcs dump [-h] [--out DIR] SCRIPT.py [ARGS ...]",
    )
    dump.add_argument(
        "--out", metavar="DIR", type=Path, default=Path(DEFAULT_DUMP_DIR),
        help=f"dump folder (default: ./{DEFAULT_DUMP_DIR}); earlier dumps in it are kept",
    )
    dump.add_argument("script_and_args", nargs=argparse.REMAINDER, metavar="SCRIPT.py [ARGS ...]",
                      help="the script to run and its own arguments")
    dump.set_defaults(run=_dump_command, command_parser=dump)

    show = commands.add_parser(
        "show",
        help="summarise the graph folders under a dump folder",
        description=(
            "Print one row per graph folder found under DIR (at any depth): mode, final compiler, node counts "
            "of the Dynamo / joint / forward / backward graphs, bytes saved for backward, the simulated peak "
            "and the node where it occurs, dpcs pass time and whether the graph fell back to plain Inductor; "
            "then the time per pass summed over the graphs."
        ),
    )
    show.add_argument("dir", metavar="DIR", type=Path, help="a folder written by `dpcs dump` or DPCS_DUMP_DIR")
    show.set_defaults(run=_show_command, command_parser=show)

    bench = commands.add_parser(
        "bench",
        help="benchmark dpcs's memory planner against eager, checkpointing and torch.compile",
        description=(
            "Run benchmarks/bench.py of the dpcs source checkout this package lives in, with ARGS "
            "(`dpcs bench --help` lists them): peak memory and step time of each model under each strategy, "
            "written as JSON, a table and a Pareto plot under benchmarks/results/."
        ),
        usage="dpcs bench [ARGS ...]",
        add_help=False,  # --help goes to the benchmark's own parser
    )
    bench.set_defaults(run=_bench_command, command_parser=bench)

    hardware = commands.add_parser(
        "hardware",
        help="print the hardware profile plans are costed with, and where it came from",
        description=(
            "Print the hardware profile dpcs plans with on this machine: the --profile given, else "
            f"{HARDWARE_PROFILE_ENV}, else the device's measured profile (measured once and cached under "
            "$DPCS_CACHE_DIR/hardware, default ~/.cache/dpcs/hardware). It says where the profile came from "
            "(measured when and cached where, built-in, or a file) and its short hash, which compile records "
            "and dumps name too."
        ),
        epilog=(
            "built-in profiles: " + ", ".join(f"{name} ({description})" for name, (description, _) in BUILTIN_PROFILES.items())
            + ". `dpcs hardware --json > profile.json` writes a profile file to pin with "
            f"options={{'hardware_profile': 'profile.json'}} or {HARDWARE_PROFILE_ENV}=profile.json."
        ),
    )
    hardware.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    hardware.add_argument("--profile", default=None, metavar="P",
                          help=f"'measure', a built-in name or a profile JSON file (default: ${HARDWARE_PROFILE_ENV} or 'measure')")
    hardware.add_argument("--refresh", action="store_true", help="measure the device again and overwrite its cache")
    hardware.add_argument("--json", action="store_true",
                          help="print the profile as JSON (a profile file); where it came from goes to stderr")
    hardware.set_defaults(run=_hardware_command, command_parser=hardware)

    plot = commands.add_parser(
        "plot",
        help="draw a Runtime's telemetry file",
        description=(
            "Draw the telemetry a dpcs Runtime wrote (Runtime(..., telemetry=PATH)): the precision mode, the "
            "memory budget, the measured peak and the memory headroom over the steps, with every variant "
            "compile (and its time) and every decision change marked; with a Cadence writing to it, the "
            "micro-batches each rank ran per sync, the anchor and the sync's overhead."
        ),
    )
    plot.add_argument("telemetry", metavar="TELEMETRY.jsonl", type=Path, help="the runtime's telemetry file")
    plot.add_argument("-o", "--out", type=Path, default=None, help="PNG to write (default: TELEMETRY.png beside it)")
    plot.set_defaults(run=_plot_command, command_parser=plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dpcs` console script; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra  # every argument after `bench` belongs to the benchmark's own parser
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging(args.verbose)
    out = Console(file=sys.stdout, width=None if sys.stdout.isatty() else _WIDE)
    err = Console(file=sys.stderr, width=None if sys.stderr.isatty() else _WIDE)
    return args.run(args, args.command_parser, out, err)


def _configure_logging(verbosity: int) -> None:
    if verbosity <= 0:
        return
    logger = logging.getLogger("dpcs")
    logger.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)
    if not any(getattr(h, "_dpcs_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        handler._dpcs_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def _show_command(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Console, err: Console) -> int:
    root: Path = args.dir
    if not root.is_dir():
        err.print(f"dpcs show: error: {root} is not a folder" + ("" if root.exists() else " (it does not exist)"),
                  markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    summaries = load_summaries(root)
    if not summaries:
        err.print(
            f"dpcs show: error: no graph folders under {root} (a graph folder holds {SUMMARY_FILE}; "
            f"write some with `dpcs dump --out {root} SCRIPT.py`)",
            markup=False, highlight=False, soft_wrap=True,
        )
        return EXIT_USAGE
    print_summary(summaries, root, out)
    return 0


def print_summary(summaries: Sequence[dict], root: Path, out: Console) -> None:
    out.print(summary_table(summaries, root))
    steps = root / STEPS_FILE
    if steps.is_file():  # the step plans of several graphs (graph breaks, DDP buckets): the latest one
        lines = [line for line in steps.read_text().splitlines() if line.strip()]
        if lines:
            out.print(f"{len(lines)} step plan(s); the latest: {describe_step(json.loads(lines[-1]))}",
                      markup=False, highlight=False, soft_wrap=True)
    for line in hardware_lines(summaries, root):
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    out.print(pass_table(summaries))
    for line in problems(summaries, root):
        out.print(f"[red]fallback or incomplete[/red] {line}", highlight=False)


def _dump_command(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Console, err: Console) -> int:
    command = list(args.script_and_args)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("the following arguments are required: SCRIPT.py")
    script, script_args = Path(command[0]), command[1:]
    if not script.is_file():
        err.print(f"dpcs dump: error: no script at {script}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    root = args.out.resolve()
    earlier = set(graph_folders(root))
    log.info("running %s with %s=%s", shlex.join([str(script), *script_args]), DUMP_DIR_ENV, root)
    with progress.task(f"dpcs dump {script}") as dump_progress:
        dump_progress.detail("running the script")
        status = run_script(script, script_args, dump_dir=root)

    summaries = [s for s in load_summaries(root) if Path(s["folder"]) not in earlier]
    ending = f"; {script} exited with status {status}" if status else ""
    if not summaries:
        err.print(
            f"dpcs dump: no graphs were dumped under {root}{ending} (did the script call "
            "torch.compile(..., backend='dpcs') and run the compiled model?)",
            markup=False, highlight=False, soft_wrap=True,
        )
        return status
    out.print(f"dpcs dump: {len(summaries)} graph folder(s) under {root}{ending}", markup=False, highlight=False, soft_wrap=True)
    for summary in summaries:
        out.print(f"  {summary['folder']}", markup=False, highlight=False, soft_wrap=True)
    if earlier:
        out.print(f"  ({len(earlier)} earlier graph folder(s) there not shown; `dpcs show {root}` lists all)",
                  markup=False, highlight=False, soft_wrap=True)
    print_summary(summaries, root, out)
    return status


def _hardware_command(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Console, err: Console) -> int:
    import torch

    from dpcs_compiler.cost.hardware import profile_to_json
    from dpcs_compiler.cost.profiles import MEASURE, parse_profile_spec, resolve_profile
    from dpcs_compiler.ops import offload_ops  # noqa: F401  (times its ops in a CUDA profile measured here)

    if args.profile is not None:
        value, source = args.profile, "--profile"
    elif os.environ.get(HARDWARE_PROFILE_ENV):
        value, source = os.environ[HARDWARE_PROFILE_ENV], HARDWARE_PROFILE_ENV
    else:
        value, source = MEASURE, "--profile"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        spec = parse_profile_spec(value, source=source)
        resolved = resolve_profile(spec, device, refresh=args.refresh)
    except ValueError as error:
        err.print(f"dpcs hardware: error: {error}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    if args.json:
        print(profile_to_json(resolved.profile))
        err.print(f"{resolved.profile.device_key}: {resolved.describe()}", markup=False, highlight=False, soft_wrap=True)
        return 0
    out.print(hardware_table(resolved))
    return 0


def _plot_command(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Console, err: Console) -> int:
    from dpcs_compiler.debug.telemetry_plot import plot_telemetry
    from dpcs_compiler.runtime.telemetry import read_telemetry

    if not args.telemetry.is_file():
        err.print(f"dpcs plot: error: no telemetry file at {str(args.telemetry)!r}", markup=False, highlight=False)
        return EXIT_USAGE
    entries = read_telemetry(args.telemetry)
    try:
        path = plot_telemetry(entries, args.out or args.telemetry.with_suffix(".png"), title=f"dpcs runtime: {args.telemetry.name}")
    except ValueError as error:
        err.print(f"dpcs plot: error: {error} ({args.telemetry})", markup=False, highlight=False)
        return EXIT_USAGE
    compiles = sum(len(e["compiles"]) for e in entries if e.get("kind") == "compiles")
    reads = sum(e.get("kind") == "signals" for e in entries)
    syncs = sum(e.get("kind") == "cadence" for e in entries)
    out.print(f"wrote {path}: {reads} signal reads, {compiles} variant compiles"
              + (f", {syncs} cadence syncs" if syncs else ""), markup=False, highlight=False)
    return 0


def hardware_table(resolved) -> Table:
    """A profile's figures and provenance as a two-column table."""
    profile = resolved.profile
    table = Table(title=f"dpcs hardware profile #{resolved.hash}", show_header=False)
    table.add_column("field", no_wrap=True)
    table.add_column("value")
    table.add_row("device", profile.device_key)
    table.add_row("source", resolved.source)
    table.add_row("measured", profile.measured_at + (f" with torch {profile.torch_version}" if profile.torch_version != profile.measured_at else ""))
    for dtype, rate in sorted(profile.matmul_flops.items()):
        table.add_row(f"matmul {dtype}", f"{rate / 1e12:.4g} TFLOP/s")
    for kind, rows in sorted((profile.matmul_table or {}).items()):
        rates = [2 * m * k * n / seconds / 1e12 for m, k, n, seconds in rows]
        table.add_row(f"matmul {kind} by shape", f"{min(rates):.4g}-{max(rates):.4g} TFLOP/s at {len(rows)} shapes")
    table.add_row("memory bandwidth", f"{profile.memory_bandwidth / 1e9:.4g} GB/s")
    table.add_row("host to device", "-" if profile.host_to_device is None else f"{profile.host_to_device / 1e9:.3g} GB/s")
    table.add_row("device to host", "-" if profile.device_to_host is None else f"{profile.device_to_host / 1e9:.3g} GB/s")
    table.add_row("launch overhead", f"{profile.launch_overhead_s * 1e6:.3g} us")
    if profile.host_to_device is not None:
        ops = offload_ops_seconds(profile)
        table.add_row("offload ops, per value", f"{ops * 1e6:.3g} us" + ("" if profile.offload_ops_s is not None else " (floor: not measured)"))
    table.add_row("memory", format_bytes(profile.memory_bytes))
    if profile.cpu_share is not None:
        table.add_row("CPU share", f"{profile.cpu_share:.2f}" + (" (busy: not cached)" if profile.busy else ""))
    return table


def bench_script() -> Path:
    """benchmarks/bench.py of the source checkout holding this package (absent from an installed wheel)."""
    return Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def _bench_command(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Console, err: Console) -> int:
    import importlib.util

    script = bench_script()
    if not script.is_file():
        err.print(
            f"dpcs bench: error: no benchmark at {script}; `dpcs bench` runs the benchmarks/ folder of a dpcs "
            "source checkout (clone the repository and `pip install -e .` it)",
            markup=False, highlight=False, soft_wrap=True,
        )
        return EXIT_USAGE
    spec = importlib.util.spec_from_file_location("dpcs_bench", script)
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get(spec.name)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
        status = module.main(list(args.bench_args))
    except SystemExit as exit:  # the benchmark's argparse: --help, bad arguments
        return _exit_status(exit.code)
    finally:
        if saved is None:
            sys.modules.pop(spec.name, None)
        else:
            sys.modules[spec.name] = saved
    return 0 if status is None else int(status)


def run_script(script: Path, script_args: Sequence[str], dump_dir: Path) -> int:
    """Run `script` as __main__ like `python SCRIPT ARGS` would, with dumps on; return its exit status.

    Dynamo is reset first, so that every graph the script runs compiles here. sys.argv, sys.path and the
    environment are restored afterwards. An uncaught exception is printed (from the script's own frames
    on) and gives status 1, like the interpreter.
    """
    import torch._dynamo

    saved_argv, saved_path, saved_env = sys.argv, sys.path[:], os.environ.get(DUMP_DIR_ENV)

    torch._dynamo.reset()  # graphs cached by an earlier run in this process would not compile, nor dump, again
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.resolve().parent))
    os.environ[DUMP_DIR_ENV] = str(dump_dir)
    try:
        runpy.run_path(str(script), run_name="__main__")
        return 0
    except SystemExit as exit:
        return _exit_status(exit.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except Exception as error:  # noqa: BLE001 - the script's failure becomes its exit status
        sys.stdout.flush()
        traceback.print_exception(type(error), error, _from_script(error.__traceback__, script))
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_env is None:
            os.environ.pop(DUMP_DIR_ENV, None)
        else:
            os.environ[DUMP_DIR_ENV] = saved_env


def _exit_status(code: object) -> int:
    """What the interpreter does with SystemExit(code): None is 0, an int is itself, anything else is printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _from_script(tb, script: Path):
    """The traceback from the script's first frame on (runpy's and dpcs's frames left out)."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename != str(script):
        first = first.tb_next
    return first or tb


if __name__ == "__main__":
    sys.exit(main())
