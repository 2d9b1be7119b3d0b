"""Options are validated when torch.compile hands them over: bad keys and values name themselves."""

from __future__ import annotations

import pytest
import torch

from dpcs_compiler.options import DUMP_DIR_ENV, DpcsOptions


def test_defaults():
    options = DpcsOptions.from_dict(None)
    assert (options.compiler, options.strict, options.dump_dir) == ("inductor", False, None)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"compilr": "eager"}, r"unknown dpcs option 'compilr'; valid options: 'compiler', 'strict', 'dump_dir'"),
        ({"compiler": "tvm"}, r"'compiler'='tvm' is not valid; valid choices: 'inductor', 'eager'"),
        ({"strict": "yes"}, r"'strict'='yes' is not valid; valid choices: True, False"),
        ({"dump_dir": 3}, r"'dump_dir'=3 is not valid"),
        ({"dump_dir": ""}, r"'dump_dir'='' is not valid"),
    ],
)
def test_bad_options_raise_value_error_naming_them(bad, message):
    with pytest.raises(ValueError, match=message):
        DpcsOptions.from_dict(bad)


def test_bad_option_through_torch_compile_names_it():
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="dpcs", options={"compiler": "tvm"})
    with pytest.raises(Exception, match=r"'compiler'='tvm' is not valid; valid choices: 'inductor', 'eager'"):
        compiled(torch.randn(2, 4))


def test_bad_option_is_never_swallowed_by_the_fallback():
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="dpcs", options={"strict": False, "nope": 1})
    with pytest.raises(Exception, match="unknown dpcs option 'nope'"):
        compiled(torch.randn(2, 4))


def test_options_are_frozen():
    options = DpcsOptions(compiler="eager")
    with pytest.raises(AttributeError):
        options.compiler = "inductor"


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    assert DpcsOptions.from_dict({}).dump_dir == tmp_path
    assert DpcsOptions.from_dict({"dump_dir": tmp_path / "x"}).dump_dir == tmp_path / "x"


def test_fingerprint_ignores_dump_dir_but_not_compiler(tmp_path):
    base = DpcsOptions(compiler="eager")
    assert base.fingerprint() == DpcsOptions(compiler="eager", dump_dir=tmp_path).fingerprint()
    assert base.fingerprint() != DpcsOptions(compiler="inductor").fingerprint()
