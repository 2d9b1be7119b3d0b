"""The `dpcs` command: `dump` runs a training script with dumps on, `show` summarises dump folders.

The script trains a small MLP for two steps through dpcs with the eager final compiler (no C++ compile).
`dump` runs once as a subprocess (`python -m dpcs_compiler.cli`, as a user would) and otherwise in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from dpcs_testing import fake_profile

from dpcs_compiler.cli import main
from dpcs_compiler.cost import hardware
from dpcs_compiler.cost.profiles import resolve_profile
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.options import DUMP_DIR_ENV, HARDWARE_PROFILE_ENV

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TRAIN_SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    import torch

    from tiny_mlp import TinyMLP  # a sibling module: the script's folder must be on sys.path


    def main(argv):
        Path(__file__).with_name("argv.json").write_text(json.dumps(sys.argv))
        torch.manual_seed(0)
        model = TinyMLP()
        compiled = torch.compile(model, backend="dpcs", options={"compiler": "eager", "strict": True})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = compiled(torch.randn(8, 16)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print("trained, loss", loss.item())
        if "--exit" in argv:
            sys.exit(int(argv[argv.index("--exit") + 1]))


    if __name__ == "__main__":
        main(sys.argv[1:])
    """
)

TINY_MLP = textwrap.dedent(
    """
    import torch

    class TinyMLP(torch.nn.Sequential):
        def __init__(self):
            super().__init__(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    """
)

COLUMNS = ["graph", "dynamo id", "mode", "compiler", "precision", "dynamo", "joint", "forward", "backward", "saved",
           "peak", "budget", "plan", "peak node", "plan hash", "pass time", "fallback"]

# Each kind of file a training graph's folder must hold, as a glob.
EXPECTED_FILES = [
    "*_dynamo.txt", "*_joint.txt", "*_joint_memory_timeline.txt", "*_joint_memory_timeline.png",
    "*_step_memory_timeline.txt", "*_step_memory_timeline.png", "*_plan.json", "*_forward.final.txt",
    "*_backward.final.txt", "summary.json",
]


@pytest.fixture
def script(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "tiny_mlp.py").write_text(TINY_MLP)
    path = folder / "train.py"
    path.write_text(TRAIN_SCRIPT)
    monkeypatch.delitem(sys.modules, "tiny_mlp", raising=False)  # each test imports its own copy
    yield path
    sys.modules.pop("tiny_mlp", None)


def dpcs_subprocess(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != DUMP_DIR_ENV}
    return subprocess.run(
        [sys.executable, "-m", "dpcs_compiler.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=240,
    )


def check_training_dump(folder: Path) -> dict:
    """The files of one training graph's folder; returns its summary."""
    for pattern in EXPECTED_FILES:
        assert list(folder.glob(pattern)), f"no {pattern} in {sorted(p.name for p in folder.iterdir())}"
    for png in folder.glob("*.png"):
        assert png.read_bytes().startswith(PNG_MAGIC), png
    assert "<- peak" in next(folder.glob("*_step_memory_timeline.txt")).read_text()
    json.loads(next(folder.glob("*_plan.json")).read_text())
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["mode"], summary["compiler"], summary["fallback"]) == ("training", "eager", None)
    assert summary["backward_nodes"] > 0 and summary["predicted_peak_bytes"] > 0
    assert summary["dump_dir"] == str(folder)
    return summary


def graph_row(stdout: str, graph: str) -> dict[str, str]:
    rows = [line for line in stdout.splitlines() if line.startswith(f"│ {graph} ")]
    assert len(rows) == 1, stdout
    return dict(zip(COLUMNS, [cell.strip() for cell in rows[0].split("│")[1:-1]], strict=True))


