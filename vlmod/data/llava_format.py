"""LLaVA-format image-text data: the JSON records, their image paths and their images.

The format (LLaVA-1.5 / LLaVA-Instruct and most datasets built on them) is a JSON list of
records::

    [{"id": "000001", "image": "coco/train2017/000001.jpg",
      "conversations": [{"from": "human", "value": "<image>\\nWhat is in the picture?"},
                        {"from": "gpt", "value": "A cat."}]}]

`image` is a path relative to an image folder (or absolute), a list of such paths for
multi-image records, or absent for text-only records; `video` (video records) is a path
resolved the same way. A `.jsonl` file with one record per line
is read too. Calibration (`vlmod.tools.arank`) and fine-tuning share this reader, so both give the
same errors for the same broken file: a missing file, malformed JSON (with line and column) or
a record without the keys the format requires names the file and the record.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
HUMAN_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant")
SYSTEM_ROLES = ("system",)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# Largest picture decoded anywhere (pixels of one image or video frame), by the demo, evaluation,
# fine-tuning and ranking alike: a 500 KB PNG can claim 165 megapixels and decode to gigabytes,
# so a larger one is refused from its header, before its pixels are decoded.
MAX_PIXELS = 40_000_000


class DataError(ValueError):
    """Data that cannot be used as given (missing file, malformed JSON, a record without a
    required key, no usable sample). Command-line tools report it as one `error:` line."""


@dataclass(frozen=True)
class LlavaRecord:
    """One LLaVA-format record with its image paths resolved. `video` is the entry as written in
    the file, `video_path` the same path resolved against the image folder."""

    id: str
    conversations: tuple[dict[str, str], ...]
    images: tuple[Path, ...] = ()
    video: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    video_path: Path | None = None

    @property
    def first_question(self) -> str:
        """The first human turn without its `<image>` placeholders: the chat template of the
        processor puts the image tokens back where the model expects them."""
        for turn in self.conversations:
            if turn["from"] in HUMAN_ROLES:
                return strip_image_tokens(turn["value"])
        raise DataError(f"record {self.id!r} has no human turn")


def strip_image_tokens(text: str) -> str:
    """`text` without `<image>` / `<video>` placeholders and the blank lines around them."""
    text = text.replace(IMAGE_TOKEN, "").replace(VIDEO_TOKEN, "")
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def read_json_records(path: str | Path) -> list[dict[str, Any]]:
    """The raw records of a LLaVA-format `.json` (a list) or `.jsonl` (one record per line)."""
    path = Path(path).expanduser()
    if not path.exists():
        from vlmod.io.paths import not_found

        raise DataError(f"data file {path} {not_found(path)}")
    if not path.is_file():
        raise DataError(f"{path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text: give a LLaVA-format .json or .jsonl file") from None
    try:
        return _parse_records(path, text)
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise DataError(
            f"{path} nests its JSON lists or objects too deeply to read; a LLaVA-format file is a flat list of records"
        ) from None


def _parse_records(path: Path, text: str) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        records = []
        for number, row in enumerate(text.splitlines(), 1):  # the file's line, not the record's
            if not row.strip():
                continue
            try:
                records.append(json.loads(row))
            except json.JSONDecodeError as e:
                raise DataError(f"{path} is not valid JSON: {e.msg} at line {number}, column {e.colno}") from None
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if isinstance(records, dict) and isinstance(records.get("data"), list):
        records = records["data"]
    if not isinstance(records, list):
        raise DataError(f"{path} must hold a JSON list of records, found a {type(records).__name__}")
    return records


def resolve_image_path(image: str, image_root: str | Path) -> Path:
    """An image entry of a record as a path: absolute paths stay, relative ones join `image_root`."""
    p = Path(image).expanduser()
    return p if p.is_absolute() else Path(image_root).expanduser() / p


def parse_record(raw: Any, index: int, image_root: str | Path, source: str = "data") -> LlavaRecord:
    """Check one raw record against the format and resolve its image paths."""
    where = f"{source}: record {index}"
    if not isinstance(raw, dict):
        raise DataError(f"{where} is a {type(raw).__name__}, not an object with 'conversations'")
    conversations = raw.get("conversations")
    if conversations is None:
        raise DataError(f"{where} (id {raw.get('id', '?')!r}) has no 'conversations' key")
    if not isinstance(conversations, list) or not conversations:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of turns")
    turns = []
    for j, turn in enumerate(conversations):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(f"{where}: turn {j} needs 'from' and 'value' keys, got {turn!r:.80}")
        if not isinstance(turn["value"], str):
            raise DataError(f"{where}: turn {j} has a non-string 'value'")
        turns.append({"from": str(turn["from"]), "value": turn["value"]})
    if not any(t["from"] in HUMAN_ROLES for t in turns):
        raise DataError(f"{where}: no turn comes from {' or '.join(HUMAN_ROLES)}")
    image = raw.get("image")
    if image is None:
        images: Sequence[str] = ()
    elif isinstance(image, str):
        images = (image,)
    elif isinstance(image, list) and all(isinstance(i, str) for i in image):
        images = image
    else:
        raise DataError(f"{where}: 'image' must be a path or a list of paths, got {image!r:.80}")
    video = raw.get("video")
    if video is not None and not isinstance(video, str):
        raise DataError(f"{where}: 'video' must be a path, got {video!r:.80}")
    return LlavaRecord(
        id=str(raw.get("id", index)),
        conversations=tuple(turns),
        images=tuple(resolve_image_path(i, image_root) for i in images),
        video=video,
        raw=raw,
        video_path=resolve_image_path(video, image_root) if video is not None else None,
    )


def load_records(path: str | Path, image_root: str | Path | None = None) -> list[LlavaRecord]:
    """Parse a LLaVA-format file; image paths are resolved against `image_root` (default: the
    file's own folder). Images are not opened here: a missing image is the caller's decision
    (calibration skips it, training may refuse it)."""
    path = Path(path).expanduser()
    root = Path(image_root).expanduser() if image_root is not None else path.parent
    if image_root is not None and not root.is_dir():
        raise DataError(f"image folder {root} does not exist")
    return [parse_record(raw, i, root, source=str(path)) for i, raw in enumerate(read_json_records(path))]


def list_images(folder: str | Path) -> list[Path]:
    """The image files directly inside `folder` (by extension), sorted by name."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError(f"image folder {folder} does not exist")
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def check_regular_file(path: str | Path, what: str = "image") -> Path:
    """`path` when it is a regular file. A FIFO, a device or a socket is refused from `stat` alone,
    never opened: opening a FIFO for reading waits for a writer forever. Raises FileNotFoundError
    (missing) or DataError (not a regular file)."""
    import stat

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} file {path} does not exist") from None
    except OSError as e:  # a symlink loop, a name too long: a bad path, not a bad file
        from vlmod.io.paths import LOOP

        reason = LOOP if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or e})"
        raise DataError(f"{what} path {path} {reason}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise DataError(f"{what} path {path} is {kind}; give the path of a {what} file")
    return path


def check_pixels(width: int, height: int, path: str | Path, max_pixels: int = MAX_PIXELS) -> None:
    """DataError when a picture's header size is over `max_pixels`: refused before decoding."""
    if width * height > max_pixels:
        raise DataError(
            f"{path} is {width}x{height} pixels ({width * height / 1e6:.0f} MP); at most {max_pixels / 1e6:.0f} MP "
            "are decoded (resize it first)"
        )


def load_image(path: str | Path, max_pixels: int = MAX_PIXELS) -> Any:
    """An RGB `PIL.Image`, upright and fully decoded now so a truncated file fails here and not
    later in the processor. Upright: a photo's EXIF orientation is applied (a phone stores a
    portrait photo as landscape pixels plus a tag), as every viewer shows it. Raises OSError
    (missing or unreadable file, not an image) or DataError (not a regular file, over
    `max_pixels`)."""
    import warnings

    from PIL import Image

    check_regular_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
        with Image.open(path) as img:
            check_pixels(*img.size, path, max_pixels)
            return as_rgb(img)


def as_rgb(img: Any) -> Any:
    """`img` as the model should see it: upright (its EXIF orientation applied: a phone stores a
    portrait photo as landscape pixels plus a tag) and RGB, transparent pixels on white, as
    viewers and transformers' `convert_to_rgb` show them (a bare `convert("RGB")` drops alpha and
    leaves whatever colour the transparent pixels hold, usually black)."""
    from PIL import Image, ImageOps

    upright = ImageOps.exif_transpose(img)  # reads the tag of the file as opened
    if upright.mode == "RGB":
        return upright
    if upright.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in upright.info:
        rgba = upright.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba).convert("RGB")
    return upright.convert("RGB")
