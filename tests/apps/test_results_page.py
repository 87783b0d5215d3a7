"""docs/results.md stays a results page: short, every table with the command that made it, and
every link into it or into docs/results-history.md (from a page, the code, a test or a script)
leads to a heading that exists. Before: 1,732 lines, mostly dated runs, with the current video
table 1,400 lines down and no list of what did not work. Now: the current tables, each with its
command and time, one "What did not work" list, and every dated run in results-history.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import ROOT

RESULTS = ROOT / "docs" / "results.md"
HISTORY = ROOT / "docs" / "results-history.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"`(?:vlmod|python) [^`]+`")
SEARCHED = ("README.md", "docs", "vlmod", "tests", "scripts", "demo")
SUFFIXES = {".md", ".py", ".html", ".js", ".txt", ".yaml", ".yml", ".toml"}


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every `## ` section, fenced blocks kept in the body."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of `page`'s headings (lower case, punctuation dropped, spaces as dashes)."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def _has_command(body: str) -> bool:
    """A fenced block whose line starts with `vlmod ` or `python `, or such a command inline."""
    fenced = any(re.search(r"^(?:vlmod|python) ", code, re.M) for _, code in FENCE.findall(body))
    return fenced or bool(COMMAND.search(FENCE.sub("", body)))


def _links_into_results() -> list[tuple[str, str, str]]:
    """(file, linked page, anchor) of every `results.md#...` or `results-history.md#...` in the repo."""
    found = []
    for top in SEARCHED:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.suffix in SUFFIXES)
        for f in files:
            if f.resolve() == Path(__file__).resolve() or "__pycache__" in f.parts:
                continue
            for page, anchor in re.findall(r"(results(?:-history)?\.md)#([\w\-]+)", f.read_text(errors="replace")):
                found.append((f.relative_to(ROOT).as_posix(), page, anchor))
    return sorted(set(found))


def test_results_page_is_short_and_lists_what_did_not_work():
    lines = RESULTS.read_text().splitlines()
    assert len(lines) <= 500, f"docs/results.md has {len(lines)} lines: move dated runs to results-history.md"
    headings = [h for h, _ in _sections(RESULTS.read_text())]
    assert "What did not work" in headings, f"docs/results.md has no '## What did not work' section: {headings}"
    assert "(results-history.md)" in RESULTS.read_text(), "docs/results.md does not link results-history.md"


TABLES = [(h, body) for h, body in _sections(RESULTS.read_text()) if re.search(r"^\|.*\|\s*$", FENCE.sub("", body), re.M)]


def test_the_table_sections_are_found():
    assert len(TABLES) >= 5, f"docs/results.md: {len(TABLES)} sections with a table; the check below would check little"


@pytest.mark.parametrize(("heading", "body"), TABLES, ids=[h for h, _ in TABLES])
def test_every_table_section_shows_its_command(heading, body):
    assert _has_command(body), f"docs/results.md '## {heading}' has a table but no `vlmod ...` / `python ...` command"


def test_the_history_keeps_the_dated_runs():
    """The moved sections are where the links and the code's comments send a reader."""
    anchors = _anchors(HISTORY)
    for moved in ("the-video-regression-an-unstable-learning-rate", "video-seed-1-end-to-end-the-mod-stages-router-diverges-2026-11-27"):
        assert moved in anchors, f"docs/results-history.md lost the section #{moved}"


LINKS = _links_into_results()


def test_links_into_the_results_pages_are_found():
    assert LINKS, "no results.md# link found in the repository: the search below would check nothing"


@pytest.mark.parametrize(("where", "page", "anchor"), LINKS, ids=[f"{w}->{p}#{a}" for w, p, a in LINKS])
def test_every_link_into_the_results_pages_resolves(where, page, anchor):
    assert anchor in _anchors(ROOT / "docs" / page), f"{where} links to {page}#{anchor}: no such heading there"
