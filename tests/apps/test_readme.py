"""The README and the pages of docs/ run. Their ```python blocks execute offline as written (a block
that needs a hub checkpoint is marked `<!-- test: skip (why) -->` on the line before it; the
README's Python API block may not be), every `vlmod` command in their ```bash blocks (also as
`python scripts/X.py`, `python demo/server.py`, `accelerate launch ... scripts/finetune.py`) parses
with flags that exist, spelled with the current names rather than the hidden old ones, and every
link between the pages leads somewhere. A reader who follows the documentation gets what it
says, so it cannot drift from the code unnoticed."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from helpers import ROOT

from vlmod.cli import UsageError, build_parser

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```(\w+)\n(.*?)^```", re.M | re.S)
SCRIPTS = {
    "scripts/convert_llava.py": ["convert"], "scripts/rank_layers.py": ["rank"], "scripts/bench_vit.py": ["bench", "vit"],
    "scripts/bench_llava.py": ["bench", "llava"], "scripts/bench_video.py": ["bench", "video"],
    "scripts/finetune.py": ["finetune"], "scripts/evaluate.py": ["eval"], "scripts/audit_routing.py": ["audit"],
    "scripts/make_synthetic_data.py": ["data", "synthetic"], "scripts/synthetic_recipe.py": ["recipe"],
    "demo/server.py": ["demo"],
}


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path, language: str) -> list[tuple[str, str, str | None]]:
    """(page:line, code, skip reason or None) of every ```language block of `page`."""
    text = page.read_text()
    found = []
    for m in BLOCK.finditer(text):
        if m.group(2) != language:
            continue
        note = m.group(1) or ""
        skip = re.match(r"<!--\s*test:\s*skip\s*(.*?)\s*-->", note)
        where = f"{_name(page)}:{text[: m.start(2)].count(chr(10)) + 1}"
        found.append((where, m.group(3), skip.group(1) or "marked" if skip else None))
    return found


PYTHON = [b for page in PAGES for b in blocks(page, "python")]


def test_the_docs_pages_are_found():
    assert len(PAGES) > 1, "no docs/*.md page found"


def test_the_python_api_block_is_tested():
    readme = blocks(README, "python")
    assert readme, "the README has no ```python block"
    api = [b for b in readme if "vlmod.apply_mod(" in b[1]]
    assert api and all(skip is None for _, _, skip in api), "the Python API block must run, not be skipped"


@pytest.mark.parametrize(("where", "code", "skip"), PYTHON, ids=[b[0] for b in PYTHON])
def test_python_block_runs_offline(where, code, skip, tmp_path, monkeypatch):
    if skip:
        pytest.skip(f"{where}: {skip}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # blocks may write files ("out")
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})


def _commands(code: str) -> list[tuple[str, list[str]]]:
    """(the text, argv of `vlmod`) of every vlmod command in a bash block."""
    found = []
    for raw in code.replace("\\\n", " ").splitlines():
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        # `[--video --videos 200]` marks optional flags: check them as given
        words = shlex.split(text.replace("[", " ").replace("]", " "), comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                argv = _vlmod_argv(command)
                if argv is not None:
                    found.append((text, argv))
                command = []
            else:
                command.append(word)
    return found


def _vlmod_argv(words: list[str]) -> list[str] | None:
    for i, word in enumerate(words):
        if i and words[i - 1].startswith("-"):
            continue  # a flag's value (`lmms-eval --model vlmod`), not the program
        if word == "vlmod" or word.endswith("/bin/vlmod"):
            return words[i + 1:]
        if word in SCRIPTS:
            return [*SCRIPTS[word], *words[i + 1:]]
    return None


BASH = [(where, text, argv) for page in PAGES for where, code, _ in blocks(page, "bash") for text, argv in _commands(code)]


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


def test_the_readme_shows_every_command():
    shown = {argv[0] for where, _, argv in BASH if where.startswith("README.md:") and argv}
    missing = _subcommands(build_parser()) - shown
    assert not missing, f"the README shows no `vlmod {sorted(missing)[0]}` command (missing: {sorted(missing)})"


def _hidden_aliases(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The hidden old spellings among `argv`'s flags, for the subcommand `argv` names."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, word in enumerate(argv):
                if word in action.choices:
                    return _hidden_aliases(action.choices[word], argv[i + 1:])
    hidden = {a for action in parser._actions for a in getattr(action, "hidden_aliases", ())}
    return {w.split("=")[0] for w in argv if w.split("=")[0] in hidden}


@pytest.mark.parametrize(("where", "text", "argv"), BASH, ids=[f"{b[0]}:{' '.join(b[2][:2])}" for b in BASH])
def test_bash_commands_use_flags_that_exist(where, text, argv, monkeypatch):
    # Whether the flags exist, not whether this machine has a command's `--threads 2` (a one-core runner).
    monkeypatch.setattr("vlmod.bench.timing.available_cores", lambda: 64)
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except (UsageError, SystemExit) as e:
        pytest.fail(f"{where}: `{text}` does not parse: {e}")
    old = _hidden_aliases(parser, argv)
    assert not old, f"{where}: `{text}` uses the old spelling(s) {sorted(old)}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of `page`'s headings (lower case, punctuation dropped, spaces as dashes)."""
    text = BLOCK.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


LINKS = [(page, target) for page in PAGES for target in re.findall(r"\]\(([^)\s]+)\)", BLOCK.sub("", page.read_text()))
         if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{_name(p)}->{t}" for p, t in LINKS])
def test_links_between_pages_resolve(page, target):
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{_name(page)} links to {target}, which does not exist"
    if anchor and linked.suffix == ".md":
        assert anchor in _anchors(linked), f"{_name(page)} links to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_pages_are_written_for_a_reader_who_never_saw_the_issues(page):
    cited = re.findall(r"\bissues? #?\d+", page.read_text(), re.I)
    assert not cited, f"{_name(page)} cites {cited}: say what was measured or decided instead"


def test_the_readme_opening_reads_in_one_pass():
    """Before: under the title, one 20-line "What it gives" paragraph chained every figure, and only
    in its middle did it say the models were tiny and synthetic. Now: two plain sentences of what
    vlmod does, then where the figures come from (random-weight 7B shapes: speed and memory only),
    then the headline numbers as a short table linking docs/results.md; no paragraph over 8 lines."""
    opening = README.read_text().split("\n## ", 1)[0]
    paragraphs = [p for p in opening.split("\n\n")[1:] if p.strip()]
    first = " ".join(paragraphs[0].split())
    assert len(re.findall(r"[.:;]\s", first + " ")) <= 3 and first.count(". ") + first.endswith(".") == 2, first
    assert "Where the figures come from" in paragraphs[1] and "random weights" in paragraphs[1]
    assert "not measured here" in paragraphs[1]
    table = next(p for p in paragraphs if p.startswith("|"))
    assert len(table.splitlines()) <= 8 and "What it gives" not in opening
    assert "docs/results.md" in opening.split(table, 1)[1]
    assert max(len(p.splitlines()) for p in paragraphs if not p.startswith("|")) <= 8
