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
shapes (`distractors=2`; 0 gives one-shape scenes, an easier set), count images 1-4. With
`faint`, that share of the colour, count and position pictures (FAINT_TYPES) draws every shape at
a contrast uniform in the video set's faint range (FAINT_CONTRAST): the set gets room above, graded
by what can be seen through the noise, as the video set's faint clips give it (each faint object's
meta carries its `contrast`). The shape question is asked of solid pictures only: at 32 px a faint
outline is past what the model resolves (dense 25-55% on faint shape pictures), and answering them
cost the solid ones too (shape 86-90% on solid pictures with a fifth of every type faint, 99% with none).

Video questions (`video=True`; `num_frames` frames, an mp4 per record): direction, first
(which shape appears first), distinct (how many different shapes), when (start / middle / end),
last (which shape appears last), and single-frame colour and shape questions asked about a clip; see
`vlmod.data.synthetic_video`. The vocabulary and drawing live in `vlmod.data.scenes`.

Answers are balanced: question types take turns, and within a type every answer occurs equally
often (differing by at most one). Every word of the questions and answers is in the vocabulary
of the tiny offline tokenizer (`vlmod.models.tiny.WORDS`). The same seed gives the same bytes: each
sample draws from its own generator seeded by (seed, split, index), PNGs carry no timestamps,
and the files are written atomically (temp + rename), the JSON last.

Files under `out_dir`: `train.json`, `val.json` (LLaVA format, image paths relative to
`out_dir`), `images/{train,val}/NNNNNN.png`; with video, `video_train.json`, `video_val.json`,
`videos/{train,val}/NNNNNN.mp4`; `meta.json` with the settings, vocabularies and answer counts.
Each record carries `meta`: its question type and the objects drawn (shape, colour, cell,
centre, radius; for videos the first/last centre and visible frames).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlmod.data.scenes import (
    ANSWERS,
    COLORS,
    COUNTS,
    GRID,
    IMAGE_QUESTION_TYPES,
    MAX_DISTRACTORS,
    MIN_IMAGE_SIZE,
    POSITIONS,
    QUESTIONS,
    SHAPES,
    THIRDS,
    _pairs_except,
    _place,
    background,
    cell_of,
    faint_contrast,
    paint,
    shape_alpha,
    shape_points,
    to_uint8,
)
from vlmod.data.synthetic_video import FAINT_CONTRAST, TEMPORAL_TYPES, VIDEO_QUESTION_TYPES, video_sample
from vlmod.errors import InputError

VIDEO_FPS = 4
_SPLIT_CODES = {"train": 0, "val": 1}
_KIND_CODES = {"image": 0, "video": 1}
_NAME = re.compile(r"^\d{6}\.(png|mp4)$")
# The question types whose pictures `faint` may draw faint (shape: solid only, the module's note).
FAINT_TYPES = ("color", "count", "position")


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

# ----------------------------------------------------------------------------- image samples


def image_sample(
    rng: np.random.Generator, qtype: str, answer: str, size: int, distractors: int = 2, contrast: float = 1.0
) -> tuple[np.ndarray, str, dict]:
    """(image uint8 [size, size, 3], question, meta) of one image question whose answer is
    `answer`: the scene is built around the answer, so answers can be balanced exactly.
    Colour/shape/position scenes get 0..`distractors` shapes besides the one asked about;
    `contrast`: every shape's (1: solid; below, faint, each object's meta records it)."""
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
        obj = {"shape": shape, "color": color, "cell": cell, "center": center, "radius": radius,
               **({"contrast": contrast} if contrast != 1.0 else {})}
        paint(img, obj)
        objects.append(obj)
    meta = {"type": qtype, "objects": objects}
    if qtype != "count":
        meta["target"] = 0
    return to_uint8(img), question, meta

# ----------------------------------------------------------------------------- writing


