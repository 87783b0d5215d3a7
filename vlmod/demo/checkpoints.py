"""Where the demo's checkpoints come from: a local directory or a Hugging Face hub id.

Why this module: transformers retries an unreachable hub for about 30 seconds before it gives up
(and then falls back to the cache). A demo started off the network with a hub id should fail in
seconds with one line that says what to do, so the hub is probed once, briefly, before loading.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from vlmod.errors import InputError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
PROBE_TIMEOUT_S = 3.0
_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for the local cache only."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(endpoint: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub opens within `timeout` seconds (name lookup included:
    it runs in a daemon thread, since `getaddrinfo` itself has no timeout)."""
    url = urlparse(endpoint or hub_endpoint())
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
    return ok.is_set()


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds `repo_id`'s config.json."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return False
    return isinstance(found, str)


def resolve_checkpoint(arg: str | Path, flag: str) -> Path | str:
    """A local checkpoint directory (Path) or a hub id (str) that can be loaded now; InputError
    naming `flag` (e.g. "--dense") otherwise, within a few seconds when the hub is unreachable."""
    local = Path(arg).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise InputError(f"{flag} {arg}: not a model directory (no config.json)")
        return local
    name = str(arg)
    if not HUB_ID.match(name):
        raise InputError(f"{flag} {arg}: no such directory (pass a checkpoint directory or a hub id like org/name)")
    if hub_offline():
        if not in_hub_cache(name):
            raise InputError(
                f"{flag} {name}: no such directory, and HF_HUB_OFFLINE is set but the hub id is not in the "
                "local Hugging Face cache; download it once while online, or pass a local checkpoint directory"
            )
        return name
    if not hub_reachable():
        raise InputError(
            f"{flag} {name}: no such directory, and the Hugging Face hub ({hub_endpoint()}) is unreachable; "
            "pass a local checkpoint directory, or set HF_HUB_OFFLINE=1 to load the hub id from the local cache"
        )
    return name


__all__ = ["hub_offline", "hub_reachable", "in_hub_cache", "resolve_checkpoint"]
