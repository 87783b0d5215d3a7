"""Files in and out safely: atomic writes (a reader, or a crash mid-write, never sees a half-written
file) and the YAML config files commands read."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vlmod.io.safetensors_layout import align_folder


def default_file_mode() -> int:
    """The mode a plain `open()` would give a new file under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory and `os.replace`, so an
    old file is replaced only by a complete new one."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would have.
        os.chmod(tmp, default_file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """`write_bytes_atomic` of UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write `data` as indented JSON, atomically."""
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def save_pretrained_atomic(model: Any, processor: Any, folder: str | os.PathLike[str]) -> Path:
    """`save_pretrained` of a model and its processor through `folder.tmp`, then a rename: `folder`
    is complete or absent (an older `folder` is replaced only once the new one is written)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    align_folder(tmp)  # loading maps the weights and computes what was saved, bit for bit
    processor.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


__all__ = ["save_pretrained_atomic", "default_file_mode", "write_bytes_atomic", "write_json", "write_text"]


def read_yaml_mapping(path: str | Path, error: type[Exception]) -> dict[str, Any]:
    """The mapping a YAML config file holds; `error` naming the file when it is missing, not YAML,
    or not a mapping."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise error(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise error(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data
