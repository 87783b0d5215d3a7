"""Output paths checked before any work starts: a run that trains for an hour and then finds its
output is a file, or a folder it cannot write, has lost the hour. Every command checks its outputs
with these before it loads a model; nothing is created here (a refused command leaves no trace).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from vlmod.errors import InputError


def _existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of `path` (itself excluded) that exists."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _check_creatable(path: Path, flag: str, error: type[Exception]) -> None:
    """`path` does not exist: its nearest existing ancestor must be a folder we may write."""
    ancestor = _existing_ancestor(path)
    if not ancestor.is_dir():
        raise error(f"{flag} {path}: {ancestor} is a file, so {path} cannot be created; choose another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise error(f"{flag} {path}: the folder {ancestor} is not writable; choose another path")


def _check_outside(
    path: Path, flag: str, inputs: Iterable[str | os.PathLike[str] | None], error: type[Exception], replaces: bool
) -> None:
    """`path` must neither be nor sit inside a local input (a model folder, a data file), and, when
    the command may replace the whole folder (`replaces`), not contain one: writing there would
    destroy the input."""
    target = path.resolve()
    for source in inputs:
        if source is None:
            continue
        src = Path(source).expanduser()
        if not src.exists():
            continue  # a hub id, not a local path
        src = src.resolve()
        if target == src:
            raise error(f"{flag} {path} is the input {source}; writing there would destroy it, choose another path")
        if replaces and src.is_relative_to(target):
            raise error(f"{flag} {path} contains the input {source}; writing there could destroy it, choose another path")
        if src.is_dir() and target.is_relative_to(src):
            raise error(f"{flag} {path} is inside the input {source}; choose a path outside it")


def check_output_file(
    path: str | os.PathLike[str],
    flag: str,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    error: type[Exception] = InputError,
) -> Path:
    """A file the command will write (a JSON report): not a folder, creatable, writable, and not
    an input. Returns it as a Path; raises `error` with a one-line reason."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise error(f"{flag} {path} is a folder; give a file name (e.g. {p / 'report.json'})")
    if p.exists():
        if not os.access(p, os.W_OK) or not os.access(p.parent, os.W_OK | os.X_OK):
            raise error(f"{flag} {path} is not writable; choose another path")
    else:
        _check_creatable(p, flag, error)
    _check_outside(p, flag, inputs, error, replaces=False)
    return p


def check_output_dir(
    path: str | os.PathLike[str],
    flag: str,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    error: type[Exception] = InputError,
    replaces: bool = False,
) -> Path:
    """A folder the command will write into: not a file, creatable or writable, and neither an
    input nor inside one; `replaces` (the command may delete what the folder holds, as --overwrite
    does): not around one either. Returns it as a Path; raises `error` with a one-line reason."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise error(f"{flag} {path} is a file; give a folder")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise error(f"{flag} {path} is not writable; choose another folder")
    else:
        _check_creatable(p, flag, error)
    _check_outside(p, flag, inputs, error, replaces)
    return p


__all__ = ["check_output_dir", "check_output_file"]