def _balanced_plan(rng: np.random.Generator, n: int, qtypes: Sequence[str],
                   vocab: dict[str, tuple[str, ...]] = ANSWERS) -> list[tuple[str, str]]:
    """(type, answer) for n samples: types take turns, answers within a type (out of `vocab`)
    are equally often (at most one apart) in a seeded random order."""
    per_type: dict[str, list[str]] = {}
    for t in qtypes:
        count = len(range(qtypes.index(t), n, len(qtypes)))
        answers = [vocab[t][k % len(vocab[t])] for k in range(count)]
        per_type[t] = [answers[int(i)] for i in rng.permutation(count)]
    cursor = dict.fromkeys(qtypes, 0)
    plan = []
    for i in range(n):
        t = qtypes[i % len(qtypes)]
        plan.append((t, per_type[t][cursor[t]]))
        cursor[t] += 1
    return plan


def _write_bytes(path: Path, data: bytes) -> None:
    """`data` to `path` through a temp file and a rename: a full disk leaves no half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    faint: float = 0.0,
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
            # Its own stream (a picture is the same but for its contrast), as the fine-detail set's.
            contrast = faint_contrast(np.random.default_rng([seed, _SPLIT_CODES[split], _KIND_CODES[kind], i, 3]),
                                      faint if qtype in FAINT_TYPES else 0.0, FAINT_CONTRAST)
            img, question, meta = image_sample(rng, qtype, answer, size, distractors, contrast)
            name = f"{i:06d}.png"
            _write_png(folder / name, img)
            record["image"] = f"images/{split}/{name}"
            media_token = "<image>"
        else:
            from vlmod.data.video import write_video

            frames, question, meta = video_sample(rng, qtype, answer, size, num_frames)
            name = f"{i:06d}.mp4"
            write_video(folder / name, frames, fps=VIDEO_FPS, lossless=True)
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


def _third(first: int, last: int, num_frames: int) -> str:
    """start / middle / end: the third of the clip that holds the middle of frames [first, last]."""
    return THIRDS[min(2, int(3 * (first + last + 1) / 2 / num_frames))]


def caption(meta: dict[str, Any], num_frames: int | None = None) -> str:
    """Every object of a sample in words: a picture's in reading order ("red circle top left ,
    blue star center"), a clip's in order of appearance, with how it moves or when it is shown
    ("red circle start , blue cross moving left")."""
    objects = meta["objects"]
    if num_frames is None:
        return " , ".join(f"{o['color']} {o['shape']} {POSITIONS[o['cell']]}" for o in sorted(objects, key=lambda o: o["cell"]))
    words = []
    for o in sorted(objects, key=lambda o: (o["frames"][0], o.get("cell", -1))):
        (x0, y0), (x1, y1), (a, b) = o["start"], o["end"], o["frames"]
        if (x0, y0) != (x1, y1):
            how = "moving " + (("right" if x1 > x0 else "left") if abs(x1 - x0) > abs(y1 - y0) else ("down" if y1 > y0 else "up"))
        else:
            how = "" if (a, b) == (0, num_frames - 1) else _third(a, b, num_frames)
        words.append(f"{o['color']} {o['shape']} {how}".strip())
    return " , ".join(words)


def _caption_records(records: list[dict[str, Any]], num_frames: int | None,
                     describe: Callable[[dict[str, Any]], str] | None = None) -> list[dict[str, Any]]:
    """One caption record per record, on the same picture or clip (training only: every object
    named in every sample is the dense supervision a tiny model learns to see from); `describe`:
    its text from the record's meta (default: `caption`)."""
    kind = "image" if num_frames is None else "video"
    return [{
        "id": f"caption-{r['id']}",
        kind: r[kind],
        "conversations": [{"from": "human", "value": f"<{kind}>\ndescribe the {kind} ."},
                          {"from": "gpt", "value": (describe or (lambda m: caption(m, num_frames)))(r["meta"])}],
        "meta": {"type": "caption", "objects": r["meta"]["objects"]},
    } for r in records]


def _answer_counts(records: list[dict[str, Any]], qtypes: Sequence[str],
                   vocab: Mapping[str, Sequence[str]] = ANSWERS) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = {t: Counter() for t in qtypes}
    for r in records:
        counts[r["meta"]["type"]][r["conversations"][-1]["value"]] += 1
    return {t: {a: counts[t][a] for a in vocab[t]} for t in qtypes}


