"""Uploaded media, decoded: an image or a video is recognised by decoding its bytes (never by a
file name or extension), so whatever reaches the model is a real picture.

Errors carry the HTTP status the demo answers with: 415 for bytes that are neither an image nor a
video, 400 for a file that claims to be one but does not decode (a corrupt video or image), 413
for a picture too large to decode safely, 422 for a picture of an extreme aspect ratio.

Why the shape checks: pixels alone do not bound memory. The model's processor resizes the short
side up to its input size, so a 1,000,000 x 1 PNG of 3 KB becomes a 32,000,000 x 32 float array
(gigabytes). The aspect ratio and the size the processor would resize to are checked from the
headers, before anything is decoded or resized.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmod.data.llava_format import (  # one pixel limit and one RGB conversion for every loader
    MAX_PIXELS,
    as_rgb,
)
from vlmod.data.video import MAX_CLIP_PIXELS

# Longest side / shortest side of a picture: a panorama passes, a 1-pixel line does not.
MAX_ASPECT = 20.0
# Pixels of a picture once the model's processor has resized it (float32 RGB: 12 bytes a pixel).
MAX_RESIZED_PIXELS = 8_000_000
# Video frames are decoded at the size the processor needs, but no smaller than this shorter side:
# the page shows the frames too (a 1280x720 clip is decoded as it is, a 6000x6000 one at 720x720).
SHOWN_SHORT_SIDE = 720

# (width, height) -> pixels of that picture after the model's processor resized it.
ResizedPixels = Callable[[int, int], int]

# Leading bytes of the video containers ffmpeg reads that PIL does not: a file that starts like one
# but does not decode is a corrupt video (400), not an unsupported file (415).
_VIDEO_SIGNATURES: tuple[tuple[int, bytes], ...] = (
    (4, b"ftyp"),  # mp4, mov, 3gp, m4v
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska, WebM
    (0, b"FLV"),
    (0, b"OggS"),
    (0, b"\x00\x00\x01\xba"),  # MPEG program stream
    (0, b"\x00\x00\x01\xb3"),  # MPEG video
    (8, b"AVI "),  # RIFF....AVI
)


class MediaError(ValueError):
    """An upload the demo cannot use; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Media:
    """Decoded pictures: one for an image, the sampled frames for a video."""

    kind: str  # "image" | "video"
    frames: list[Image.Image]
    timestamps: list[float] = field(default_factory=list)  # seconds, videos only
    # The file's own frame size where the decoder scaled the frames down (a large video), else None.
    source_size: tuple[int, int] | None = None

    @property
    def size(self) -> tuple[int, int]:
        return self.frames[0].size


