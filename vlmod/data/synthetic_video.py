"""Clip questions of the synthetic set: most need several frames, a few only one.

A method that throws frames or video tokens away is tested by the temporal types: no single
frame answers them.

==========  =====================================================  ===========================
type        question                                               answers
==========  =====================================================  ===========================
direction   which direction is the {color} {shape} moving ?        left right up down
first       which shape appears first ?                            circle square triangle star
                                                                   cross
distinct    how many different shapes appear in the video ?        one two three four
when        when does the {color} {shape} appear : start ,         start middle end
            middle or end ?
last        which shape appears last ?                             circle square triangle star
                                                                   cross
color       what color is the {shape} ?  (one frame is enough)     the six colours
shape       what shape is the {color} object ?  (one frame)        the five shapes
==========  =====================================================  ===========================

- direction: one shape crosses the frame (sometimes a static distractor in another lane).
- first: 3-4 shapes of different kinds in consecutive spans; the answer is the kind shown first.
- distinct: n shapes of n different kinds, each shown alone in its own consecutive span of
  frames (so no frame holds more than one): counting them needs every span.
- when: the shape asked about is shown in one third of the clip (start, middle or end); often
  a static distractor is shown in every frame, so the answer is the third where the named object
  comes and goes, not where anything is shown. (A distractor in another third, as before, asked
  the tiny model to bind an object to its time by colour: seed 1 answered such clips at 51.6%, a
  coin between the two thirds, and the lone-object ones at 100%: docs/data.md.)
- last: 3-4 shapes of different kinds in consecutive spans; the answer is the kind shown last.
  (With 3-4 spans the middle frame shows neither the first shape nor the last: a model shown one
  frame cannot answer `first` or `last` from it. With 2, as `last` had, it showed the last.)
- color / shape: a static object, alone, in every frame.

An object a question names is the only one of its colour in the clip (a distractor never shares
it), and a colour or shape question's clip holds no distractor: finding an object by a word and
reporting another of its attributes is a lottery for the recipe's tiny language model (colour
questions with a distractor: 74-77% on seeds 0 and 1; shape questions with one: 91.4%, then 75.8%
on seed 1 and 74.4% on seed 0, chance on the half with a distractor; `order`, "is the X before or
after the Y ?", answered on seed 0 and at chance on seed 1: docs/data.md). `first` replaced
`order`: the mirror of `last`, which the model learns on every seed.

Faint clips give the set room above: FAINT_SHARE of the clips draw every object at a contrast
(its coverage's scale) uniform in FAINT_CONTRAST, the rest at full contrast. Below some contrast
no model reads a shape through the noise, above it every one does; in between a method that drops
the few tokens of a faint object loses the answer. Every type is graded by what the eye can see,
not by a binding the model may never find (meta: each object's `contrast`).

Every frame gets its own noise over one background, so skipping a frame is never free.
"""

from __future__ import annotations

import numpy as np

from vlmod.data.scenes import (
    ANSWERS,
    GRID,
    QUESTIONS,
    SHAPES,
    _pairs_except,
    _place,
    _radius,
    background,
    faint_contrast,
    paint,
    to_uint8,
)

VIDEO_QUESTION_TYPES = ("direction", "first", "distinct", "when", "last", "color", "shape")
TEMPORAL_TYPES = ("direction", "first", "distinct", "when", "last")
FAINT_SHARE = 0.2  # of the clips, drawn faint
FAINT_CONTRAST = (0.03, 0.3)  # a faint clip's contrast, uniform in this range


