"""What makes a resumed fine-tuning run the same run, beyond its settings: the training data's
content. `--resume` compares the settings saved with a checkpoint to the current ones and refuses
any difference that changes what the run computes (the learning rate, `max_steps`, the data, ...;
see `vlmod.training.checkpoints.FREE_SETTINGS` for those it may change), naming each. A data file edited in place
keeps its path, so its content is compared too: a resumed run never silently trains on other data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

DATA_KEY = "data_content"
_cache: dict[tuple[str, int, int], str] = {}


def data_fingerprint(path: str | Path | None) -> str | None:
    """'sha256 <12 hex>, <N> bytes' of a data file (None when it is not a file); computed once per
    file version and process."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        return None
    stat = p.stat()
    key = (str(p.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _cache:
        digest = hashlib.sha256()
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _cache[key] = f"sha256 {digest.hexdigest()[:12]}, {stat.st_size} bytes"
    return _cache[key]


def settings_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: saved -> current' for every setting that differs. The data's content is compared only
    when the saved run recorded it (runs saved before it was recorded still resume)."""
    keys = sorted(set(saved) | set(current))
    if DATA_KEY not in saved:
        keys = [k for k in keys if k != DATA_KEY]
    diff = []
    for k in keys:
        if saved.get(k) != current.get(k):
            what = f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
            diff.append(f"{what} (the data file changed since the run started)" if k == DATA_KEY else what)
    return diff


__all__ = ["DATA_KEY", "data_fingerprint", "settings_diff"]
