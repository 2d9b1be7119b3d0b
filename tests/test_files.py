"""`write_text_atomic`: the file is replaced whole, and a failed write leaves the old file and no temporary."""

from __future__ import annotations

import os

import pytest

from dpcs_compiler.files import write_text_atomic


def test_the_file_is_replaced_whole(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("old\n")
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["steps.jsonl"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    path.write_text("old")

    def fails(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fails)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["profile.json"]
