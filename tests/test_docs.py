"""The README and docs/ stay true: what they cite exists, they state what is true now (no development
history), and the commands the README shows run.

A link is valid when its file exists in the repository (and its anchor names a heading there).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from prototype.serve import tables
from sim.bench import report

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
BACKTICKED_PATH = re.compile(
    r"`((?:prototype|sim|tests|notebooks|docs|\.ci)/[\w./-]*|Makefile|setup\.cfg|pyproject\.toml)`"
)
# The before-stop check of the project, word for word, plus narration of changes.
SESSIONS = re.compile(
    r"(this|previous|last|next|first|second|third|fourth|fifth|sixth) session('s)?\b"
    r"|session of 20[0-9][0-9]|sessions? ago",
    re.IGNORECASE,
)
SESSION_EXEMPT = re.compile(r"websocket|aiohttp|clientsession|soak", re.IGNORECASE)
HISTORY = re.compile(
    r"\bpreviously\b|\bthe previous (code|version|implementation|run)\b|\bused to (be|have|send|answer)\b"
    r"|\bwe (changed|replaced|rewrote|fixed|switched|moved)\b|\bnow fixed\b|\bwhat was changed\b"
    r"|\bfirst run of\b|\bstarting code\b|\bafter the fix\b|\bbefore (→|->) after\b"
    # a measured figure turned into another: "0.97 → 0.99", "714 → 206 ms", "9 ms → 1.1 ms"
    r"|\d[\d.,]*\s*(?:[µm]?s|%|×|k|KB|MB)?\s*(?:→|->)\s*\d",
    re.IGNORECASE,
)
OUTSIDE = re.compile(r"workloads\.md|wire-protocol|shared/reference|\.\./shared")


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _lines(path) if re.match(r"#{1,6} ", line)}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_links_point_at_files_in_the_repository(doc: Path) -> None:
    broken = []
    for number, line in enumerate(_lines(doc), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            path = (doc.parent / name).resolve() if name else doc
            try:
                path.relative_to(ROOT)
            except ValueError:
                broken.append(f"{number}: {target} (outside the repository)")
                continue
            if not path.exists():
                broken.append(f"{number}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{number}: {target} (no heading #{anchor})")
    assert not broken, f"{_relative(doc)} links to what is not in the repository:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_backticked_repository_paths_exist(doc: Path) -> None:
    missing = [
        f"{number}: {name}"
        for number, line in enumerate(_lines(doc), 1)
        for name in BACKTICKED_PATH.findall(line)
        if not (ROOT / name).exists()
    ]
    assert not missing, f"{_relative(doc)} names files the repository does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_docs_state_what_is_true_now(doc: Path) -> None:
    found = [
        f"{number}: {line.strip()[:120]}"
        for number, line in enumerate(_lines(doc), 1)
        if (SESSIONS.search(line) and not SESSION_EXEMPT.search(line)) or HISTORY.search(line) or OUTSIDE.search(line)
    ]
    assert not found, f"{_relative(doc)} narrates development or cites files outside the repository:\n" + "\n".join(
        found
    )


def test_the_narration_check_catches_narration() -> None:
    assert SESSIONS.search("measured in the fifth " + "session")
    assert HISTORY.search("unpaced deltas 0.52 × → 0.7 × the raw sender")
    assert HISTORY.search("the previous code ran at 62 s")
    assert HISTORY.search("a failed store write used to be swallowed")
    assert not HISTORY.search("lookup order: connection cache → store → `previous_response_not_found`")
    assert not HISTORY.search("request sent → first token-carrying delta")


def _code_lines(skip: set[str]) -> list[tuple[str, int, str]]:
    """(path, line number, line) of every Python file in the packages and tests, but `skip` and this file."""
    return [
        (_relative(path), number, line)
        for top in ("prototype", "sim", "tests")
        for path in sorted((ROOT / top).rglob("*.py"))
        if _relative(path) not in skip and path.name != "test_docs.py"
        for number, line in enumerate(_lines(path), 1)
    ]


def test_code_cites_no_file_outside_the_repository() -> None:
    hits = [f"{p}:{n}: {line.strip()[:100]}" for p, n, line in _code_lines(set()) if OUTSIDE.search(line)]
    assert not hits, "cite a public source or a page under docs/ instead:\n" + "\n".join(hits)


def test_code_narrates_no_work_sessions() -> None:
    hits = [
        f"{p}:{n}: {line.strip()[:100]}"
        for p, n, line in _code_lines(set())
        if SESSIONS.search(line) and not SESSION_EXEMPT.search(line)
    ]
    assert not hits, "history belongs in the git log:\n" + "\n".join(hits)


def test_code_cites_docs_pages_that_exist() -> None:
    missing = [
        f"{_relative(path)}: {name}"
        for top in ("prototype", "sim", "tests")
        for path in sorted((ROOT / top).rglob("*.py"))
        for name in re.findall(r"docs/[\w-]+\.md", path.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    ]
    assert not missing, "\n".join(missing)


def test_the_state_machine_page_is_generated_from_the_tables() -> None:
    """docs/state-machines.md is `prototype.serve.tables.render()`: a row added to or changed in a
    table fails here until `make docs-tables` rewrites the page."""
    page = (ROOT / "docs" / "state-machines.md").read_text(encoding="utf-8")
    assert page == tables.render(), "docs/state-machines.md is stale: run `make docs-tables`"


def test_every_page_is_listed_in_the_index() -> None:
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}
    assert not [p for p in sorted(pages) if f"]({p})" not in index]


# -- the README's commands --------------------------------------------------------------------------


def _readme_commands() -> list[str]:
    commands, in_sh = [], False
    for line in _lines(ROOT / "README.md"):
        if line.startswith("```"):
            in_sh = line.strip() == "```sh"
            continue
        if in_sh and (command := line.split(" #", 1)[0].strip()):
            commands.append(command)
    return commands


def test_the_quick_start_is_the_two_make_targets() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = quick.split("```sh", 1)[1].split("```", 1)[0]
    assert [line.split("#", 1)[0].strip() for line in block.strip().splitlines()] == ["make compare", "make test"]
    dry = subprocess.run(["make", "-n", "compare", "test"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "-m sim compare" in dry.stdout
    assert "-m pytest" in dry.stdout
    assert "pip install" in dry.stdout  # both install the package first, as the README says


HELP_COMMANDS = [c for c in _readme_commands() if c.endswith("--help")]


def test_the_readme_shows_the_help_of_each_entry_point() -> None:
    assert {"python -m sim compare --help", "python -m sim sweep --help", "python -m prototype.server --help"} <= set(
        HELP_COMMANDS
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_readme_help_commands_run(command: str) -> None:
    argv = shlex.split(command)
    assert argv[0] == "python"
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_readme_results_block_is_marked() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = text.find("<!-- results:start -->"), text.find("<!-- results:end -->")
    assert 0 <= start < end
    assert "time saved vs `http`" in text[start:end]  # the block tests/sim/harness/test_results.py renders


# -- the benchmark's report -------------------------------------------------------------------------


def _row(figure: str, ok: bool | None) -> report.Row:
    return report.Row("1", figure, 2.0, 1.0, 2.0, ">= 0.6", ok)


def test_bench_exit_status_is_1_when_a_target_fails() -> None:
    assert report.exit_status([_row("a", True), _row("b", None)]) == 0
    assert report.exit_status([_row("a", True), _row("b", False)]) == 1


def test_bench_report_replaces_only_its_block(tmp_path: Path) -> None:
    import datetime

    page = tmp_path / "performance.md"
    page.write_text(f"# Perf\n\nmethod text\n\n{report.START}\nold table\n{report.END}\n\nlimits text\n")
    when = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.UTC)
    rows = [_row("fast | enough", True), _row("late", False)]
    report.write(page, report.block(rows, ["a note"], "python -m sim.bench", when, "test machine", "abc123"))
    text = page.read_text()
    assert text.startswith("# Perf\n\nmethod text\n\n" + report.START)
    assert text.endswith(report.END + "\n\nlimits text\n")
    assert "old table" not in text
    assert "| 1 | fast \\| enough | 2 | 1 | 2 | >= 0.6 | PASS |" in text
    assert "| 1 | late | 2 | 1 | 2 | >= 0.6 | FAIL |" in text
    assert "2026-01-02 03:04 UTC" in text and "test machine" in text and "the bench exits 1" in text
    assert "a note" in text and "- commit: `abc123`" in text


def test_performance_page_holds_a_generated_run() -> None:
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    block = text[text.find(report.START) : text.find(report.END)]
    assert "Generated by `python -m sim.bench" in block
    assert "- commit: `" in block and "| target | figure | value | floor (same run) |" in block
