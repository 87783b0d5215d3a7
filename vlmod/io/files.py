"""Files in and out safely: atomic writes (a reader, or a crash mid-write, never sees a half-written
file), one writer at a time for an output folder, and the YAML config files commands read."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from vlmod.io.safetensors_layout import align_folder


def default_file_mode() -> int:
    """The mode a plain `open()` would give a new file under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def sole_writer(path: Path, error: type[Exception], flag: str) -> Iterator[None]:
    """Hold a lock on `path` (the file `.NAME.lock` beside it) while writing it: a second process
    writing the same path fails at once with `error`, in one line, instead of taking the first
    one's temp files for leftovers of a killed run and deleting them. Without POSIX locks
    (Windows) nothing is locked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock = path.with_name(f".{path.name}.lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as err:
        raise error(f"cannot write to {path.parent}: {err.strerror or err}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise error(
                f"{flag} {path} is being written by another process right now; wait for it to finish "
                f"or choose another {flag}"
            ) from None
        try:
            yield
        finally:
            with suppress(OSError):
                os.unlink(lock)  # while still held: a later writer makes a fresh lock file
    finally:
        os.close(fd)


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


def write_json(path: str | os.PathLike[str], data: Any, strict: bool = False) -> None:
    """Write `data` as indented JSON, atomically. `strict`: a NaN or infinity in it (which Python
    writes as NaN / Infinity, and strict JSON parsers reject) is a ValueError naming where it is,
    and nothing is written: a bug, caught here rather than in whoever reads the file."""
    try:
        text = json.dumps(data, indent=2, sort_keys=False, allow_nan=not strict)
    except ValueError:
        where = _non_finite(data, "")
        if where is None:
            raise
        raise ValueError(f"{path}: {where[0] or 'the value'} is {where[1]}, which JSON cannot hold; nothing was "
                         "written") from None
    write_text(path, text + "\n")


def _non_finite(data: Any, at: str) -> tuple[str, float] | None:
    """(where, value) of the first NaN or infinity in `data` (`at`: where `data` is), else None."""
    if isinstance(data, float) and not math.isfinite(data):
        return at, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, (list, tuple)) else ()
    for key, value in items:
        found = _non_finite(value, f"{at}[{key}]" if isinstance(key, int) else f"{at}.{key}" if at else str(key))
        if found is not None:
            return found
    return None


@contextmanager
def folder_written(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """The temporary folder (`folder.tmp`) to write `folder`'s files into, renamed to `folder` when
    the block ends: `folder` is complete or absent (an older `folder` is replaced only once the new
    one is written); a full disk or Ctrl-C leaves no half-written folder behind."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def save_pretrained_atomic(model: Any, processor: Any, folder: str | os.PathLike[str]) -> Path:
    """`save_pretrained` of a model and its processor into `folder`, complete or absent (`folder_written`)."""
    with folder_written(folder) as tmp:
        model.save_pretrained(tmp)
        align_folder(tmp)  # loading maps the weights and computes what was saved, bit for bit
        processor.save_pretrained(tmp)
    return Path(folder)


__all__ = ["folder_written", "save_pretrained_atomic", "default_file_mode", "write_bytes_atomic", "write_json", "write_text"]


# A config file's values once its aliases are expanded: a settings file has tens; a "billion
# laughs" file (aliases of aliases) a few KB long has billions, which printing or validating them
# would build (one took a fine-tune to 12.6 GB and printed a 2 GB error line).
MAX_YAML_VALUES = 100_000


def read_yaml_mapping(path: str | Path, error: type[Exception]) -> dict[str, Any]:
    """The mapping a YAML config file holds; `error` naming the file when it is missing, not YAML,
    not a mapping, or its aliases expand to more than MAX_YAML_VALUES values."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        from vlmod.io.paths import not_found

        raise error(f"config file {path} {not_found(p)}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text (byte {e.start} is not); save the config as UTF-8 YAML") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_values(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            raise error(
                f"{path} expands to more than {MAX_YAML_VALUES:,} values (YAML aliases repeating each other); "
                "write the settings out without nested aliases"
            )
        data = (loader.construct_document(node) if node is not None else None) or {}
    except yaml.YAMLError as e:
        raise error(f"{path} is not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise error(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def _expanded_values(node: Any, limit: int) -> int:
    """How many nodes `node` stands for with every alias expanded (an alias is the node it names,
    met again), counted up to just past `limit`: no expansion is built."""
    import yaml

    count, stack = 0, [node]
    while stack and count <= limit:
        current = stack.pop()
        count += 1
        if isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
        elif isinstance(current, yaml.MappingNode):
            stack.extend(v for pair in current.value for v in pair)
    return count
