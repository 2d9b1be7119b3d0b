"""Every code block in README.md and in the pages of docs/ (and benchmarks/results/README.md) runs. Each fenced
block is marked, on the line before it, with what runs it:

- `<!-- twin: examples/readme/NAME -->`: a script that holds the block word for word (indented alike, if at
  all) and gives it a model and data, then checks what it did; run here (Python in this process unless it
  says it runs as its own process, shell scripts with bash), with dpcs's final compiler "eager" from
  DPCS_OPTIONS (code options win, so a script that names its compiler keeps it);
- `<!-- main-job -->`: the main job, run here as written once the install commands are stripped (CI's own
  set-up runs them), and `<!-- output-of: main-job -->`: what it prints, line by line the same text with
  other numbers;
- `<!-- ci:test-command -->`: the test command, which `.ci/run` itself runs.

The last three are README.md's alone. Twins live in examples/readme/ (whichever page their block is on) and
examples/docs/, and each script there is some block's twin. Every relative link of those pages leads to a file
that exists (and an anchor into a Markdown file to one of its headings).
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"]
TWIN_FOLDERS = [ROOT / "examples" / "readme", ROOT / "examples" / "docs"]
INSTALL = 'pip install torch==2.13.0 && pip install -e ".[dev]" && '
MARKER = re.compile(r"^<!-- (?:twin: (?P<twin>\S+)|(?P<kind>ci:test-command|main-job|output-of: main-job)) -->$")
OWN_PROCESS = "# readme-twin: own process"  # a line of a twin not run inside pytest (it spawns ranks)


def page_blocks(page: Path) -> list[tuple[int, str, list[str], re.Match | None]]:
    """(line, language, lines, the marker before it) of every fenced block of one page."""
    found, lines = [], page.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].startswith("```"):
            start, language = index, lines[index][3:].strip()
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            before = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
            found.append((start + 1, language, lines[start + 1:end], MARKER.match(before)))
            index = end
        index += 1
    return found


def blocks() -> list[tuple[int, str, list[str], re.Match | None]]:
    """(line, language, lines, the marker before it) of every fenced block of README.md."""
    return page_blocks(README)


def all_blocks() -> list[tuple[str, int, str, list[str], re.Match | None]]:
    """(page, line, language, lines, marker) of every fenced block of every page."""
    return [(str(page.relative_to(ROOT)), *block) for page in PAGES if page.is_file() for block in page_blocks(page)]


def twins() -> list[Path]:
    return sorted({ROOT / m["twin"] for *_, m in all_blocks() if m and m["twin"]})


def contains_block(text: str, block: list[str]) -> bool:
    """Whether `text` holds `block`'s lines in a row, word for word, all indented alike (or not at all)."""
    lines = text.splitlines()
    for start in range(len(lines) - len(block) + 1):
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        if all(line == (indent + wanted if wanted else "") or (not wanted and not line.strip())
               for line, wanted in zip(lines[start:start + len(block)], block)):
            return True
    return False


def test_every_block_says_what_runs_it_and_each_twin_holds_its_block():
    found = all_blocks()
    assert len(found) >= 15 and len(blocks()) >= 5
    unmarked = [f"{page}:{line} ({language})" for page, line, language, _, marker in found if marker is None]
    assert not unmarked, f"blocks with no twin or runner marked before them: {unmarked}"
    for page, line, _, block, marker in found:
        if marker["twin"]:
            twin = ROOT / marker["twin"]
            assert twin.is_file(), f"{page}:{line}: its twin {marker['twin']} does not exist"
            assert contains_block(twin.read_text(), block), f"{page}:{line}: {marker['twin']} does not hold the block"
    kinds = [m["kind"] for _, _, _, m in blocks() if m["kind"]]
    assert sorted(kinds) == ["ci:test-command", "main-job", "output-of: main-job"], kinds
    elsewhere = [f"{page}:{line}" for page, line, *_, m in found if m["kind"] and page != "README.md"]
    assert not elsewhere, f"the main job's and the test command's markers are README.md's alone: {elsewhere}"
    scripts = {p for folder in TWIN_FOLDERS for p in folder.iterdir() if p.suffix in (".py", ".sh")}
    assert not scripts - set(twins()), f"scripts in examples/readme/ or examples/docs/ that are no block's twin: {sorted(scripts - set(twins()))}"


LINK = re.compile(r"\]\(([^()\s]+)\)")


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: the text lowercased, punctuation dropped, spaces to hyphens."""
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        fence ^= line.startswith("```")
        if not fence and (heading := re.match(r"^#{1,6} (.*)$", line)):
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading[1].strip())
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in anchors:
                n += 1
                anchor = f"{slug}-{n}"
            anchors.add(anchor)
    return anchors


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_reads_anchors_as_github_makes_them():
    page = ROOT / "README.md"
    assert "set-up-and-run-fresh-machine-cpu" in heading_anchors(page)


def test_the_block_matcher_wants_every_line_in_a_row():
    text = "a = 1\n    x = 2\n    y = 3\n\n    z = 4\n"
    assert contains_block(text, ["x = 2", "y = 3", "", "z = 4"])
    assert not contains_block(text, ["x = 2", "z = 4"]) and not contains_block(text, ["x = 2", "y = 4"])


def twin_environment() -> dict[str, str]:
    return os.environ | {
        "DPCS_OPTIONS": '{"compiler": "eager"}',
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # this python, its `dpcs`
        "OMP_NUM_THREADS": "2",
        "PYTHONPATH": "",
    }


@pytest.mark.parametrize("twin", twins(), ids=lambda p: p.name)
def test_each_twin_runs(twin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if twin.suffix == ".py" and OWN_PROCESS not in twin.read_text():
        monkeypatch.setenv("DPCS_OPTIONS", '{"compiler": "eager"}')
        monkeypatch.setattr(sys, "argv", [str(twin)])
        if "transformers" in twin.read_text():
            accelerate_state = pytest.importorskip("accelerate.state").AcceleratorState
            accelerate_state._reset_state(reset_partial_state=True)
            monkeypatch.setattr(accelerate_state, "_shared_state", {})
        runpy.run_path(str(twin), run_name="__main__")
        return
    command = ["bash", str(twin)] if twin.suffix == ".sh" else [sys.executable, str(twin)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=twin_environment(), cwd=tmp_path)
    assert result.returncode == 0, f"{twin.name} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def skeleton(text: str) -> str:
    """The text with its numbers (and hashes) replaced and its whitespace (rich wraps lines) collapsed."""
    text = re.sub(r"\b[0-9a-f]{12,}\b", "#", text)
    text = re.sub(r"\d+(\.\d+)?", "#", text)
    return " ".join(text.split())


def test_the_main_job_runs_as_written_and_prints_what_the_readme_shows(tmp_path):
    (command,) = [b for _, _, b, m in blocks() if m and m["kind"] == "main-job"]
    (shown,) = [b for _, _, b, m in blocks() if m and m["kind"] == "output-of: main-job"]
    (tests,) = [b for _, _, b, m in blocks() if m and m["kind"] == "ci:test-command"]
    assert len(command) == 1 and command[0].startswith(INSTALL) and tests[0].startswith(INSTALL)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = twin_environment()
    env.pop("DPCS_OPTIONS")  # the main job as a user runs it (the profile pinned, as in every test)
    result = subprocess.run(["bash", "-c", command[0][len(INSTALL):]], capture_output=True, text=True, timeout=600,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = skeleton(result.stdout)
    missing = [line for line in shown if skeleton(line) not in printed]
    assert not missing, f"the README shows lines the main job no longer prints: {missing}\n{result.stdout}"