def _field(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def processor_resized_pixels(processor: Any) -> ResizedPixels:
    """(width, height) -> the largest picture, in pixels, that `processor` (a multimodal processor
    or an image / video processor) resizes a picture of that shape to, read from its settings:
    `size` (shortest_edge [+ longest_edge], height/width, longest_edge) and anyres pinpoints."""
    subs = [getattr(processor, a, None) for a in ("image_processor", "video_processor")]
    subs = [p for p in subs if p is not None] or [processor]

    def resized(width: int, height: int) -> int:
        best = 0
        for sub in subs:
            size = getattr(sub, "size", None)
            short, long = _field(size, "shortest_edge"), _field(size, "longest_edge")
            h, w = _field(size, "height"), _field(size, "width")
            if short:
                scale = short / min(width, height)
                if long and max(width, height) * scale > long:
                    scale = long / max(width, height)
                pixels = width * height * scale * scale
            elif h and w:
                pixels = h * w
            elif long:
                pixels = width * height * (long / max(width, height)) ** 2
            else:
                pixels = width * height
            pinpoints = getattr(sub, "image_grid_pinpoints", None) or []
            pixels = max([pixels] + [ph * pw for ph, pw in pinpoints if isinstance(ph, int) and isinstance(pw, int)])
            best = max(best, int(pixels))
        return best

    return resized


def check_shape(
    width: int,
    height: int,
    what: str = "image",
    *,
    max_pixels: int = MAX_PIXELS,
    max_aspect: float = MAX_ASPECT,
    resized_pixels: ResizedPixels | None = None,
    max_resized_pixels: int = MAX_RESIZED_PIXELS,
) -> None:
    """Refuse a picture from its header size alone, before it is decoded or resized: over
    `max_pixels` (413), empty (400), more elongated than `max_aspect` (422), or one the model's
    processor would resize to over `max_resized_pixels` (413)."""
    if width < 1 or height < 1:
        raise MediaError(f"the {what} is empty ({width}x{height} pixels)")
    if width * height > max_pixels:
        raise MediaError(
            f"the {what} is {width}x{height} pixels; the demo takes at most {max_pixels:,} pixels", status=413
        )
    aspect = max(width, height) / min(width, height)
    if aspect > max_aspect:
        raise MediaError(
            f"the {what} is {width}x{height} pixels, an aspect ratio of {aspect:,.0f}:1; the demo takes pictures "
            f"up to {max_aspect:g}:1 (crop it first)", status=422,
        )
    if resized_pixels is not None:
        resized = resized_pixels(width, height)
        if resized > max_resized_pixels:
            raise MediaError(
                f"the {what} is {width}x{height} pixels, which the model's processor would resize to "
                f"{resized:,} pixels; the demo takes at most {max_resized_pixels:,} (send a less elongated picture)",
                status=413,
            )


def looks_like_video(head: bytes) -> bool:
    """Whether the first bytes of a file are those of a video container."""
    return any(head[at : at + len(sig)] == sig for at, sig in _VIDEO_SIGNATURES)


def decode_image(path: Path, max_pixels: int = MAX_PIXELS, **shape: Any) -> Image.Image | None:
    """The RGB image in `path`, None when PIL does not recognise the bytes as an image.

    A recognised but undecodable image raises MediaError(400); one over `max_pixels` (or over PIL's
    decompression-bomb limit) or of a shape refused by `check_shape(**shape)` raises MediaError
    before its pixels are decoded.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(path)
    except Image.DecompressionBombError as err:  # an image, far over PIL's own pixel limit
        raise MediaError(f"the image is too large to decode safely ({err})", status=413) from None
    except (Image.UnidentifiedImageError, OSError, ValueError):
        return None
    with img:
        width, height = img.size
        check_shape(width, height, "image", max_pixels=max_pixels, **shape)
        try:
            img.seek(0)  # first frame of an animated GIF / WebP
            rgb = as_rgb(img)  # upright, transparency on white
            rgb.load()
        except (OSError, ValueError, SyntaxError) as err:
            raise MediaError(f"the image is corrupt and could not be decoded ({err})") from None
    return rgb


def video_frame_size(path: Path) -> tuple[int, int] | None:
    """(width, height) of the first video stream from the container headers (PyAV), nothing
    decoded; None when PyAV is missing or cannot tell (the decoded frames are checked then)."""
    try:
        import av
    except ImportError:
        return None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return None
            ctx = container.streams.video[0].codec_context
            width, height = int(ctx.width or 0), int(ctx.height or 0)
    except Exception:  # noqa: BLE001 - any failure to probe: leave the verdict to the decoder
        return None
    return (width, height) if width > 0 and height > 0 else None


def _short_side(width: int, height: int, resized_pixels: ResizedPixels | None) -> int:
    """The shorter side to decode a `width` x `height` clip's frames at: what the model's processor
    resizes them to, or SHOWN_SHORT_SIDE for the page when that is more."""
    need = min(width, height)
    if resized_pixels is not None:
        need = math.ceil(min(width, height) * math.sqrt(resized_pixels(width, height) / (width * height)))
    return max(need, SHOWN_SHORT_SIDE)


def decode_video(path: Path, num_frames: int, max_pixels: int = MAX_PIXELS, **shape: Any) -> Media:
    """`num_frames` frames sampled uniformly from the video in `path` (vlmod.data.video); a video whose
    headers give frames over `max_pixels` or of a shape `check_shape(**shape)` refuses is refused
    before any frame is decoded."""
    from vlmod.data.video import VideoError, load_video

    size = video_frame_size(path)
    side = None
    if size is not None:
        check_shape(size[0], size[1], "video", max_pixels=max_pixels, **shape)
        side = _short_side(size[0], size[1], shape.get("resized_pixels"))
    try:
        # Scaled by the decoder, within MAX_CLIP_PIXELS for all frames together: a 12-frame
        # 6000x6000 clip is decoded at 720x720, not as 1.3 GB of full-size frames.
        video = load_video(path, num_frames=num_frames, short_side=side, max_pixels=MAX_CLIP_PIXELS)
    except VideoError as err:
        # Without the temp path and the native decoder's "[time] file.cc:line:" log prefixes.
        detail = re.sub(r"\[[^\]]*\]\s*\S+:\d+:\s*", "", str(err).replace(str(path), "the file"))
        raise MediaError(f"the video is corrupt or unreadable: {detail[:240]}") from None
    t, h, w = video.frames.shape[:3]
    check_shape(w, h, "video", max_pixels=max_pixels, **shape)
    frames = [Image.fromarray(np.ascontiguousarray(f)) for f in video.frames]
    source = size if size is not None and tuple(size) != (w, h) else None
    return Media(kind="video", frames=frames, timestamps=[float(s) for s in video.timestamps[:t]], source_size=source)


def decode_media(path: Path, num_frames: int = 8, max_pixels: int = MAX_PIXELS, **shape: Any) -> Media:
    """Decode an upload as an image (PIL) or else a video (decord / PyAV); `shape`: the keyword
    limits of `check_shape` (max_aspect, resized_pixels, max_resized_pixels).

    Raises MediaError: 415 when the bytes are neither, 400 when they are a corrupt image or video,
    413 / 422 for a picture refused by its size or shape.
    """
    path = Path(path)
    if path.stat().st_size == 0:
        raise MediaError("the uploaded file is empty")
    image = decode_image(path, max_pixels, **shape)
    if image is not None:
        return Media(kind="image", frames=[image])
    with path.open("rb") as f:
        head = f.read(16)
    if looks_like_video(head):
        return decode_video(path, num_frames, max_pixels, **shape)
    # Not a known signature: let ffmpeg decide, but a failure then means "not a video at all".
    try:
        return decode_video(path, num_frames, max_pixels, **shape)
    except MediaError as err:
        if err.status in (413, 422):
            raise
        raise MediaError(
            "unsupported file: it decodes neither as an image (PNG, JPEG, GIF, WebP, ...) nor as a video "
            "(MP4, WebM, AVI, ...)",
            status=415,
        ) from None
