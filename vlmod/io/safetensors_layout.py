"""Safetensors files whose tensors start on 64-byte boundaries, so loading can map them as they are.

A loader that maps a safetensors file (transformers 5 does) hands the model tensors at the
file's own byte offsets. safetensors pads its header to 8 bytes only, and packs tensors back to
back, so most of them start off a 64-byte boundary, where CPU matmul kernels take another path
and round differently: a model loaded from such a file computes its logits a few ulps off the
model that was saved. Copying every weight to aligned memory at load time fixes that at twice
the checkpoint's memory, which a 7B checkpoint on a 24 GiB machine does not have. So vlmod's
writers lay their files out aligned instead (`align_folder`, after `save_pretrained`): the header
is padded to a multiple of 64 bytes and the tensors whose sizes are multiples of 64 bytes (every
matrix of a real model) come first. The rewrite streams the file (the kernel copies the bytes);
it holds no tensor in memory. The result is an ordinary safetensors file.

`damaged_safetensors` checks the other way a file goes wrong: shorter than its header says (a
truncated copy or download, or a write that ran out of disk without an error).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ALIGNMENT = 64
_COPY_CHUNK = 1 << 30


def _header(path: Path) -> tuple[int, dict]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return size, json.loads(f.read(size))


def is_aligned(path: str | os.PathLike[str]) -> bool:
    """Whether every tensor of a safetensors file whose size is a multiple of 64 bytes starts on
    a 64-byte boundary of the file (so also of a page-aligned mapping of it)."""
    size, header = _header(Path(path))
    start = 8 + size
    return all(
        (start + v["data_offsets"][0]) % ALIGNMENT == 0
        for k, v in header.items()
        if k != "__metadata__" and (v["data_offsets"][1] - v["data_offsets"][0]) % ALIGNMENT == 0
    )


def align_file(path: str | os.PathLike[str]) -> bool:
    """Rewrite one safetensors file aligned (see the module doc), through a temp file and a
    rename; False when it already was (nothing written)."""
    path = Path(path)
    if is_aligned(path):
        return False
    size, header = _header(path)
    meta = header.pop("__metadata__", None)
    names = list(header)  # the writer's order, kept within each group
    names.sort(key=lambda k: (header[k]["data_offsets"][1] - header[k]["data_offsets"][0]) % ALIGNMENT != 0)
    layout: dict = {"__metadata__": meta} if meta is not None else {}
    sources, offset = [], 0
    for name in names:
        begin, end = header[name]["data_offsets"]
        layout[name] = {**header[name], "data_offsets": [offset, offset + end - begin]}
        sources.append((8 + size + begin, end - begin))
        offset += end - begin
    text = json.dumps(layout, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % ALIGNMENT)  # safetensors pads its header with spaces too
    tmp = path.with_name(f".{path.name}.align-tmp")
    try:
        with path.open("rb") as src, tmp.open("wb") as dst:
            dst.write(len(text).to_bytes(8, "little") + text)
            dst.flush()
            for start, length in sources:
                _copy_range(src.fileno(), dst.fileno(), start, length)
            os.fsync(dst.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def _copy_range(src: int, dst: int, start: int, length: int) -> None:
    """Append `length` bytes of `src` from `start` to `dst`, in the kernel where it can."""
    done = 0
    while done < length:
        n = min(_COPY_CHUNK, length - done)
        try:
            copied = os.copy_file_range(src, dst, n, start + done)
        except (AttributeError, OSError):  # no copy_file_range (macOS, some file systems)
            copied = os.write(dst, os.pread(src, n, start + done))
        if copied <= 0:
            raise OSError(f"short read at byte {start + done}: the file changed while it was aligned")
        done += copied


def align_folder(folder: str | os.PathLike[str]) -> int:
    """`align_file` every safetensors file of a saved model folder; how many were rewritten."""
    return sum(align_file(p) for p in sorted(Path(folder).glob("*.safetensors")))




def damaged_safetensors(folder: str | Path) -> str | None:
    """'NAME: what is wrong' for the first safetensors file in `folder` that is shorter than its
    header says or has no valid header (a truncated copy or download); None when all are whole."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                head = f.read(8)
                size = int.from_bytes(head, "little") if len(head) == 8 else -1
                if size <= 0 or size > path.stat().st_size:
                    return f"{path.name}: no valid safetensors header"
                header = json.loads(f.read(size))
        except (OSError, ValueError) as e:
            return f"{path.name}: unreadable header ({e})"
        if not isinstance(header, dict):
            return f"{path.name}: no valid safetensors header"
        ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
        expected = 8 + size + max(ends, default=0)
        if path.stat().st_size < expected:
            return f"{path.name}: truncated ({path.stat().st_size:,} of {expected:,} bytes)"
    return None


__all__ = ["ALIGNMENT", "align_file", "align_folder", "damaged_safetensors", "is_aligned"]
