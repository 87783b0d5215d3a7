"""Video frames for video LLaVA models: decoding with decord, frame sampling, and clip writing.

`load_video` returns RGB frames (uint8, T x H x W x 3) and the timestamp of each in seconds.
Sampling:
- "uniform": `num_frames` frames at the centres of equal segments of the clip;
- "fps": one frame every `1 / fps` seconds from the start, thinned uniformly to at most
  `num_frames` when there are more.
When the clip has fewer frames than asked for, every frame is returned once (T < num_frames):
nothing is duplicated, so per-frame token counts stay honest.

Frames are scaled by the decoder (decord's width / height, PyAV's reformat), never decoded at
full size first: `short_side` is the shorter side the consumer needs (a model's processor resizes
to about that), and the frames x pixels of one clip stay within `max_pixels` (MAX_CLIP_PIXELS).
A 12-frame 6000x6000 clip is 1.3 GB of RGB at full size, 4 MB at 336 pixels.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Frames x pixels decoded for one clip (8 frames of 1920x1080 fit twice over): the budget of one
# request or sample, whatever the frame count and the clip's size.
MAX_CLIP_PIXELS = 32_000_000


class VideoError(ValueError):
    """A video that cannot be used: unreadable, corrupt, or without frames."""


@dataclass
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8
    timestamps: np.ndarray  # [T] seconds, frame start times
    fps: float
    total_frames: int


def sample_indices(total: int, num_frames: int, sample: str = "uniform", fps: float | None = None, video_fps: float = 0.0) -> np.ndarray:
    """Frame indices to decode out of `total` frames."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if total < 1:
        raise VideoError("the video has no frames")
    if sample == "uniform":
        if total <= num_frames:
            return np.arange(total)
        return ((np.arange(num_frames) + 0.5) * total / num_frames).astype(np.int64)
    if sample == "fps":
        if fps is None or fps <= 0:
            raise ValueError("sample='fps' needs fps > 0")
        if video_fps <= 0:
            raise VideoError("the video does not report a frame rate; use sample='uniform'")
        step = video_fps / fps
        idx = np.unique(np.minimum(np.round(np.arange(0, total, step)).astype(np.int64), total - 1))
        if len(idx) > num_frames:
            idx = idx[((np.arange(num_frames) + 0.5) * len(idx) / num_frames).astype(np.int64)]
        return idx
    raise ValueError(f"sample must be 'uniform' or 'fps', got {sample!r}")


def decode_size(
    width: int, height: int, frames: int, short_side: int | None = None, max_pixels: int = MAX_CLIP_PIXELS
) -> tuple[int, int]:
    """(width, height) to decode `frames` frames of a `width` x `height` clip at: scaled down (never
    up) so the shorter side is at most `short_side` and frames x pixels at most `max_pixels`,
    aspect kept, sides even (what the scalers want)."""
    scale = 1.0
    if short_side is not None and min(width, height) > short_side:
        scale = short_side / min(width, height)
    budget = max_pixels / max(frames, 1)
    if width * height * scale * scale > budget:
        scale = (budget / (width * height)) ** 0.5
    if scale >= 1.0:
        return width, height
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def processor_short_side(processor: Any) -> int | None:
    """The shorter side a clip's frames need for `processor` (a multimodal processor, or its video
    / image processor): the largest size its settings name (`shortest_edge`, `height` / `width`,
    `longest_edge`, `crop_size`), so decoding at it loses nothing the processor keeps. None when
    it names none (decode at full size, within the budget)."""
    subs = [getattr(processor, a, None) for a in ("video_processor", "image_processor")]
    sub = next((p for p in subs if p is not None), processor)
    sides = []
    for setting in (getattr(sub, "size", None), getattr(sub, "crop_size", None)):
        for key in ("shortest_edge", "height", "width", "longest_edge"):
            value = setting.get(key) if isinstance(setting, dict) else getattr(setting, key, None)
            if isinstance(value, (int, float)) and value > 0:
                sides.append(int(value))
    return max(sides) if sides else None


