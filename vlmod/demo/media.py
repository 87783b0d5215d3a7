"""Uploaded media, decoded: an image or a video is recognised by decoding its bytes (never by a
file name or extension), so whatever reaches the model is a real picture.

Errors carry the HTTP status the demo answers with: 415 for bytes that are neither an image nor a
video, 400 for a file that claims to be one but does not decode (a corrupt video or image), 413
for a picture too large to decode safely.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

# Largest picture decoded (pixels of one image or video frame): larger ones are refused before
# decoding so a small compressed upload cannot expand into gigabytes (a "decompression bomb").
MAX_PIXELS = 40_000_000

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

    @property
    def size(self) -> tuple[int, int]:
        return self.frames[0].size


def looks_like_video(head: bytes) -> bool:
    """Whether the first bytes of a file are those of a video container."""
    return any(head[at : at + len(sig)] == sig for at, sig in _VIDEO_SIGNATURES)


def decode_image(path: Path, max_pixels: int = MAX_PIXELS) -> Image.Image | None:
    """The RGB image in `path`, None when PIL does not recognise the bytes as an image.

    A recognised but undecodable image raises MediaError(400); one over `max_pixels` (or over PIL's
    decompression-bomb limit) MediaError(413) before its pixels are decoded.
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
        if width * height > max_pixels:
            raise MediaError(
                f"the image is {width}x{height} pixels; the demo takes at most {max_pixels:,} pixels", status=413
            )
        if width < 1 or height < 1:
            raise MediaError("the image is empty (0 pixels)")
        try:
            img.seek(0)  # first frame of an animated GIF / WebP
            rgb = img.convert("RGB")
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


def decode_video(path: Path, num_frames: int, max_pixels: int = MAX_PIXELS) -> Media:
    """`num_frames` frames sampled uniformly from the video in `path` (vlmod.video); a video whose
    headers give frames over `max_pixels` is refused (413) before any frame is decoded."""
    from vlmod.video import VideoError, load_video

    size = video_frame_size(path)
    if size is not None and size[0] * size[1] > max_pixels:
        raise MediaError(
            f"the video is {size[0]}x{size[1]} pixels; the demo takes at most {max_pixels:,} pixels", status=413
        )
    try:
        video = load_video(path, num_frames=num_frames)
    except VideoError as err:
        # Without the temp path and the native decoder's "[time] file.cc:line:" log prefixes.
        detail = re.sub(r"\[[^\]]*\]\s*\S+:\d+:\s*", "", str(err).replace(str(path), "the file"))
        raise MediaError(f"the video is corrupt or unreadable: {detail[:240]}") from None
    t, h, w = video.frames.shape[:3]
    if h * w > max_pixels:
        raise MediaError(f"the video is {w}x{h} pixels; the demo takes at most {max_pixels:,} pixels", status=413)
    frames = [Image.fromarray(np.ascontiguousarray(f)) for f in video.frames]
    return Media(kind="video", frames=frames, timestamps=[float(s) for s in video.timestamps[:t]])


def decode_media(path: Path, num_frames: int = 8, max_pixels: int = MAX_PIXELS) -> Media:
    """Decode an upload as an image (PIL) or else a video (decord / PyAV).

    Raises MediaError: 415 when the bytes are neither, 400 when they are a corrupt image or video.
    """
    path = Path(path)
    if path.stat().st_size == 0:
        raise MediaError("the uploaded file is empty")
    image = decode_image(path, max_pixels)
    if image is not None:
        return Media(kind="image", frames=[image])
    with path.open("rb") as f:
        head = f.read(16)
    if looks_like_video(head):
        return decode_video(path, num_frames, max_pixels)
    # Not a known signature: let ffmpeg decide, but a failure then means "not a video at all".
    try:
        return decode_video(path, num_frames, max_pixels)
    except MediaError as err:
        if err.status == 413:
            raise
        raise MediaError(
            "unsupported file: it decodes neither as an image (PNG, JPEG, GIF, WebP, ...) nor as a video "
            "(MP4, WebM, AVI, ...)",
            status=415,
        ) from None