def test_dump_and_show_as_a_user_runs_them(tmp_path, script):
    out = tmp_path / "d"
    done = dpcs_subprocess("dump", "--out", "d", str(script), "--some-arg", "--out", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "trained, loss" in done.stdout
    assert json.loads(script.with_name("argv.json").read_text()) == [str(script), "--some-arg", "--out", "x"]
    [folder] = [p for p in out.iterdir()]
    assert folder.name == "graph_000"
    summary = check_training_dump(folder)
    peak = format_bytes(summary["predicted_peak_bytes"])
    assert f"1 graph folder(s) under {out}" in done.stdout
    row = graph_row(done.stdout, "graph_000")
    assert (row["graph"], row["mode"], row["compiler"], row["fallback"]) == ("graph_000", "training", "eager", "no")
    assert (row["saved"], row["peak"]) == (format_bytes(summary["saved_bytes"]), peak)
    assert row["peak node"] == summary["peak_node"]
    assert row["backward"] == str(summary["backward_nodes"])

    shown = dpcs_subprocess("show", "d", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert graph_row(shown.stdout, "graph_000") == row
    assert "partition/min_cut" in shown.stdout


def test_dump_in_process_restores_argv_path_and_env(tmp_path, script, capsys, monkeypatch):
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    argv, path = sys.argv[:], sys.path[:]
    out = tmp_path / "d"
    assert main(["dump", "--out", str(out), str(script), "--some-arg"]) == 0
    assert (sys.argv, sys.path, os.environ.get(DUMP_DIR_ENV)) == (argv, path, None)
    assert json.loads(script.with_name("argv.json").read_text()) == [str(script), "--some-arg"]
    [folder] = list(out.iterdir())
    summary = check_training_dump(folder)
    stdout = capsys.readouterr().out
    assert graph_row(stdout, folder.name)["peak"] == format_bytes(summary["predicted_peak_bytes"])

    # A second run into the same folder shows only its own graph and says the earlier one is there.
    assert main(["dump", "--out", str(out), str(script)]) == 0
    stdout = capsys.readouterr().out
    assert len(list(out.iterdir())) == 2
    assert "1 earlier graph folder(s) there not shown" in stdout
    assert "dpcs: 1 compiled graph" in stdout
    main(["show", str(out)])
    assert "dpcs: 2 compiled graphs" in capsys.readouterr().out


def test_failing_script_exits_with_its_status_after_the_summary(tmp_path, script, capsys):
    out = tmp_path / "d"
    assert main(["dump", "--out", str(out), str(script), "--exit", "3"]) == 3
    captured = capsys.readouterr()
    assert "train.py exited with status 3" in captured.out
    [folder] = list(out.iterdir())
    assert graph_row(captured.out, folder.name)["mode"] == "training"


@pytest.mark.parametrize(
    "body, status, stderr",
    [
        ("pass", 0, ""),
        ("import sys; sys.exit()", 0, ""),
        ("import sys; sys.exit(5)", 5, ""),
        ("import sys; sys.exit('bye')", 1, "bye"),
        ("def fail():\n    raise RuntimeError('boom')\nfail()", 1, "RuntimeError: boom"),
    ],
)
def test_exit_status_of_scripts_without_graphs(tmp_path, capsys, body, status, stderr):
    path = tmp_path / "plain.py"
    path.write_text(body + "\n")
    assert main(["dump", "--out", str(tmp_path / "d"), str(path)]) == status
    err = capsys.readouterr().err
    assert stderr in err
    assert "no graphs were dumped" in err
    if "boom" in stderr:  # the traceback starts at the script, not in runpy or dpcs
        assert 'File "' + str(path) in err.splitlines()[1]


def test_dump_needs_an_existing_script(tmp_path, capsys):
    assert main(["dump", str(tmp_path / "missing.py")]) == 2
    assert "no script at" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["dump", "--out", str(tmp_path)])
    assert exit.value.code == 2
    assert "SCRIPT.py" in capsys.readouterr().err


def test_show_missing_or_empty_folder_exits_2(tmp_path, capsys):
    assert main(["show", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert main(["show", str(tmp_path / "empty")]) == 2
    assert "no graph folders under" in capsys.readouterr().err


def test_show_missing_folder_as_a_user_runs_it(tmp_path):
    done = dpcs_subprocess("show", "missing", cwd=tmp_path)
    assert done.returncode == 2
    assert "dpcs show: error: missing is not a folder" in done.stderr


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--help"], ["dpcs dump --out dumps train.py", "show", "DPCS_DUMP_DIR"]),
        (["dump", "--help"], ["SCRIPT.py [ARGS ...]", "--out DIR", "exit status"]),
        (["show", "--help"], ["DIR", "simulated peak", "plain Inductor"]),
        (["hardware", "--help"], ["--refresh", "--json", "h100 (NVIDIA H100 SXM5 80GB, datasheet)", "reference-cpu"]),
    ],
)
def test_help(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in expected:
        assert text in out


def test_console_script_is_declared():
    [script] = [e for e in entry_points(group="console_scripts") if e.name == "dpcs"]
    assert script.value == "dpcs_compiler.cli:main"


def test_hardware_shows_the_profile_in_use_and_where_it_came_from(capsys):
    assert main(["hardware"]) == 0  # the suite pins DPCS_HARDWARE_PROFILE=reference-cpu
    out = " ".join(capsys.readouterr().out.split())
    assert "cpu:dpcs reference CPU (2-core AVX2):2" in out and "built-in 'reference-cpu'" in out
    assert main(["hardware", "--profile", "h100"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    resolved = resolve_profile("h100", "cpu")
    assert f"dpcs hardware profile #{resolved.hash}" in out and "built-in 'h100' (NVIDIA H100 SXM5 80GB, datasheet)" in out
    assert "matmul float8_e4m3fn │ 1979 TFLOP/s" in out and "host to device │ 64 GB/s" in out and "80.00 GiB" in out


def test_hardware_shows_a_measured_matmul_table_by_kind(tmp_path, capsys):
    import dataclasses

    from dpcs_compiler.cost.hardware import profile_to_json

    table = {"bfloat16": [[1024, 1024, 1024, 2 * 1024**3 / 400e12], [4096, 4096, 4096, 2 * 4096**3 / 800e12]]}
    path = tmp_path / "gpu.json"
    path.write_text(profile_to_json(dataclasses.replace(resolve_profile("h100", "cpu").profile, matmul_table=table)))
    assert main(["hardware", "--profile", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "matmul bfloat16 by shape │ 400-800 TFLOP/s at 2 shapes" in out


def test_hardware_json_is_a_profile_file_to_pin(tmp_path, capsys):
    assert main(["hardware", "--json", "--profile", "l4"]) == 0
    captured = capsys.readouterr()
    path = tmp_path / "l4.json"
    path.write_text(captured.out)
    assert resolve_profile(path, "cpu").profile == resolve_profile("l4", "cpu").profile
    assert "built-in 'l4'" in captured.err


def test_hardware_measures_once_caches_and_refreshes(tmp_path, monkeypatch, capsys):
    calls = []

    def measure(device):
        calls.append(device)
        return fake_profile(measured_at=f"2026-01-0{len(calls)}T00:00:00+00:00")

    monkeypatch.delenv(HARDWARE_PROFILE_ENV)
    monkeypatch.setenv("DPCS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_hardware_profile", measure)
    hardware.forget_memoized_profiles()
    try:
        for argv in (["hardware"], ["hardware", "--device", "cpu"], ["hardware", "--refresh"]):
            hardware.forget_memoized_profiles()  # each command is a new process
            assert main(argv) == 0
        outputs = capsys.readouterr().out
    finally:
        hardware.forget_memoized_profiles()
    assert len(calls) == 2  # measured, read from the cache, measured again
    assert "measured 2026-01-02T00:00:00+00:00, cached at" in " ".join(outputs.split())
    assert str(tmp_path / "hardware") in outputs.replace("│", "").replace("\n", "").replace(" ", "")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hardware", "--profile", "h200"], "--profile='h200' is not valid; valid choices: 'measure'"),
        (["hardware", "--profile", "missing.json"], "'missing.json' cannot be read"),
        (["hardware", "--profile", "h100", "--refresh"], "the profile 'h100' is not measured"),
    ],
)
def test_hardware_errors_exit_2_naming_the_value(argv, message, capsys):
    assert main(argv) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_hardware_names_a_bad_environment_variable(monkeypatch, capsys):
    monkeypatch.setenv(HARDWARE_PROFILE_ENV, "tpu")
    assert main(["hardware"]) == 2
    assert f"{HARDWARE_PROFILE_ENV}='tpu' is not valid" in capsys.readouterr().err
