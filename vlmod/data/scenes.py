"""The synthetic scenes' vocabulary (colours, shapes, questions, answers) and their drawing.

Shared by the image questions (`vlmod.data.synthetic`) and the clip questions
(`vlmod.data.synthetic_video`); every word here is in the tiny offline tokenizer's vocabulary
(`vlmod.models.tiny.WORDS`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "yellow": (240, 220, 30),
    "purple": (150, 50, 210),
    "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle", "star", "cross")
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
COUNTS = ("one", "two", "three", "four")
DIRECTIONS = ("left", "right", "up", "down")
THIRDS = ("start", "middle", "end")

IMAGE_QUESTION_TYPES = ("color", "shape", "count", "position")
ANSWERS: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "count": COUNTS,
    "position": POSITIONS,
    "direction": DIRECTIONS,
    "first": SHAPES,
    "distinct": COUNTS,
    "when": THIRDS,
    "last": SHAPES,
}
QUESTIONS: dict[str, str] = {
    "color": "what color is the {shape} ?",
    "shape": "what shape is the {color} object ?",
    "count": "how many objects are there ?",
    "position": "where is the {color} {shape} ?",
    "direction": "which direction is the {color} {shape} moving ?",
    "first": "which shape appears first ?",
    "distinct": "how many different shapes appear in the video ?",
    "when": "when does the {color} {shape} appear : start , middle or end ?",
    "last": "which shape appears last ?",
}
GRID = 3  # cells per side
MAX_DISTRACTORS = 4
MIN_IMAGE_SIZE = 24
SUPERSAMPLE = 4  # shapes are drawn at 4x and box-filtered down: smooth edges, same bytes every run



def background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A grey striped, noisy texture [size, size, 3] float32: low saturation so it never looks
    like one of the shape colours, but different in every image and every patch."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    angle = rng.uniform(0.0, np.pi)
    period = rng.uniform(size / 10, size / 4)
    phase = rng.uniform(0.0, 2 * np.pi)
    stripes = np.sin(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period + phase)
    base = rng.uniform(105.0, 150.0)
    amplitude = rng.uniform(10.0, 25.0)
    tint = rng.uniform(-8.0, 8.0, size=3)
    noise = rng.normal(0.0, 8.0, size=(size, size, 3))
    img = base + amplitude * stripes[..., None] + tint + noise
    return img.astype(np.float32)


def shape_points(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Polygon of `shape` centred at (cx, cy) with outer radius r (circle: its bounding box
    corners). The centre is inside every shape, so the pixel there has the shape's colour."""
    if shape == "circle":
        return [(cx - r, cy - r), (cx + r, cy + r)]
    if shape == "square":
        h = 0.85 * r
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + 0.95 * r, cy + 0.8 * r), (cx - 0.95 * r, cy + 0.8 * r)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else 0.45 * r
            a = -np.pi / 2 + k * np.pi / 5
            pts.append((cx + rad * float(np.cos(a)), cy + rad * float(np.sin(a))))
        return pts
    if shape == "cross":
        w = 0.33 * r
        return [
            (cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w),
            (cx + r, cy + w), (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r),
            (cx - w, cy + w), (cx - r, cy + w), (cx - r, cy - w), (cx - w, cy - w),
        ]
    raise ValueError(f"unknown shape {shape!r}; shapes: {', '.join(SHAPES)}")


def shape_alpha(shape: str, cx: float, cy: float, r: float, size: int,
                origin: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """Coverage [size, size] in [0, 1] of `shape`, anti-aliased by drawing at SUPERSAMPLE x;
    `origin`: the picture's pixel at the window's top left (a small shape drawn on a window)."""
    from PIL import Image, ImageDraw

    s, (ox, oy) = SUPERSAMPLE, origin
    canvas = Image.new("L", (size * s, size * s), 0)
    draw = ImageDraw.Draw(canvas)
    pts = [((x - ox) * s, (y - oy) * s) for x, y in shape_points(shape, cx, cy, r)]
    if shape == "circle":
        draw.ellipse(pts, fill=255)
    else:
        draw.polygon(pts, fill=255)
    small = canvas.resize((size, size), Image.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def composite(img: np.ndarray, alpha: np.ndarray, color: str) -> None:
    """Lay `color` over `img` [H, W, 3] in place with coverage `alpha` [H, W]."""
    alpha = alpha[..., None]
    img *= 1.0 - alpha
    img += alpha * np.asarray(COLORS[color], dtype=np.float32)


def paint(img: np.ndarray, obj: dict[str, Any]) -> None:
    """Composite one object (shape, color, center, radius; `contrast`, default 1, scales its
    coverage: a faint object) onto `img` in place."""
    cx, cy = obj["center"]
    composite(img, shape_alpha(obj["shape"], cx, cy, obj["radius"], img.shape[0]) * obj.get("contrast", 1.0),
              obj["color"])


def faint_contrast(rng: np.random.Generator, share: float, bounds: tuple[float, float]) -> float:
    """A picture's (clip's) contrast: with probability `share` uniform in `bounds` (faint), else 1
    (solid); no draw at all when `share` is 0, so a set without faint pictures keeps its bytes."""
    return round(float(rng.uniform(*bounds)), 3) if share and rng.random() < share else 1.0


def to_uint8(img: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def cell_of(x: float, y: float, size: int) -> int:
    """Index (row-major, 0..8) of the grid cell holding point (x, y) (pixel i spans [i, i + 1))."""
    c = size / GRID
    return min(int(y // c), GRID - 1) * GRID + min(int(x // c), GRID - 1)


def _radius(rng: np.random.Generator, cell: float) -> float:
    """Outer radius of a shape: 70-90% of half a cell (big enough for a tiny ViT to tell the
    outlines apart), at most half a cell less 1 px."""
    return float(min(cell / 2 * rng.uniform(0.7, 0.9), cell / 2 - 1.0))


def _place(rng: np.random.Generator, cell: int, size: int) -> tuple[list[float], float]:
    """Centre and radius of a shape inside `cell`, jittered but never leaving the cell (a 1 px
    margin keeps anti-aliased edges out of the neighbours)."""
    c = size / GRID
    r = _radius(rng, c)
    slack = max(c / 2 - r - 1.0, 0.0)
    row, col = divmod(cell, GRID)
    cx = (col + 0.5) * c + float(rng.uniform(-slack, slack))
    cy = (row + 0.5) * c + float(rng.uniform(-slack, slack))
    return [round(cx, 3), round(cy, 3)], round(r, 3)


def _pairs_except(rng: np.random.Generator, n: int, reject: Any) -> list[tuple[str, str]]:
    """n distinct (color, shape) pairs, none for which `reject(color, shape)` is true."""
    pool = [(c, s) for c in COLORS for s in SHAPES if not reject(c, s)]
    idx = rng.choice(len(pool), size=n, replace=False)
    return [pool[int(i)] for i in idx]
