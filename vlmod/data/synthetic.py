"""A synthetic image-text set we generate ourselves: coloured shapes on a textured background.

It is the offline quality check of the fine-tuning recipe: a tiny LLaVA can learn it from scratch
on a CPU, and every answer is known exactly, so accuracy before and after MoD conversion means
something. Only the few cells of the image that hold a shape matter for the answer; the rest is a
texture (stripes + noise, different in every image, so background tokens are not constant and a
router has to learn what to skip).

Layout: the image (default 64 x 64 px) is a 3 x 3 grid of cells; each shape sits inside one cell
(never two shapes in a cell), its size 70-90% of the cell, jittered inside it.

Image questions (one question per image, `type` in the record's `meta`), answers in brackets:

=========  ======================================  ===============================================
type       question                                answers
=========  ======================================  ===============================================
color      what color is the {shape} ?             red green blue yellow purple orange
shape      what shape is the {color} object ?      circle square triangle star cross
count      how many objects are there ?            one two three four
position   where is the {color} {shape} ?          top left, top, top right, left, center, right,
                                                   bottom left, bottom, bottom right
=========  ======================================  ===============================================

The object a question names is unique in its image (the only circle, the only red object, the
only red circle); the other shapes are distractors. Colour/shape/position images hold 1-3
shapes (`distractors=2`; 0 gives one-shape scenes, an easier set), count images 1-4.

Video questions (`video=True`; `num_frames` frames, an mp4 per record):

=========  ==================================================  ===========================
direction  which direction is the {color} {shape} moving ?     left right up down
order      is the {color} {shape} before or after the          before after
           {color} {shape} ?
=========  ==================================================  ===========================

A direction video moves one shape across the frame (sometimes with a static distractor in
another row or column); an order video shows one shape in the first half of the frames and
another in the second half.

Answers are balanced: question types take turns, and within a type every answer occurs equally
often (differing by at most one). Every word of the questions and answers is in the vocabulary
of the tiny offline tokenizer (`vlmod.tiny.WORDS`). The same seed gives the same bytes: each
sample draws from its own generator seeded by (seed, split, index), PNGs carry no timestamps,
and the files are written atomically (temp + rename), the JSON last.

Files under `out_dir`: `train.json`, `val.json` (LLaVA format, image paths relative to
`out_dir`), `images/{train,val}/NNNNNN.png`; with video, `video_train.json`, `video_val.json`,
`videos/{train,val}/NNNNNN.mp4`; `meta.json` with the settings, vocabularies and answer counts.
Each record carries `meta`: its question type and the objects drawn (shape, colour, cell,
centre, radius; for videos the first/last centre and visible frames).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlmod.argtypes import non_negative_int

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
ORDERS = ("before", "after")

IMAGE_QUESTION_TYPES = ("color", "shape", "count", "position")
VIDEO_QUESTION_TYPES = ("direction", "order")
ANSWERS: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "count": COUNTS,
    "position": POSITIONS,
    "direction": DIRECTIONS,
    "order": ORDERS,
}
QUESTIONS: dict[str, str] = {
    "color": "what color is the {shape} ?",
    "shape": "what shape is the {color} object ?",
    "count": "how many objects are there ?",
    "position": "where is the {color} {shape} ?",
    "direction": "which direction is the {color} {shape} moving ?",
    "order": "is the {color} {shape} before or after the {color2} {shape2} ?",
}
GRID = 3  # cells per side
MAX_DISTRACTORS = 4
MIN_IMAGE_SIZE = 24
SUPERSAMPLE = 4  # shapes are drawn at 4x and box-filtered down: smooth edges, same bytes every run
VIDEO_FPS = 4
_SPLIT_CODES = {"train": 0, "val": 1}
_KIND_CODES = {"image": 0, "video": 1}
_NAME = re.compile(r"^\d{6}\.(png|mp4)$")


@dataclass
class SyntheticSummary:
    """What `generate` wrote: the JSON files, their record counts and answer counts per type."""

    out_dir: Path
    files: dict[str, Path] = field(default_factory=dict)
    records: dict[str, int] = field(default_factory=dict)
    answer_counts: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"wrote synthetic data to {self.out_dir}"]
        for name, path in self.files.items():
            lines.append(f"  {path.name}: {self.records[name]} records")
            for qtype, counts in self.answer_counts[name].items():
                spread = ", ".join(f"{a}={n}" for a, n in counts.items())
                lines.append(f"    {qtype}: {spread}")
        lines.append(f"  {self.out_dir / 'meta.json'}: settings, question templates, answer vocabularies")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- drawing


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


def shape_alpha(shape: str, cx: float, cy: float, r: float, size: int) -> np.ndarray:
    """Coverage [size, size] in [0, 1] of `shape`, anti-aliased by drawing at SUPERSAMPLE x."""
    from PIL import Image, ImageDraw

    s = SUPERSAMPLE
    canvas = Image.new("L", (size * s, size * s), 0)
    draw = ImageDraw.Draw(canvas)
    pts = [(x * s, y * s) for x, y in shape_points(shape, cx, cy, r)]
    if shape == "circle":
        draw.ellipse(pts, fill=255)
    else:
        draw.polygon(pts, fill=255)
    small = canvas.resize((size, size), Image.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def paint(img: np.ndarray, obj: dict[str, Any]) -> None:
    """Composite one object (shape, color, center, radius) onto `img` in place."""
    size = img.shape[0]
    cx, cy = obj["center"]
    alpha = shape_alpha(obj["shape"], cx, cy, obj["radius"], size)[..., None]
    img *= 1.0 - alpha
    img += alpha * np.asarray(COLORS[obj["color"]], dtype=np.float32)


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


# ----------------------------------------------------------------------------- image samples


def image_sample(
    rng: np.random.Generator, qtype: str, answer: str, size: int, distractors: int = 2
) -> tuple[np.ndarray, str, dict]:
    """(image uint8 [size, size, 3], question, meta) of one image question whose answer is
    `answer`: the scene is built around the answer, so answers can be balanced exactly.
    Colour/shape/position scenes get 0..`distractors` shapes besides the one asked about."""
    if qtype not in IMAGE_QUESTION_TYPES:
        raise ValueError(f"unknown image question type {qtype!r}; types: {', '.join(IMAGE_QUESTION_TYPES)}")
    if answer not in ANSWERS[qtype]:
        raise ValueError(f"{answer!r} is not an answer of {qtype!r} questions: {ANSWERS[qtype]}")
    if not 0 <= distractors <= MAX_DISTRACTORS:
        raise ValueError(f"distractors must be in [0, {MAX_DISTRACTORS}], got {distractors}")
    colors, shapes = list(COLORS), list(SHAPES)
    if qtype == "count":
        n = COUNTS.index(answer) + 1
        pairs = [(colors[int(rng.integers(len(colors)))], shapes[int(rng.integers(len(shapes)))]) for _ in range(n)]
        cells = [int(c) for c in rng.choice(GRID * GRID, size=n, replace=False)]
        question = QUESTIONS["count"]
    else:
        n = int(rng.integers(1, distractors + 2))
        if qtype == "color":
            target = (answer, shapes[int(rng.integers(len(shapes)))])
            others = _pairs_except(rng, n - 1, lambda c, s: s == target[1])
        elif qtype == "shape":
            target = (colors[int(rng.integers(len(colors)))], answer)
            others = _pairs_except(rng, n - 1, lambda c, s: c == target[0])
        else:
            target = (colors[int(rng.integers(len(colors)))], shapes[int(rng.integers(len(shapes)))])
            others = _pairs_except(rng, n - 1, lambda c, s: (c, s) == target)
        pairs = [target, *others]
        if qtype == "position":
            first = POSITIONS.index(answer)
            rest = [c for c in range(GRID * GRID) if c != first]
            cells = [first] + [rest[int(i)] for i in rng.choice(len(rest), size=n - 1, replace=False)]
        else:
            cells = [int(c) for c in rng.choice(GRID * GRID, size=n, replace=False)]
        question = QUESTIONS[qtype].format(color=target[0], shape=target[1])
    img = background(rng, size)
    objects = []
    for (color, shape), cell in zip(pairs, cells, strict=True):
        center, radius = _place(rng, cell, size)
        obj = {"shape": shape, "color": color, "cell": cell, "center": center, "radius": radius}
        paint(img, obj)
        objects.append(obj)
    meta = {"type": qtype, "objects": objects}
    if qtype != "count":
        meta["target"] = 0
    return to_uint8(img), question, meta


# ----------------------------------------------------------------------------- video samples


def video_sample(
    rng: np.random.Generator, qtype: str, answer: str, size: int, num_frames: int
) -> tuple[np.ndarray, str, dict]:
    """(frames uint8 [T, size, size, 3], question, meta) of one video question with `answer`."""
    if qtype not in VIDEO_QUESTION_TYPES:
        raise ValueError(f"unknown video question type {qtype!r}; types: {', '.join(VIDEO_QUESTION_TYPES)}")
    if answer not in ANSWERS[qtype]:
        raise ValueError(f"{answer!r} is not an answer of {qtype!r} questions: {ANSWERS[qtype]}")
    if num_frames < 2:
        raise ValueError(f"a video needs at least 2 frames, got num_frames={num_frames}")
    c = size / GRID
    bg = background(rng, size)
    frame_noise = [rng.normal(0.0, 4.0, size=bg.shape).astype(np.float32) for _ in range(num_frames)]
    frames = [bg + noise for noise in frame_noise]
    if qtype == "direction":
        (color, shape), (color2, shape2) = _pairs_except(rng, 2, lambda c_, s_: False)
        r = _radius(rng, c)
        horizontal = answer in ("left", "right")
        lane = int(rng.integers(GRID))  # the row (or column) the shape travels along
        slack = max(c / 2 - r - 1.0, 0.0)
        across = (lane + 0.5) * c + float(rng.uniform(-slack, slack))
        lo, hi = r + 1.0, size - r - 1.0
        start, end = (lo, hi) if answer in ("right", "down") else (hi, lo)
        path = np.linspace(start, end, num_frames)
        centers = [[float(p), across] if horizontal else [across, float(p)] for p in path]
        target = {"shape": shape, "color": color, "radius": round(r, 3), "frames": [0, num_frames - 1],
                  "start": [round(v, 3) for v in centers[0]], "end": [round(v, 3) for v in centers[-1]]}
        objects = [target]
        for t, center in enumerate(centers):
            paint(frames[t], {"shape": shape, "color": color, "center": center, "radius": r})
        if rng.random() < 0.5:  # a static distractor in another lane
            other_lane = [x for x in range(GRID) if x != lane][int(rng.integers(GRID - 1))]
            along = int(rng.integers(GRID))
            cell = other_lane * GRID + along if horizontal else along * GRID + other_lane
            center2, r2 = _place(rng, cell, size)
            still = {"shape": shape2, "color": color2, "center": center2, "radius": r2}
            for frame in frames:
                paint(frame, still)
            objects.append({**still, "cell": cell, "frames": [0, num_frames - 1],
                            "start": center2, "end": center2})
        question = QUESTIONS["direction"].format(color=color, shape=shape)
    else:
        (color, shape), (color2, shape2) = _pairs_except(rng, 2, lambda c_, s_: False)
        cells = [int(x) for x in rng.choice(GRID * GRID, size=2, replace=False)]
        half = num_frames // 2
        spans = [(0, half), (half, num_frames)]
        objects = []
        for (col, shp), cell, (a, b) in zip([(color, shape), (color2, shape2)], cells, spans, strict=True):
            center, r = _place(rng, cell, size)
            obj = {"shape": shp, "color": col, "center": center, "radius": r}
            for t in range(a, b):
                paint(frames[t], obj)
            objects.append({**obj, "cell": cell, "frames": [a, b - 1], "start": center, "end": center})
        # objects[0] is shown first: asking about it gives "before", about the other "after".
        first, second = (objects[0], objects[1]) if answer == "before" else (objects[1], objects[0])
        question = QUESTIONS["order"].format(
            color=first["color"], shape=first["shape"], color2=second["color"], shape2=second["shape"]
        )
    meta = {"type": qtype, "objects": objects, "target": 0}
    return np.stack([to_uint8(f) for f in frames]), question, meta


# ----------------------------------------------------------------------------- writing


def _balanced_plan(rng: np.random.Generator, n: int, qtypes: Sequence[str]) -> list[tuple[str, str]]:
    """(type, answer) for n samples: types take turns, answers within a type are equally often
    (at most one apart) in a seeded random order."""
    per_type: dict[str, list[str]] = {}
    for t in qtypes:
        count = len(range(qtypes.index(t), n, len(qtypes)))
        answers = [ANSWERS[t][k % len(ANSWERS[t])] for k in range(count)]
        per_type[t] = [answers[int(i)] for i in rng.permutation(count)]
    cursor = dict.fromkeys(qtypes, 0)
    plan = []
    for i in range(n):
        t = qtypes[i % len(qtypes)]
        plan.append((t, per_type[t][cursor[t]]))
        cursor[t] += 1
    return plan


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_png(path: Path, img: np.ndarray) -> None:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", optimize=False, compress_level=6)
    _write_bytes(path, buf.getvalue())


def _write_json(path: Path, obj: Any) -> None:
    _write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"))


def _write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """A JSON list with one record per line: valid JSON, and still readable with `head`."""
    text = "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n" if records else "[]\n"
    _write_bytes(path, text.encode("utf-8"))


def _remove_stale(folder: Path, keep: set[str]) -> None:
    """Drop files of an earlier, larger run (our NNNNNN.png/mp4 names only) from `folder`."""
    if folder.is_dir():
        for p in folder.iterdir():
            if p.is_file() and _NAME.match(p.name) and p.name not in keep:
                p.unlink()


def _split_records(
    out_dir: Path,
    kind: str,
    split: str,
    n: int,
    qtypes: Sequence[str],
    size: int,
    seed: int,
    num_frames: int,
    distractors: int,
    bar: Any,
) -> list[dict[str, Any]]:
    plan_rng = np.random.default_rng([seed, _SPLIT_CODES[split], _KIND_CODES[kind], 2**31])
    plan = _balanced_plan(plan_rng, n, qtypes)
    folder = out_dir / ("images" if kind == "image" else "videos") / split
    folder.mkdir(parents=True, exist_ok=True)
    records, names = [], set()
    for i, (qtype, answer) in enumerate(plan):
        rng = np.random.default_rng([seed, _SPLIT_CODES[split], _KIND_CODES[kind], i])
        prefix = "" if kind == "image" else "video-"
        record: dict[str, Any] = {"id": f"{prefix}{split}-{i:06d}"}
        if kind == "image":
            img, question, meta = image_sample(rng, qtype, answer, size, distractors)
            name = f"{i:06d}.png"
            _write_png(folder / name, img)
            record["image"] = f"images/{split}/{name}"
            media_token = "<image>"
        else:
            from vlmod.video import write_video

            frames, question, meta = video_sample(rng, qtype, answer, size, num_frames)
            name = f"{i:06d}.mp4"
            write_video(folder / name, frames, fps=VIDEO_FPS)
            record["video"] = f"videos/{split}/{name}"
            media_token = "<video>"
        names.add(name)
        record["conversations"] = [
            {"from": "human", "value": f"{media_token}\n{question}"},
            {"from": "gpt", "value": answer},
        ]
        record["meta"] = meta
        records.append(record)
        bar.update(1)
    _remove_stale(folder, names)
    return records


def _answer_counts(records: list[dict[str, Any]], qtypes: Sequence[str]) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = {t: Counter() for t in qtypes}
    for r in records:
        counts[r["meta"]["type"]][r["conversations"][-1]["value"]] += 1
    return {t: {a: counts[t][a] for a in ANSWERS[t]} for t in qtypes}


def _check_types(types: Sequence[str], valid: Sequence[str], what: str) -> tuple[str, ...]:
    types = tuple(types)
    bad = [t for t in types if t not in valid]
    if bad or not types or len(set(types)) != len(types):
        raise ValueError(f"{what} question types must be distinct names out of {', '.join(valid)}, got {types}")
    return types


def generate(
    out_dir: str | Path,
    num_train: int,
    num_val: int,
    image_size: int = 64,
    seed: int = 0,
    video: bool = False,
    num_videos: int = 200,
    num_val_videos: int | None = None,
    num_frames: int = 8,
    question_types: Sequence[str] = IMAGE_QUESTION_TYPES,
    video_question_types: Sequence[str] = VIDEO_QUESTION_TYPES,
    distractors: int = 2,
    progress: bool = False,
) -> SyntheticSummary:
    """Write the synthetic set to `out_dir` (see the module doc) and say what was written.

    `num_videos` train videos and `num_val_videos` (default: a tenth, at least 1) validation
    videos are written only with `video=True`, to their own JSON files, so the image files stay
    usable by image-only LLaVA models. `distractors` (0..4) caps the extra shapes of colour,
    shape and position scenes: 0 makes single-shape scenes, an easier set. Same arguments, same
    bytes."""
    for name, value in (("num_train", num_train), ("num_val", num_val)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE} px (a {GRID}x{GRID} grid of shapes), got {image_size}")
    if not 0 <= distractors <= MAX_DISTRACTORS:
        raise ValueError(f"distractors must be in [0, {MAX_DISTRACTORS}], got {distractors}")
    qtypes = _check_types(question_types, IMAGE_QUESTION_TYPES, "image")
    vtypes = _check_types(video_question_types, VIDEO_QUESTION_TYPES, "video")
    if video:
        if num_videos < 0:
            raise ValueError(f"num_videos must be >= 0, got {num_videos}")
        if num_val_videos is None:
            num_val_videos = max(1, num_videos // 10) if num_videos else 0
        if num_val_videos < 0:
            raise ValueError(f"num_val_videos must be >= 0, got {num_val_videos}")
        if num_frames < 2:
            raise ValueError(f"num_frames must be >= 2 for a moving object, got {num_frames}")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    video_size = image_size // 2 * 2  # H.264 wants even sides
    jobs = [("image", "train", num_train, qtypes, image_size), ("image", "val", num_val, qtypes, image_size)]
    if video:
        jobs += [("video", "train", num_videos, vtypes, video_size), ("video", "val", num_val_videos, vtypes, video_size)]
    from tqdm.auto import tqdm

    summary = SyntheticSummary(out_dir=out)
    splits: dict[str, Any] = {}
    total = sum(j[2] for j in jobs)
    with tqdm(total=total, desc="synthetic", unit="sample", disable=not progress) as bar:
        for kind, split, n, types, size in jobs:
            records = _split_records(out, kind, split, n, types, size, seed, num_frames, distractors, bar)
            name = split if kind == "image" else f"video_{split}"
            path = out / f"{name}.json"
            _write_records(path, records)
            summary.files[name] = path
            summary.records[name] = len(records)
            summary.answer_counts[name] = _answer_counts(records, types)
            splits[name] = {"file": path.name, "records": len(records), "answer_counts": summary.answer_counts[name]}
    meta = {
        "generator": "vlmod.data.synthetic",
        "seed": seed,
        "image_size": image_size,
        "grid": GRID,
        "distractors": distractors,
        "num_frames": num_frames if video else None,
        "video_fps": VIDEO_FPS if video else None,
        "question_types": list(qtypes),
        "video_question_types": list(vtypes) if video else [],
        "questions": QUESTIONS,
        "answers": {k: list(v) for k, v in ANSWERS.items()},
        "colors": {k: list(v) for k, v in COLORS.items()},
        "splits": splits,
    }
    _write_json(out / "meta.json", meta)
    return summary


# ----------------------------------------------------------------------------- command line




def add_make_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `scripts/make_synthetic_data.py` (and `vlmod data synthetic`); sets
    `run=run_make_data` as default."""
    parser.add_argument("--out", default="data/synthetic", help="output folder (default: data/synthetic)")
    parser.add_argument("--train", type=non_negative_int, default=2000, help="train images (default: 2000)")
    parser.add_argument("--val", type=non_negative_int, default=200, help="validation images (default: 200)")
    parser.add_argument(
        "--image-size", type=int, default=64, help=f"image side in px, >= {MIN_IMAGE_SIZE} (default: 64)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed; the same seed writes the same bytes (default: 0)")
    parser.add_argument(
        "--types",
        default=",".join(IMAGE_QUESTION_TYPES),
        help=f"comma-separated image question types (default: {','.join(IMAGE_QUESTION_TYPES)})",
    )
    parser.add_argument(
        "--distractors",
        type=non_negative_int,
        default=2,
        help=f"at most this many extra shapes in colour/shape/position images, 0..{MAX_DISTRACTORS} "
        "(default: 2; 0 = one shape per image, an easier set)",
    )
    parser.add_argument("--video", action="store_true", help="also write the video set (video_train/val.json)")
    parser.add_argument("--videos", type=non_negative_int, default=200, help="train videos (default: 200)")
    parser.add_argument(
        "--val-videos", type=non_negative_int, default=None, help="validation videos (default: a tenth of --videos)"
    )
    parser.add_argument("--frames", type=int, default=8, help="frames per video (default: 8)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_make_data)
    return parser


def run_make_data(args: argparse.Namespace) -> int:
    """Generate the set from parsed flags and print what was written; bad values are one
    `error:` line and exit status 2."""
    try:
        summary = generate(
            args.out,
            args.train,
            args.val,
            image_size=args.image_size,
            seed=args.seed,
            video=args.video,
            num_videos=args.videos,
            num_val_videos=args.val_videos,
            num_frames=args.frames,
            distractors=args.distractors,
            question_types=[t.strip() for t in args.types.split(",") if t.strip()],
            progress=not args.no_progress,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.describe())
    return 0