def check_types(types: Sequence[str], valid: Sequence[str], what: str, flag: str = "--types") -> tuple[str, ...]:
    """The question types asked for, as a tuple; InputError (one line, naming `flag`) unless they are
    distinct names out of `valid`."""
    types = tuple(types)
    bad = [t for t in types if t not in valid]
    if bad or not types or len(set(types)) != len(types):
        raise InputError(f"{flag} takes distinct {what} question types out of {','.join(valid)}, got "
                         f"{','.join(types) or '(none)'}")
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
    captions: bool = False,
    faint: float = 0.0,
    progress: bool = False,
) -> SyntheticSummary:
    """Write the synthetic set to `out_dir` (see the module doc) and say what was written.

    `num_videos` train videos and `num_val_videos` (default: a tenth, at least 1) validation
    videos are written only with `video=True`, to their own JSON files, so the image files stay
    usable by image-only LLaVA models. `distractors` (0..4) caps the extra shapes of colour,
    shape and position scenes: 0 makes single-shape scenes, an easier set. `captions`: each
    training split also gets a caption record per sample (`caption`; validation stays
    questions). `faint`: the share of the colour, count and position pictures (of each image split,
    FAINT_TYPES) whose shapes are drawn at a contrast uniform in FAINT_CONTRAST, the video set's faint clips' range (the clips draw their
    own fifth: `synthetic_video.FAINT_SHARE`). With `video`, an image split of 0 samples is not
    written. Same arguments, same bytes."""
    for name, value in (("num_train", num_train), ("num_val", num_val)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE} px (a {GRID}x{GRID} grid of shapes), got {image_size}")
    if not 0 <= distractors <= MAX_DISTRACTORS:
        raise ValueError(f"distractors must be in [0, {MAX_DISTRACTORS}], got {distractors}")
    if not 0.0 <= faint <= 1.0:
        raise ValueError(f"faint is the share of pictures drawn faint, 0 to 1, got {faint}")
    qtypes = check_types(question_types, IMAGE_QUESTION_TYPES, "image")
    vtypes = check_types(video_question_types, VIDEO_QUESTION_TYPES, "video", flag="video_question_types")
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
        # An image split of no samples beside the clips is not written: an empty val.json next to
        # video_val.json only made `vlmod eval --data .../val.json` fail on the video recipe's folder.
        jobs = [j for j in jobs if j[2]]
        jobs += [("video", "train", num_videos, vtypes, video_size), ("video", "val", num_val_videos, vtypes, video_size)]
    from tqdm.auto import tqdm

    summary = SyntheticSummary(out_dir=out)
    splits: dict[str, Any] = {}
    total = sum(j[2] for j in jobs)
    with tqdm(total=total, desc="synthetic", unit="sample", disable=not progress) as bar:
        for kind, split, n, types, size in jobs:
            records = _split_records(out, kind, split, n, types, size, seed, num_frames, distractors, bar,
                                     faint if kind == "image" else 0.0)
            name = split if kind == "image" else f"video_{split}"
            path = out / f"{name}.json"
            summary.answer_counts[name] = _answer_counts(records, types)
            if captions and split == "train":
                records += _caption_records(records, None if kind == "image" else num_frames)
            _write_records(path, records)
            summary.files[name] = path
            summary.records[name] = len(records)
            splits[name] = {"file": path.name, "records": len(records), "answer_counts": summary.answer_counts[name]}
    meta = {
        "generator": "vlmod.data.synthetic",
        "seed": seed,
        "image_size": image_size,
        "grid": GRID,
        "distractors": distractors,
        "captions": captions,
        **({"faint": faint, "faint_contrast": list(FAINT_CONTRAST), "faint_types": list(FAINT_TYPES)} if faint else {}),
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


__all__ = [
    "ANSWERS", "COLORS", "FAINT_CONTRAST", "IMAGE_QUESTION_TYPES", "QUESTIONS", "SHAPES", "TEMPORAL_TYPES", "VIDEO_FPS",
    "VIDEO_QUESTION_TYPES", "SyntheticSummary", "background", "caption", "cell_of", "generate",
    "image_sample", "paint", "shape_alpha", "shape_points", "video_sample",
]
