"""Paths checked before any work starts.

Outputs: a run that trains for an hour and then finds its output is a file, or a folder it cannot
write, has lost the hour. Every command checks its outputs with these before it loads a model;
nothing is created here (a refused command leaves no trace).

Inputs: a model is a local checkpoint directory or a Hugging Face hub id. Off the network,
transformers retries the hub for about 30 seconds before it gives up (and then falls back to the
cache), so a hub id is checked first (`check_hub_id`): the hub is probed once, briefly, and an
unreachable hub (or HF_HUB_OFFLINE=1 with the id not in the local cache) is one line that says
what to do. Online, the id is handed to `from_pretrained` unchanged. Every loader goes through
here: the command line checks its model flags before any work (`vlmod.cli`), and
`vlmod.io.hf.load_config`, which every checkpoint load starts with, checks again.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from vlmod.errors import InputError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # kept for importers; checks use is_repo_id
PROBE_TIMEOUT_S = 3.0
_PROBE_TTL_S = 30.0
_TRUE = {"1", "on", "yes", "true"}
_probes: dict[str, tuple[float, bool]] = {}


def symlink_loop(path: str | os.PathLike[str]) -> bool:
    """Whether `path` (or a folder on the way to it) is a symbolic link that leads back to itself:
    `exists()` says False for one, so without this a loop reads as "does not exist"."""
    try:
        os.stat(Path(path).expanduser())
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


LOOP = "is a symlink loop (a link that leads back to itself); point it at a real path"


def not_found(path: str | os.PathLike[str]) -> str:
    """Why an input `path` cannot be read, to follow it in a message: a symlink loop says so."""
    return LOOP if symlink_loop(path) else "does not exist"


def _check_not_loop(path: Path, flag: str, error: type[Exception]) -> None:
    if symlink_loop(path):  # else `resolve()` below raises RuntimeError: a traceback
        raise error(f"{flag} {path} is a symlink loop (a link that leads back to itself); remove it or choose "
                    "another path")


def _existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of `path` (itself excluded) that exists."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """`path` (made absolute) or its nearest ancestor that exists: where files written there will
    take their space (`shutil.disk_usage` needs a path that exists)."""
    path = Path(path).absolute()
    return path if path.exists() else _existing_ancestor(path)


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
    _check_not_loop(p, flag, error)
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
    _check_not_loop(p, flag, error)
    if p.exists() and not p.is_dir():
        raise error(f"{flag} {path} is a file; give a folder")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise error(f"{flag} {path} is not writable; choose another folder")
    else:
        _check_creatable(p, flag, error)
    _check_outside(p, flag, inputs, error, replaces)
    return p


def check_new_dir(
    path: str | os.PathLike[str],
    flag: str,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    error: type[Exception] = InputError,
    overwrite: bool | None = None,
    replaces: bool = False,
    fix: str | None = None,
) -> Path:
    """`check_output_dir` of a folder the command fills from scratch: one that exists must be
    empty, unless `overwrite` (the command's --overwrite) says to write over what it holds; None:
    the command has no such flag. `fix` ends the message (default: pass --overwrite to replace
    it, or choose a new FLAG). Returns it as a Path; raises `error` with a one-line reason."""
    p = check_output_dir(path, flag, inputs, error, replaces=replaces or bool(overwrite))
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        if fix is None:
            fix = "pass --overwrite to replace it" if overwrite is not None else f"choose a new {flag}"
        raise error(f"{flag} {path} exists and is not empty; {fix}")
    return p


def check_not_among(
    path: str | os.PathLike[str],
    flag: str,
    files: Iterable[str | os.PathLike[str]],
    error: type[Exception] = InputError,
) -> None:
    """`error` when the output `path` is one of `files`, the inputs a data file points to (the
    images and videos of its records): writing there would destroy a training image."""
    target = Path(path).expanduser().resolve()
    if not target.exists():
        return
    for source in files:
        if Path(source).expanduser().resolve() == target:
            raise error(f"{flag} {path} is an input the data points to; writing there would destroy it, "
                        "choose another path")


# ----------------------------------------------------------------------------- hub ids


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for the local cache only."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(endpoint: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub opens within `timeout` seconds (name lookup included:
    it runs in a daemon thread, since `getaddrinfo` itself has no timeout). The answer is kept
    for 30 seconds per endpoint, so the several loads of one command probe once."""
    endpoint = endpoint or hub_endpoint()
    cached = _probes.get(endpoint)
    if cached is not None and time.monotonic() - cached[0] < _PROBE_TTL_S:
        return cached[1]
    url = urlparse(endpoint)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    ok = threading.Event()

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                ok.set()
        except OSError:
            pass

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(timeout)
    _probes[endpoint] = (time.monotonic(), ok.is_set())
    return ok.is_set()


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds `repo_id`'s config.json."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return False
    return isinstance(found, str)


def is_repo_id(name: str) -> bool:
    """Whether `name` is a valid hub repo id (`org/name` or `name`), as huggingface_hub itself
    validates them (`./x`, `/x`, `~/x`, `a/b/c` are not)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def looks_like_hub_id(arg: str | os.PathLike[str]) -> bool:
    """A valid hub repo id that is not an existing local path."""
    name = str(arg)
    return not Path(name).expanduser().exists() and is_repo_id(name)


def check_hub_id(name: str, flag: str | None = None, error: type[Exception] = InputError) -> str:
    """`name`, a hub id, when it can be loaded now; otherwise `error` with one line that says to
    pass a local checkpoint directory or set HF_HUB_OFFLINE=1, within a few seconds. `flag`
    (e.g. "--model") starts the message when given."""
    what = f"{flag} {name}" if flag else name
    if hub_offline():
        if not in_hub_cache(name):
            raise error(
                f"{what}: no such directory, and HF_HUB_OFFLINE is set but the hub id is not in the local "
                "Hugging Face cache; download it once while online, or pass a local checkpoint directory"
            )
        return name
    if not hub_reachable():
        raise error(
            f"{what}: no such directory, and the Hugging Face hub ({hub_endpoint()}) is unreachable; pass a "
            "local checkpoint directory, or set HF_HUB_OFFLINE=1 to load the hub id from the local cache"
        )
    return name


def check_model_arg(arg: str | os.PathLike[str] | None, flag: str, error: type[Exception] = InputError) -> None:
    """What a command does first with a model flag: a hub id must be loadable now (`check_hub_id`);
    a local path is left to the command's own checks."""
    if arg is not None and symlink_loop(arg):
        raise error(f"{flag} {arg} {LOOP}")
    if arg is not None and looks_like_hub_id(arg):
        check_hub_id(str(arg), flag, error)


def resolve_checkpoint(arg: str | os.PathLike[str], flag: str) -> Path | str:
    """A local checkpoint directory (Path) or a hub id (str) that can be loaded now; InputError
    naming `flag` (e.g. "--dense") otherwise, within a few seconds when the hub is unreachable."""
    local = Path(arg).expanduser()
    if symlink_loop(local):
        raise InputError(f"{flag} {arg} {LOOP}")
    if local.exists():
        if not (local / "config.json").is_file():
            raise InputError(f"{flag} {arg}: not a model directory (no config.json)")
        return local
    name = str(arg)
    if not is_repo_id(name):
        raise InputError(f"{flag} {arg}: no such directory (pass a checkpoint directory or a hub id like org/name)")
    return check_hub_id(name, flag)


__all__ = [
    "check_hub_id", "check_model_arg", "check_new_dir", "check_not_among", "check_output_dir", "check_output_file",
    "hub_offline", "hub_reachable", "in_hub_cache", "is_repo_id", "looks_like_hub_id", "nearest_existing", "not_found",
    "resolve_checkpoint", "symlink_loop",
]