def load_video(
    path: str | Path,
    num_frames: int = 8,
    sample: str = "uniform",
    fps: float | None = None,
    *,
    short_side: int | None = None,
    max_pixels: int = MAX_CLIP_PIXELS,
) -> Video:
    """Decode `num_frames` frames of `path` (see the module doc for sampling), scaled by the decoder
    to `decode_size(short_side, max_pixels)`."""
    from vlmod.data.llava_format import check_regular_file

    path = check_regular_file(path, "video")
    if fps is not None and sample == "uniform":
        sample = "fps"
    header, claimed = _check_claims(path)
    # A clip shorter than asked gives the frames it has, so the pixel budget is shared among those:
    # shared among `num_frames` (100000), each frame came out a few pixels wide and decord failed.
    wanted = min(num_frames, claimed) if claimed else num_frames
    size = decode_size(*header, wanted, short_side, max_pixels) if header else None
    try:
        import decord
    except ImportError:
        return _load_with_av(path, num_frames, sample, fps, short_side, max_pixels)
    decord.bridge.set_bridge("native")
    decord.logging.set_level(decord.logging.QUIET)  # ffmpeg's own log lines
    scaled = {"width": size[0], "height": size[1]} if size is not None and size != header else {}

    def open_reader() -> tuple[Any, int, float]:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0), **scaled)
        return reader, len(reader), float(reader.get_avg_fps() or 0.0)

    # decord raises its own DECORDError, RuntimeError, ...
    opened, reason = _quietly(open_reader)
    if reason is not None:
        raise VideoError(f"could not read {path}: not a readable video ({reason})")
    reader, total, video_fps = opened
    idx = sample_indices(total, num_frames, sample, fps, video_fps)

    def decode() -> tuple[np.ndarray, np.ndarray]:
        frames = reader.get_batch(list(idx)).asnumpy()
        return frames, np.asarray(reader.get_frame_timestamp(list(idx)))[:, 0]

    decoded, reason = _quietly(decode)
    if reason is not None:
        raise VideoError(f"could not decode frames of {path}: the file is corrupt ({reason})")
    frames, stamps = decoded
    if header is None and frames.size > max_pixels * 3:  # no header to scale from: the budget still holds
        raise VideoError(f"could not use {path}: {len(frames)} frames of {frames.shape[2]}x{frames.shape[1]} "
                         f"pixels are over the {max_pixels:,}-pixel budget of a clip; ask for fewer frames")
    return Video(frames=frames, timestamps=stamps.astype(np.float64), fps=video_fps, total_frames=total)


def _check_claims(path: Path) -> tuple[tuple[int, int] | None, int]:
    """Refuse a file whose container claims more frames than it has bytes, before decord reads it:
    decord sizes its frame index from the claim, and a 5 KB mp4 whose `stts` box claims two billion
    frames makes it abort the whole process (std::bad_alloc, not catchable from Python). PyAV reads
    the claim without building that index. Returns the frame size (width, height) the headers give
    (None when PyAV is missing or cannot tell) and the frames they claim (0: not told)."""
    try:
        import av
    except ImportError:  # nothing to check with: decord's own handling
        return None, 0
    try:
        with av.open(str(path)) as container:
            claimed = max((int(s.frames or 0) for s in container.streams.video), default=0)
            ctx = container.streams.video[0].codec_context if container.streams.video else None
            header = (int(ctx.width or 0), int(ctx.height or 0)) if ctx is not None else (0, 0)
    except (av.error.FFmpegError, OSError, ValueError):
        return None, 0  # unreadable to PyAV too: decord gives the reason
    size = path.stat().st_size
    if claimed > size:
        raise VideoError(
            f"could not read {path}: its header claims {claimed:,} frames in {size:,} bytes (a damaged or "
            "forged file); re-encode it, e.g. ffmpeg -i IN -c:v libx264 OUT.mp4"
        )
    return (header if min(header) > 0 else None), claimed


