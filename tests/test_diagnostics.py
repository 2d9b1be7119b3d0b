"""Every warning dpcs gives is a DpcsWarning, so a program (or this suite) can make dpcs's warnings errors alone."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

import dpcs_compiler
from dpcs_compiler import DpcsFallbackWarning, DpcsWarning

PACKAGE = Path(dpcs_compiler.__file__).parent
CATEGORIES = {"DpcsWarning", "DpcsFallbackWarning"}


def _warn_calls():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                yield path.relative_to(PACKAGE.parent), node


def test_every_warning_dpcs_gives_names_a_dpcs_category():
    calls = list(_warn_calls())
    assert len(calls) > 10  # the scan sees the package's warnings
    unnamed = []
    for path, call in calls:
        category = next((ast.unparse(k.value) for k in call.keywords if k.arg == "category"), None)
        if category is None and len(call.args) > 1:
            category = ast.unparse(call.args[1])
        if category not in CATEGORIES:
            unnamed.append(f"{path}:{call.lineno} ({category})")
    assert not unnamed, f"warnings.warn without a dpcs category: {unnamed}"


def test_a_dpcs_warning_can_be_made_an_error_alone():
    assert issubclass(DpcsFallbackWarning, DpcsWarning) and issubclass(DpcsWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DpcsWarning)
        warnings.warn("torch's", UserWarning)  # others' warnings stay warnings
        with pytest.raises(DpcsWarning):
            warnings.warn("dpcs's", DpcsWarning)
