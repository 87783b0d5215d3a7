"""Video frames for video LLaVA models: decoding with decord, frame sampling, and clip writing.

`load_video` returns RGB frames (uint8, T x H x W x 3) and the timestamp of each in seconds.
Sampling:
- "uniform": `num_frames` frames at the centres of equal segments of the clip;
- "fps": one frame every `1 / fps` seconds from the start, thinned uniformly to at most
  `num_frames` when there are more.
When the clip has fewer frames than asked for, every frame is returned once (T < num_frames):
nothing is duplicated, so per-frame token counts stay honest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


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


def load_video(path: str | Path, num_frames: int = 8, sample: str = "uniform", fps: float | None = None) -> Video:
    """Decode `num_frames` frames of `path` (see the module doc for sampling)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video file {path} does not exist")
    if fps is not None and sample == "uniform":
        sample = "fps"
    try:
        import decord
    except ImportError:
        return _load_with_av(path, num_frames, sample, fps)
    decord.bridge.set_bridge("native")
    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        total = len(reader)
        video_fps = float(reader.get_avg_fps() or 0.0)
    except Exception as err:  # decord raises its own DECORDError, RuntimeError, ...
        raise VideoError(f"could not read {path}: not a readable video ({str(err).splitlines()[0][:200]})") from None
    idx = sample_indices(total, num_frames, sample, fps, video_fps)
    try:
        frames = reader.get_batch(list(idx)).asnumpy()
        stamps = np.asarray(reader.get_frame_timestamp(list(idx)))[:, 0]
    except Exception as err:
        raise VideoError(f"could not decode frames of {path}: the file is corrupt ({str(err).splitlines()[0][:200]})") from None
    return Video(frames=frames, timestamps=stamps.astype(np.float64), fps=video_fps, total_frames=total)


def _load_with_av(path: Path, num_frames: int, sample: str, fps: float | None) -> Video:
    """Fallback where decord has no wheel (e.g. aarch64): decode every frame with PyAV."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            video_fps = float(stream.average_rate or 0.0)
            decoded = [(f.to_ndarray(format="rgb24"), float(f.time or 0.0)) for f in container.decode(stream)]
    except (av.error.FFmpegError, IndexError) as err:
        raise VideoError(f"could not read {path}: not a readable video ({err})") from None
    idx = sample_indices(len(decoded), num_frames, sample, fps, video_fps)
    frames = np.stack([decoded[i][0] for i in idx])
    stamps = np.array([decoded[i][1] for i in idx], dtype=np.float64)
    return Video(frames=frames, timestamps=stamps, fps=video_fps, total_frames=len(decoded))


def write_video(path: str | Path, frames: np.ndarray, fps: int = 8) -> Path:
    """Write RGB frames [T, H, W, 3] uint8 to an H.264 mp4 with PyAV (H and W made even)."""
    import av

    path = Path(path)
    frames = np.asarray(frames, dtype=np.uint8)
    h, w = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": "18", "preset": "ultrafast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[:h, :w]), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.replace(path)
    return path
