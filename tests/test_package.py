"""The package imports its public names on first use: a process that needs only the checkpoint module (a rank
resuming a job) does not import Dynamo and Inductor; every public name and submodule still resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dpcs_compiler


def test_importing_the_checkpoint_module_leaves_dynamo_and_inductor_unimported():
    code = ("import sys, dpcs_compiler.checkpoint; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'dpcs_compiler.backend') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_public_name_and_submodule_resolves():
    for name in dpcs_compiler.__all__:
        value = getattr(dpcs_compiler, name)
        assert getattr(value, "__name__", name) == name or callable(value), name
    assert dpcs_compiler.Runtime is dpcs_compiler.runtime.Runtime
    from dpcs_compiler import checkpoint, cli, dpcs_backend  # noqa: F401  (submodules and names alike)

    assert callable(dpcs_compiler.report.step_records)  # a submodule by attribute, as docs/tooling.md shows it
    assert set(dir(dpcs_compiler)) >= set(dpcs_compiler.__all__)


def test_an_unknown_name_says_what_there_is():
    with pytest.raises(AttributeError, match=r"no attribute 'Runtme'; its public names: .*Runtime"):
        dpcs_compiler.Runtme  # noqa: B018