def _spans(num_frames: int, parts: int) -> list[tuple[int, int]]:
    """`parts` consecutive, near-equal [start, end) spans covering the frames."""
    edges = np.linspace(0, num_frames, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _show(frames: list[np.ndarray], obj: dict, span: tuple[int, int]) -> dict:
    """Paint a static `obj` (its `contrast` included) into frames [a, b); its meta record."""
    a, b = span
    for t in range(a, b):
        paint(frames[t], obj)
    return {**obj, "frames": [a, b - 1], "start": obj["center"], "end": obj["center"]}


def _cells(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.choice(GRID * GRID, size=n, replace=False)]


def _named_and_distractor(rng: np.random.Generator) -> list[tuple[str, str]]:
    """Two (color, shape) pairs: an object a question names, and a distractor of another colour."""
    named = _pairs_except(rng, 1, lambda c_, s_: False)[0]
    return [named, _pairs_except(rng, 1, lambda c_, s_: c_ == named[0])[0]]


def _distinct_kinds(rng: np.random.Generator, n: int, first: str | None = None,
                    last: str | None = None) -> list[tuple[str, str]]:
    """n (color, shape) pairs of n different shapes (the first one of shape `first`, the last one of
    shape `last`, if given)."""
    others = [s for s in SHAPES if s not in (first, last)]
    kinds = [others[int(i)] for i in rng.choice(len(others), size=n - (first is not None) - (last is not None),
                                                replace=False)]
    kinds = [first] * (first is not None) + kinds + [last] * (last is not None)
    colors = list(ANSWERS["color"])
    return [(colors[int(rng.integers(len(colors)))], s) for s in kinds]


def video_sample(
    rng: np.random.Generator, qtype: str, answer: str, size: int, num_frames: int
) -> tuple[np.ndarray, str, dict]:
    """(frames uint8 [T, size, size, 3], question, meta) of one clip question with `answer`."""
    if qtype not in VIDEO_QUESTION_TYPES:
        raise ValueError(f"unknown video question type {qtype!r}; types: {', '.join(VIDEO_QUESTION_TYPES)}")
    if answer not in ANSWERS[qtype]:
        raise ValueError(f"{answer!r} is not an answer of {qtype!r} questions: {ANSWERS[qtype]}")
    min_frames = 4 if qtype in ("distinct", "first", "last") else 3 if qtype == "when" else 2
    if num_frames < min_frames:
        raise ValueError(f"a {qtype!r} clip needs at least {min_frames} frames, got num_frames={num_frames}")
    c = size / GRID
    bg = background(rng, size)
    frames = [bg + rng.normal(0.0, 4.0, size=bg.shape).astype(np.float32) for _ in range(num_frames)]
    everything = (0, num_frames)
    k = faint_contrast(rng, FAINT_SHARE, FAINT_CONTRAST)  # every object's contrast
    if qtype == "direction":
        (color, shape), (color2, shape2) = _named_and_distractor(rng)
        r = _radius(rng, c)
        horizontal = answer in ("left", "right")
        lane = int(rng.integers(GRID))  # the row (or column) the shape travels along
        slack = max(c / 2 - r - 1.0, 0.0)
        across = (lane + 0.5) * c + float(rng.uniform(-slack, slack))
        lo, hi = r + 1.0, size - r - 1.0
        start, end = (lo, hi) if answer in ("right", "down") else (hi, lo)
        path = np.linspace(start, end, num_frames)
        centers = [[float(p), across] if horizontal else [across, float(p)] for p in path]
        objects = [{"shape": shape, "color": color, "radius": round(r, 3), "contrast": k, "frames": [0, num_frames - 1],
                    "start": [round(v, 3) for v in centers[0]], "end": [round(v, 3) for v in centers[-1]]}]
        for t, center in enumerate(centers):
            paint(frames[t], {"shape": shape, "color": color, "center": center, "radius": r, "contrast": k})
        if rng.random() < 0.5:  # a static distractor in another lane
            other_lane = [x for x in range(GRID) if x != lane][int(rng.integers(GRID - 1))]
            along = int(rng.integers(GRID))
            cell = other_lane * GRID + along if horizontal else along * GRID + other_lane
            center2, r2 = _place(rng, cell, size)
            objects.append({**_show(frames, {"shape": shape2, "color": color2, "center": center2, "radius": r2,
                                             "contrast": k}, everything), "cell": cell})
        question = QUESTIONS["direction"].format(color=color, shape=shape)
    elif qtype in ("distinct", "first", "last"):
        n = ANSWERS["distinct"].index(answer) + 1 if qtype == "distinct" else int(rng.integers(3, 5))
        kinds = _distinct_kinds(rng, n, first=answer if qtype == "first" else None,
                                last=answer if qtype == "last" else None)
        objects = []
        for (col, shp), cell, span in zip(kinds, _cells(rng, n), _spans(num_frames, n), strict=True):
            center, r = _place(rng, cell, size)
            objects.append({**_show(frames, {"shape": shp, "color": col, "center": center, "radius": r, "contrast": k},
                                    span), "cell": cell})
        question = QUESTIONS[qtype]
    elif qtype == "when":
        thirds = _spans(num_frames, 3)
        which = ANSWERS["when"].index(answer)
        pairs = _named_and_distractor(rng)
        cells = _cells(rng, 2)
        center, r = _place(rng, cells[0], size)
        objects = [{**_show(frames, {"shape": pairs[0][1], "color": pairs[0][0], "center": center, "radius": r,
                                     "contrast": k}, thirds[which]), "cell": cells[0]}]
        if rng.random() < 0.7:  # a static distractor in every frame: the named object is the one that comes and goes
            center2, r2 = _place(rng, cells[1], size)
            objects.append({**_show(frames, {"shape": pairs[1][1], "color": pairs[1][0], "center": center2,
                                             "radius": r2, "contrast": k}, everything), "cell": cells[1]})
        question = QUESTIONS["when"].format(color=pairs[0][0], shape=pairs[0][1])
    else:  # color / shape of a static object: any one frame answers
        target = (answer, None) if qtype == "color" else (None, answer)
        (color, shape) = _pairs_except(rng, 1, lambda c_, s_: (target[0] or c_) != c_ or (target[1] or s_) != s_)[0]
        cell = _cells(rng, 1)[0]
        center, r = _place(rng, cell, size)
        objects = [{**_show(frames, {"shape": shape, "color": color, "center": center, "radius": r, "contrast": k},
                            everything), "cell": cell}]
        question = QUESTIONS[qtype].format(color=color, shape=shape)
    meta = {"type": qtype, "objects": objects, "target": len(objects) - 1 if qtype in ("distinct", "last") else 0}
    return np.stack([to_uint8(f) for f in frames]), question, meta


__all__ = ["TEMPORAL_TYPES", "VIDEO_QUESTION_TYPES", "video_sample"]
