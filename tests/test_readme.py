"""Issue 17 item 6: the README runs. Its ```python blocks execute offline as written (a block that
needs a hub checkpoint is marked `<!-- test: skip (why) -->` on the line before it; the Python API
block may not be), and every `vlmod` command in its ```bash blocks (also as `python scripts/X.py`,
`python demo/server.py`, `accelerate launch ... scripts/finetune.py`) parses with flags that exist,
spelled with the current names rather than the hidden old ones."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from vlmod.cli import UsageError, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```(\w+)\n(.*?)^```", re.M | re.S)
SCRIPTS = {
    "scripts/convert_llava.py": ["convert"], "scripts/rank_layers.py": ["rank"], "scripts/bench_vit.py": ["bench", "vit"],
    "scripts/bench_llava.py": ["bench", "llava"], "scripts/bench_video.py": ["bench", "video"],
    "scripts/finetune.py": ["finetune"], "scripts/evaluate.py": ["eval"], "scripts/audit_routing.py": ["audit"],
    "scripts/make_synthetic_data.py": ["data", "synthetic"], "scripts/synthetic_recipe.py": ["recipe"],
    "demo/server.py": ["demo"],
}


def blocks(language: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) of every ```language block of the README."""
    text = README.read_text()
    found = []
    for m in BLOCK.finditer(text):
        if m.group(2) != language:
            continue
        note = m.group(1) or ""
        skip = re.match(r"<!--\s*test:\s*skip\s*(.*?)\s*-->", note)
        found.append((text[: m.start(2)].count("\n") + 1, m.group(3), skip.group(1) or "marked" if skip else None))
    return found


PYTHON = blocks("python")


def test_the_python_api_block_is_tested():
    assert PYTHON, "the README has no ```python block"
    api = [b for b in PYTHON if "vlmod.apply_mod(" in b[1]]
    assert api and all(skip is None for _, _, skip in api), "the Python API block must run, not be skipped"


@pytest.mark.parametrize(("line", "code", "skip"), PYTHON, ids=[f"README.md:{b[0]}" for b in PYTHON])
def test_python_block_runs_offline(line, code, skip, tmp_path, monkeypatch):
    if skip:
        pytest.skip(f"README.md:{line}: {skip}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # blocks may write files ("out")
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


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


BASH = [(line, text, argv) for line, code, _ in blocks("bash") for text, argv in _commands(code)]


def test_the_readme_shows_commands():
    commands = {" ".join(argv[:1]) for _, _, argv in BASH}
    assert {"convert", "rank", "bench", "finetune", "eval", "audit", "demo", "recipe", "data"} <= commands


def _hidden_aliases(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The hidden old spellings among `argv`'s flags, for the subcommand `argv` names."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, word in enumerate(argv):
                if word in action.choices:
                    return _hidden_aliases(action.choices[word], argv[i + 1:])
    hidden = {a for action in parser._actions for a in getattr(action, "hidden_aliases", ())}
    return {w.split("=")[0] for w in argv if w.split("=")[0] in hidden}


@pytest.mark.parametrize(("line", "text", "argv"), BASH, ids=[f"README.md:{b[0]}:{' '.join(b[2][:2])}" for b in BASH])
def test_bash_commands_use_flags_that_exist(line, text, argv):
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except (UsageError, SystemExit) as e:
        pytest.fail(f"README.md:{line}: `{text}` does not parse: {e}")
    old = _hidden_aliases(parser, argv)
    assert not old, f"README.md:{line}: `{text}` uses the old spelling(s) {sorted(old)}"
