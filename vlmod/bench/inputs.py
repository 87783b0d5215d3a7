"""What the benchmarks run on: layer specs from the command line, and deterministic synthetic
pictures, prompts and clips (no download, the same bytes on every machine)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_layers(spec: str | Sequence[int]) -> str | list[int]:
    """`--layers` value: "every_other", "all" or a comma list of layer indices ("1,3,-1")."""
    if not isinstance(spec, str):
        return list(spec)
    spec = spec.strip()
    if spec in ("every_other", "all"):
        return spec
    try:
        layers = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"layers must be 'every_other', 'all' or a comma list of layer indices, got {spec!r}"
        ) from None
    if not layers:
        raise ValueError("layers is empty: name at least one layer to convert")
    return layers


def on_device(inputs: Any, model: Any) -> dict[str, Any]:
    """A processor's output as `model` takes it: every tensor on the model's device, floating ones
    (pixels) in its dtype."""
    param = next(model.parameters())
    return {
        k: v.to(param.device, param.dtype if v.is_floating_point() else None) if hasattr(v, "to") else v
        for k, v in dict(inputs).items()
    }


def synthetic_image(size: int = 336, seed: int = 0) -> Any:
    """A deterministic RGB test picture: coloured shapes on a gradient."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size, dtype=np.float64)
    base = np.stack([np.add.outer(ramp, ramp) / 2, np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size))], -1)
    image = Image.fromarray(base.astype("uint8"))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.integers(0, size - size // 4, 2)
        r = int(rng.integers(size // 12, size // 5))
        draw.ellipse([x, y, x + r, y + r], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return image


def prompt_text(words: int) -> str:
    """A question of about `words` words."""
    from vlmod.models.tiny import WORDS

    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def synthetic_clip(
    path: str | os.PathLike[str], seconds: float = 3.0, fps: int = 10, size: tuple[int, int] = (360, 640), seed: int = 0
) -> Path:
    """Write a deterministic test clip (H.264 mp4): a coloured square moving across a textured
    background. Texture and motion make the encoder do real work, so decoding it costs what
    decoding a real clip of this size costs."""
    import numpy as np

    from vlmod.data.video import write_video

    height, width = size
    frames = max(1, round(seconds * fps))
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / width * 200, yy / height * 200, (xx + yy) / (width + height) * 120], -1)
    base += rng.normal(0, 18, (height, width, 1)).astype(np.float32)  # texture
    side = max(2, min(height, width) // 4)
    clip = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        frame = base.copy()
        x = int((width - side) * t / max(frames - 1, 1))
        y = int((height - side) * (0.5 + 0.4 * np.sin(2 * np.pi * t / max(frames, 1))))
        frame[y : y + side, x : x + side] = (230, 40 + 180 * t / max(frames, 1), 60)
        clip[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return write_video(path, clip, fps=fps)
