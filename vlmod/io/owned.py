"""What a command made in a folder it shares with its user: the marker file `.vlmod-made.json` names
the command and the entries of the folder it created, so that a rerun replaces or deletes only
those and refuses to touch anything else (a user's file that sits where an output would go).

`made_by(folder)` says which command stamped a folder; a `Ledger` keeps the list of entries one
command made there (`claim` before writing one, `remove` deletes only a claimed one). The marker is
written atomically; nothing here creates the folder itself."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vlmod.io.files import write_json

MARKER = ".vlmod-made.json"


def _read(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def made_by(folder: str | os.PathLike[str]) -> str | None:
    """The command whose marker `folder` holds; None without one (or with one that cannot be read)."""
    command = _read(Path(folder).expanduser()).get("command")
    return command if isinstance(command, str) else None


def entries(folder: str | os.PathLike[str]) -> list[str]:
    """The names in `folder` besides the marker, sorted; none when it is not a folder."""
    p = Path(folder).expanduser()
    return sorted(e.name for e in p.iterdir() if e.name != MARKER) if p.is_dir() else []


def _holds_something(path: Path) -> bool:
    """Whether `path` exists and is not an empty folder (taking an empty folder loses nothing)."""
    if path.is_dir() and not path.is_symlink():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


class Ledger:
    """The entries `command` made in `folder`, as its marker lists them (none when the marker is
    missing or another command's)."""

    def __init__(self, folder: str | os.PathLike[str], command: str) -> None:
        self.folder, self.command = Path(folder).expanduser(), command
        data = _read(self.folder)
        made = data.get("made") if data.get("command") == command else None
        self.made = {m for m in made if isinstance(m, str)} if isinstance(made, list) else set()

    def owns(self, name: str) -> bool:
        return name in self.made

    def foreign(self, names: Iterable[str]) -> list[str]:
        """Those of `names` that hold something in the folder that this command did not make."""
        return [n for n in names if not self.owns(n) and _holds_something(self.folder / n)]

    def claim(self, name: str) -> Path:
        """Record `name` as this command's (before it is written, so a killed run still owns it);
        the caller checked `foreign` first. Returns its path."""
        if name not in self.made:
            self.made.add(name)
            self.save()
        return self.folder / name

    def remove(self, name: str) -> None:
        """Delete `name` if this command made it; anything else is left alone."""
        if name not in self.made:
            return
        path = self.folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        self.made.discard(name)
        self.save()

    def save(self) -> None:
        """Write the marker (the folder must exist)."""
        write_json(self.folder / MARKER, {"command": self.command, "made": sorted(self.made)})


__all__ = ["MARKER", "Ledger", "entries", "made_by"]