def _quietly(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, a short reason) when it raised; what native code logged to stderr
    meanwhile is kept out of the terminal."""
    with _native_stderr() as log:
        try:
            return fn(), None
        except Exception as err:
            failure = err
    return None, _reason(failure, log)


@contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """Capture what native code writes to file descriptor 2 inside the block (decord logs its errors
    there with dmlc's logger, which no setting silences), so a bad file gives one VideoError instead
    of log lines around it. The captured lines are yielded for the error message."""
    lines: list[str] = []
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no descriptor 2 to redirect: leave it alone
        yield lines
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def _reason(err: BaseException, log: list[str]) -> str:
    """The most telling short reason: decord's logged line when there is one, else the exception's
    first line; without the timestamp and C++ source location dmlc puts in front."""
    for line in [*reversed(log), *str(err).splitlines()[:1]]:
        text = re.sub(r"^\[[^]]*\]\s*\S+:\d+:\s*", "", line).strip()
        if text:
            return text[:200]
    return type(err).__name__


def _load_with_av(
    path: Path, num_frames: int, sample: str, fps: float | None, short_side: int | None, max_pixels: int
) -> Video:
    """Fallback where decord has no wheel (e.g. aarch64): PyAV decodes every frame, and keeps the
    sampled ones, scaled by its reformat (`decode_size`)."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError(f"could not read {path}: it has no video stream")
            stream = container.streams.video[0]
            video_fps = float(stream.average_rate or 0.0)
            total = int(stream.frames or 0)
            keep = set(sample_indices(total, num_frames, sample, fps, video_fps).tolist()) if total > 0 else None
            width, height = decode_size(stream.codec_context.width, stream.codec_context.height,
                                        min(num_frames, total) if total > 0 else num_frames, short_side, max_pixels)
            decoded = [
                (f.reformat(width=width, height=height, format="rgb24").to_ndarray() if keep is None or i in keep
                 else None, float(f.time or 0.0))
                for i, f in enumerate(container.decode(stream))
            ]
    except av.error.FFmpegError as err:
        raise VideoError(f"could not read {path}: not a readable video ({err})") from None
    idx = sample_indices(len(decoded), num_frames, sample, fps, video_fps)
    if any(decoded[i][0] is None for i in idx):  # the header's frame count was wrong
        raise VideoError(f"could not read {path}: it has {len(decoded)} frames, its header claims {total}")
    frames = np.stack([decoded[i][0] for i in idx])
    stamps = np.array([decoded[i][1] for i in idx], dtype=np.float64)
    return Video(frames=frames, timestamps=stamps, fps=video_fps, total_frames=len(decoded))


def write_video(path: str | Path, frames: np.ndarray, fps: int = 8, lossless: bool = False) -> Path:
    """Write RGB frames [T, H, W, 3] uint8 to an H.264 mp4 with PyAV (H and W made even).

    `lossless`: 4:4:4 chroma at quantiser 0 (within 2 levels of the frames). The default,
    4:2:0 at crf 18, is what players expect, but halves colour resolution: at 32 px a 9 px
    star comes back a blob, so synthetic training clips are written lossless."""
    import av

    path = Path(path)
    frames = np.asarray(frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.shape[0] < 1 or min(frames.shape[1:3]) < 2:
        # PyAV writes no file at all for zero frames; say why instead of failing on the rename.
        raise ValueError(f"write_video needs frames [T, H, W, 3] with T >= 1 and H, W >= 2, got shape {frames.shape}")
    h, w = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        with av.open(str(tmp), mode="w") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height = w, h
            stream.pix_fmt = "yuv444p" if lossless else "yuv420p"
            stream.options = {"qp": "0", "preset": "ultrafast"} if lossless else {"crf": "18", "preset": "ultrafast"}
            for frame in frames:
                picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[:h, :w]), format="rgb24")
                for packet in stream.encode(picture):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
