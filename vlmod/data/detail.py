"""A fine-detail image set: the answer sits in a few patches of a busy picture.

The shapes set (`vlmod.data.synthetic`) is saturated: its answer is one large shape, so every
method that keeps that shape's tokens wins. Here the answer rests on at most `MAX_ANSWER_SHARE`
(5%) of the vision tokens, as on the text-rich benchmarks (TextVQA, OCR sets) where
training-free pruning loses most: one 5 x 7 px digit of a few to read, or a few 4 px markers to
count, in a busy picture of 4-6 large coloured shapes, 5-8 other coloured digits and other small
markers on the shapes set's striped, noisy background.

=============  ==========================================  ======================================
type           question                                    answers
=============  ==========================================  ======================================
digit          what is the {color} number ?                zero ... nine
count_small    how many small {color} objects are there ?  zero one two three four
small_color    what color is the {digit} ?                 red green blue yellow purple orange
=============  ==========================================  ======================================

The question names its item uniquely (the only digit of that colour, the only glyph of that
digit, the only small things of that colour), so the other digits and markers are clutter as
salient as the answer: a ranking that does not read the question keeps them as readily. Each
glyph or marker lies inside one cell (the picture's grid of `patch_size` cells, or of scale x scale
patches with `scale`, which draws them that many times larger) that no large shape touches, and no
two touch, so the answer's patches are known from the drawing:
every record's `meta` carries `answer_boxes` (pixel boxes) and `answer_patches` (row-major patch
indices at the set's patch size); `answer_share` gives their share of the vision tokens at any
resolution. Digits are drawn from a hand-made 5 x 7 bitmap font (scaled by patch_size // 8), so
no TrueType font is involved.

`faint` draws a share of the pictures with every glyph and marker at a low contrast (as the video
set's faint clips): what decides those is what can be seen, not a binding the model may never find.

Answers are balanced within each type and types take turns (`synthetic._balanced_plan`); the
same seed gives the same bytes; files as the shapes set writes them (`train.json`, `val.json`,
`images/{train,val}/NNNNNN.png`, `meta.json`), each record's `meta.objects` the shapes drawn
(large ones and markers, as the tower pretraining reads them) and `meta.glyphs` every digit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlmod.data.scenes import (
    COLORS,
    COUNTS,
    SHAPES,
    background,
    composite,
    faint_contrast,
    shape_alpha,
    to_uint8,
)
from vlmod.errors import InputError

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DETAIL_TYPES = ("digit", "count_small", "small_color")
DETAIL_ANSWERS: dict[str, tuple[str, ...]] = {
    "digit": DIGITS,
    "count_small": ("zero", *COUNTS),
    "small_color": tuple(COLORS),
}
DETAIL_QUESTIONS: dict[str, str] = {
    "digit": "what is the {color} number ?",
    "count_small": "how many small {color} objects are there ?",
    "small_color": "what color is the {digit} ?",
}
MAX_ANSWER_SHARE = 0.05
MAX_ITEMS = 4  # the most answer patches a question rests on (count_small's "four")
MIN_PATCH = 8  # a 5 x 7 glyph and its jitter fit inside one patch
DEFAULT_IMAGE_SIZE, DEFAULT_PATCH_SIZE = 96, 8  # 12 x 12 = 144 vision tokens: 4 patches are 2.8%
MARKER_RADIUS = 2.5  # a small marker's outer radius at patch size 8: a 4 px square
# A faint picture's contrast, uniform in this range (its glyphs' and markers' colour weight over what
# lies under them). A dense model trained on solid glyphs reads a page's asked digit at 100% at
# contrast 1, 70% at 0.5, 16% at 0.3 and chance below (seed 2, 200 questions): the range spans what
# a model can be taught to see, so faint pictures grade a set by what the eye can read.
FAINT_CONTRAST = (0.05, 0.5)


@dataclass(frozen=True)
class Layout:
    """How a picture is filled. `glyphs` / `markers`: the clutter a validation picture draws (as
    many as find room); with `curriculum` the training pictures draw from none to the most, so some
    questions can be answered by finding any glyph before the model learns to pick the named one.
    `spaced`: no item on the border row or column and no two items' cells touching; else items
    fill any free cell. `markers` None: glyphs only (the glyph questions), their digits repeating as
    text does; else a picture's digits are distinct."""

    large: tuple[int, int]  # large shapes a picture
    glyphs: tuple[int, int]  # glyphs besides the one asked about
    markers: tuple[int, int] | None  # markers of other colours than the asked ones
    spaced: bool

    def clutter(self, curriculum: bool) -> tuple[tuple[int, int], tuple[int, int] | None]:
        if not curriculum:
            return self.glyphs, self.markers
        return (0, self.glyphs[1]), None if self.markers is None else (0, self.markers[1])


# scene: a few glyphs and markers spread over a picture of large shapes, each the most salient
# thing around it. page: a picture filled with glyphs like a page of text (10-14 besides the asked
# one, ~13 drawn at 2 x 2 patches: 36% of the tokens), so a budget that does not read the question
# cannot keep every glyph. Seed 0, dense stage from a tower of 2,000 steps (docs/data.md): 12-20
# glyphs (~17) were not learned in 1,500 steps (18.6%); 6-10 (~9) were (100.0% after 3,000) but fit
# the 42 tokens a 3x reduction keeps (-0.3); 10-14 were learned (90.0% after 2,500) and lost 15.7
# points at 3x. The recipe at 10-14, each seed's own tower: seed 1 learned it from 8,000 pictures,
# seed 2 from 24,000 (99.5%), seed 0 there its digit questions only (66.2%).
# crowded: the page with 18-22 glyphs besides the asked one (~20 drawn: 56% of the tokens), more than
# the third of the tokens a 3x reduction keeps, so merging (ToMe-like) must merge glyphs too, where on
# the page the background and the shapes' insides absorb it. Seed 0's dense model of the unaligned
# page, first 200 questions of each at keep 0.34: page 98.0% dense, 95.5 merged, 85.5 by deviation;
# crowded 97.0, 86.5 and 70.5.
LAYOUTS: dict[str, Layout] = {
    "scene": Layout(large=(4, 6), glyphs=(5, 8), markers=(1, 3), spaced=True),
    "page": Layout(large=(1, 2), glyphs=(10, 14), markers=None, spaced=False),
    "crowded": Layout(large=(1, 2), glyphs=(18, 22), markers=None, spaced=False),
}
GLYPH_TYPES = ("digit", "small_color")  # the types a layout without markers asks

# 5 x 7 bitmaps, one string of 5 bits a row.
FONT: dict[int, tuple[str, ...]] = {
    0: ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    1: ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    2: ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    3: ("11111", "00010", "00100", "00010", "00001", "10001", "01110"),
    4: ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    5: ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    6: ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    7: ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    8: ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    9: ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
}


def glyph_mask(digit: int, scale: int = 1) -> np.ndarray:
    """[7 * scale, 5 * scale] bool: the digit's pixels in the bitmap font."""
    rows = np.array([[c == "1" for c in row] for row in FONT[digit]], dtype=bool)
    return rows.repeat(scale, axis=0).repeat(scale, axis=1)


def check_resolution(image_size: int, patch_size: int, scale: int = 1,
                     question_types: Sequence[str] = DETAIL_TYPES) -> None:
    """InputError (one line) unless every question's answer fits MAX_ANSWER_SHARE of the vision
    tokens: a glyph covers scale x scale patches, and count_small's answer up to MAX_ITEMS markers
    of that size, of the (image_size / patch_size)^2."""
    if patch_size < MIN_PATCH or image_size % patch_size:
        raise InputError(f"the fine-detail set needs a patch size >= {MIN_PATCH} px dividing the image size, got "
                         f"image {image_size} px, patch {patch_size} px: give e.g. --image-size "
                         f"{DEFAULT_IMAGE_SIZE} --patch-size {DEFAULT_PATCH_SIZE}")
    if scale < 1 or image_size % (patch_size * scale):
        raise InputError(f"the glyph scale is a whole number >= 1 whose cells of {patch_size} x scale px tile the "
                         f"{image_size} px picture, got {scale}: give e.g. --glyph-scale 1 or 2")
    grid = image_size // patch_size
    patches = (MAX_ITEMS if "count_small" in question_types else 1) * scale**2
    if patches / grid**2 > MAX_ANSWER_SHARE:
        step = patch_size * scale
        need = int(np.ceil(np.sqrt(patches / MAX_ANSWER_SHARE) * patch_size / step)) * step
        hint = " or leave count_small out of the question types" if scale > 1 and "count_small" in question_types else ""
        at_scale = f", glyph scale {scale}" if scale > 1 else ""
        raise InputError(f"at image {image_size} px, patch {patch_size} px{at_scale} the fine-detail answers "
                         f"cover up to {100 * patches / grid**2:.1f}% of the {grid**2} vision tokens, over "
                         f"{100 * MAX_ANSWER_SHARE:g}%: give an image size of at least {need} px{hint}")


def check_layout(layout: str, question_types: Sequence[str] = DETAIL_TYPES) -> None:
    """InputError (one line) unless `layout` names a LAYOUTS entry that can ask every question type
    (a layout without markers has nothing for count_small to count)."""
    if layout not in LAYOUTS:
        raise InputError(f"--layout takes one of {', '.join(LAYOUTS)}, got {layout!r}")
    if LAYOUTS[layout].markers is None and set(question_types) - set(GLYPH_TYPES):
        raise InputError(f"the {layout} layout draws no markers, so it asks the glyph types only: give --types "
                         f"{','.join(GLYPH_TYPES)} or --layout scene (got {','.join(question_types)})")


def box_patches(box: Sequence[float], image_size: int, patch_size: int) -> list[int]:
    """Row-major indices of the patches a pixel box [x0, y0, x1, y1) touches."""
    grid = image_size // patch_size
    x0, y0, x1, y1 = box
    cols = range(int(x0 // patch_size), min(grid - 1, int(np.ceil(x1 / patch_size)) - 1) + 1)
    rows = range(int(y0 // patch_size), min(grid - 1, int(np.ceil(y1 / patch_size)) - 1) + 1)
    return [r * grid + c for r in rows for c in cols]


def answer_share(meta: dict[str, Any], image_size: int, patch_size: int) -> float:
    """Share of the (image_size / patch_size)^2 vision tokens that the record's answer boxes touch."""
    patches = {p for box in meta["answer_boxes"] for p in box_patches(box, image_size, patch_size)}
    return len(patches) / (image_size // patch_size) ** 2


def _free_cells(alphas: list[np.ndarray], size: int, patch: int, spaced: bool = True,
                offset: tuple[int, int] = (0, 0)) -> np.ndarray:
    """[rows, columns] bool: the cells of side `patch` (the grid starting `offset` (y, x) px into the
    picture) that no large shape (its coverage in `alphas`) touches, off the border if `spaced`."""
    cover = np.sum(alphas, axis=0) if alphas else np.zeros((size, size), dtype=np.float32)
    rows, cols = (size - offset[0]) // patch, (size - offset[1]) // patch
    cover = cover[offset[0]:offset[0] + rows * patch, offset[1]:offset[1] + cols * patch]
    free = cover.reshape(rows, patch, cols, patch).max(axis=(1, 3)) == 0.0
    if spaced:
        free[0, :] = free[-1, :] = free[:, 0] = free[:, -1] = False
    return free


def _pick_cells(rng: np.random.Generator, free: np.ndarray, wanted: list[int],
                spaced: bool = True) -> list[tuple[int, int]] | None:
    """Free cells (none touching another if `spaced`) for each group of `wanted` items in turn (the
    answer's first, then the clutter): every cell of the first group, as many as fit of the others
    (None when the first group does not fit)."""
    cells: list[tuple[int, int]] = []
    order = [divmod(int(flat), free.shape[1]) for flat in rng.permutation(free.size)]
    for group, n in enumerate(wanted):
        before = len(cells)
        for r, c in order:
            if len(cells) - before == n:
                break
            if not free[r, c] or (r, c) in cells:
                continue
            if not spaced or all(max(abs(r - a), abs(c - b)) > 1 for a, b in cells):
                cells.append((r, c))
        if group == 0 and len(cells) < n:
            return None
    return cells


def _others(rng: np.random.Generator, pool: Sequence[Any], exclude: Any, n: int) -> list[Any]:
    """n draws (with repeats) from `pool` without `exclude`."""
    rest = [x for x in pool if x != exclude]
    return [rest[int(i)] for i in rng.integers(len(rest), size=n)]


def _plan_items(rng: np.random.Generator, qtype: str, answer: str, glyph_range: tuple[int, int],
                marker_range: tuple[int, int] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """(the items the answer rests on, the clutter, the question): glyphs ({"digit", "color"}) and
    markers ({"color"}), as many clutter glyphs and markers as drawn from the two ranges (None: no
    markers: a page, whose digits repeat as text does). The question names its item uniquely: the
    only glyph of its colour, the only glyph of its digit, the only small things of its colour."""
    colors = list(COLORS)
    n_glyphs = int(rng.integers(glyph_range[0], glyph_range[1] + 1))
    markers = [] if marker_range is None else [  # None: a page, glyphs only
        {"color": c} for c in _others(rng, colors, None, int(rng.integers(marker_range[0], marker_range[1] + 1)))]
    if qtype == "count_small":
        if marker_range is None:
            raise ValueError(f"a page asks the glyph types {', '.join(GLYPH_TYPES)}, not {qtype!r}")
        color = colors[int(rng.integers(len(colors)))]
        target = [{"color": color} for _ in range(DETAIL_ANSWERS[qtype].index(answer))]
        markers = [{"color": c} for c in _others(rng, colors, color, len(markers))]
        digits = rng.permutation(10)[:n_glyphs]
        glyphs = [{"digit": int(d), "color": c} for d, c in zip(digits, _others(rng, colors, color, n_glyphs), strict=True)]
        return target, glyphs + markers, DETAIL_QUESTIONS[qtype].format(color=color)
    if qtype == "digit":
        digit, color = DIGITS.index(answer), colors[int(rng.integers(len(colors)))]
        clutter_colors = _others(rng, colors, color, n_glyphs)  # the asked colour names one glyph
    else:
        digit, color = int(rng.integers(10)), answer
        clutter_colors = _others(rng, colors, None, n_glyphs)
    if marker_range is not None:  # distinct digits but the asked one (it names one glyph)
        digits = [int(d) for d in rng.permutation(10) if d != digit][:n_glyphs]
    elif qtype == "digit":  # a page: digits repeat, the asked colour names the glyph
        digits = [int(d) for d in rng.integers(10, size=n_glyphs)]
    else:  # a page: digits repeat, all but the asked one
        digits = _others(rng, list(range(10)), digit, n_glyphs)
    glyphs = [{"digit": d, "color": c} for d, c in zip(digits, clutter_colors, strict=True)]
    question = DETAIL_QUESTIONS[qtype].format(color=color, digit=DIGITS[digit])
    return [{"digit": digit, "color": color}], glyphs + markers, question


def _draw_item(rng: np.random.Generator, img: np.ndarray, item: dict[str, Any], cell: tuple[int, int],
               patch: int, contrast: float = 1.0, offset: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """Draw a glyph or marker inside `cell` (of the grid starting `offset` (y, x) px in; a random
    place in the cell, never leaving it) at `contrast` (its colour's weight over what lies under
    it); its record with its box."""
    x_cell, y_cell = offset[1] + cell[1] * patch, offset[0] + cell[0] * patch
    scale = patch // MIN_PATCH
    if "digit" in item:
        mask = glyph_mask(item["digit"], scale)
        h, w = mask.shape
        x0, y0 = x_cell + int(rng.integers(0, patch - w + 1)), y_cell + int(rng.integers(0, patch - h + 1))
        composite(img[y0:y0 + h, x0:x0 + w], mask.astype(np.float32) * contrast, item["color"])
        return {**item, "box": [x0, y0, x0 + w, y0 + h], **({"contrast": contrast} if contrast != 1.0 else {})}
    radius = MARKER_RADIUS * scale
    cx = x_cell + float(rng.uniform(radius + 0.5, patch - radius - 0.5))
    cy = y_cell + float(rng.uniform(radius + 0.5, patch - radius - 0.5))
    marker = {"shape": "square", "color": item["color"], "center": [round(cx, 3), round(cy, 3)], "radius": radius,
              "small": True}
    # Drawn on the cell alone (it never leaves it): a whole-picture canvas a marker cost 3x the time.
    composite(img[y_cell:y_cell + patch, x_cell:x_cell + patch],
              shape_alpha("square", *marker["center"], radius, patch, origin=(x_cell, y_cell)) * contrast, item["color"])
    return {**marker, "box": [x_cell, y_cell, x_cell + patch, y_cell + patch],
            **({"contrast": contrast} if contrast != 1.0 else {})}


def detail_sample(rng: np.random.Generator, qtype: str, answer: str, size: int = DEFAULT_IMAGE_SIZE,
                  patch: int = DEFAULT_PATCH_SIZE, curriculum: bool = False, scale: int = 1,
                  layout: str = "scene", contrast: float = 1.0,
                  offset: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, str, dict[str, Any]]:
    """(image uint8 [size, size, 3], question, meta) of one fine-detail question whose answer is
    `answer`; `curriculum`: the clutter drawn from the training split's wider ranges (none to most);
    `scale`: every glyph and marker drawn `scale` times larger in a cell of scale x scale patches;
    `layout`: a name of LAYOUTS; `contrast`: every glyph's and marker's (1: solid; below, faint);
    `offset`: (y, x) px where the cells' grid starts (whole patches: a glyph still covers its cell's
    scale x scale patches; off a multiple of the cell, its cell straddles 2 x 2 pooling windows)."""
    if qtype not in DETAIL_TYPES:
        raise ValueError(f"unknown fine-detail question type {qtype!r}; types: {', '.join(DETAIL_TYPES)}")
    if answer not in DETAIL_ANSWERS[qtype]:
        raise ValueError(f"{answer!r} is not an answer of {qtype!r} questions: {DETAIL_ANSWERS[qtype]}")
    colors, cell, lay = list(COLORS), patch * scale, LAYOUTS[layout]
    targets, clutter, question = _plan_items(rng, qtype, answer, *lay.clutter(curriculum))
    while True:  # a scene whose large shapes leave no room for the answer is drawn again (same seed, same draws)
        large = []
        for _ in range(int(rng.integers(lay.large[0], lay.large[1] + 1))):
            r = float(rng.uniform(0.1, 0.19)) * size
            cx, cy = (float(v) for v in rng.uniform(r * 0.6, size - r * 0.6, size=2))
            large.append({"shape": SHAPES[int(rng.integers(len(SHAPES)))], "color": colors[int(rng.integers(len(colors)))],
                          "center": [round(cx, 3), round(cy, 3)], "radius": round(r, 3)})
        alphas = [shape_alpha(o["shape"], *o["center"], o["radius"], size) for o in large]
        cells = _pick_cells(rng, _free_cells(alphas, size, cell, lay.spaced, offset), [len(targets), len(clutter)],
                            lay.spaced)
        if cells is not None:
            break
    img = background(rng, size)
    for o, alpha in zip(large, alphas, strict=True):  # as `scenes.paint`, on the coverage computed once
        composite(img, alpha, o["color"])
    drawn = [_draw_item(rng, img, item, at, cell, contrast, offset)
             for item, at in zip(targets + clutter, cells, strict=False)]
    boxes = [d["box"] for d in drawn[:len(targets)]]
    meta = {"type": qtype, "objects": large + [d for d in drawn if "shape" in d],
            "glyphs": [d for d in drawn if "digit" in d], "answer_boxes": boxes, "patch_size": patch,
            "cell_size": cell, "answer_patches": sorted({p for b in boxes for p in box_patches(b, size, patch)}),
            **({"contrast": contrast} if contrast != 1.0 else {}), **({"grid_offset": list(offset)} if any(offset) else {})}
    return to_uint8(img), question, meta


def caption(meta: dict[str, Any]) -> str:
    """Every glyph and marker of a picture in reading order ("red three , small blue , green seven"):
    the large shapes are left to the tower's labels."""
    size = meta.get("cell_size", meta["patch_size"])
    items = [(g["box"], f"{g['color']} {DIGITS[g['digit']]}") for g in meta["glyphs"]]
    items += [(o["box"], f"small {o['color']}") for o in meta["objects"] if o.get("small")]
    return " , ".join(words for box, words in sorted(items, key=lambda it: (it[0][1] // size, it[0][0] // size)))


def generate_detail(out_dir: str | Path, num_train: int, num_val: int, image_size: int = DEFAULT_IMAGE_SIZE,
                    patch_size: int = DEFAULT_PATCH_SIZE, seed: int = 0,
                    question_types: Sequence[str] = DETAIL_TYPES, curriculum: bool = True, captions: bool = False,
                    scale: int = 1, question_first: bool = False, layout: str = "scene", faint: float = 0.0,
                    unaligned: bool = False, progress: bool = False) -> Any:
    """Write the fine-detail set to `out_dir` (the module doc) and say what was written
    (`synthetic.SyntheticSummary`). `curriculum`: the training pictures' clutter from none to the
    validation set's most (`Layout`); `captions`: a caption record (`caption`) beside each training
    question; `scale`: glyphs and markers drawn over scale x scale patches (`detail_sample`);
    `question_first`: each prompt puts the question before the picture, so every vision token can
    attend to the words that name what to find; `layout`: a name of LAYOUTS (`check_layout`); `faint`:
    the share of pictures (of each split) whose glyphs and markers are drawn at a contrast uniform
    in FAINT_CONTRAST (drawn from a stream of their own: a picture is the same but for its contrast);
    `unaligned`: each picture's cells start 0 to scale - 1 patches in, each axis drawn (a stream of
    their own), so most glyphs straddle 2 x 2 pooling windows as text does on real pictures.
    Refuses a resolution whose answers could exceed MAX_ANSWER_SHARE of the vision tokens
    (`check_resolution`). Same arguments, same bytes."""
    from tqdm.auto import tqdm

    from vlmod.data.synthetic import (
        SyntheticSummary,
        _answer_counts,
        _balanced_plan,
        _caption_records,
        _remove_stale,
        _write_json,
        _write_png,
        _write_records,
        check_types,
    )

    for name, value in (("num_train", num_train), ("num_val", num_val)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if not 0.0 <= faint <= 1.0:
        raise ValueError(f"faint is the share of pictures drawn faint, 0 to 1, got {faint}")
    qtypes = check_types(question_types, DETAIL_TYPES, "fine-detail")
    check_layout(layout, qtypes)
    check_resolution(image_size, patch_size, scale, qtypes)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    summary, splits = SyntheticSummary(out_dir=out), {}
    with tqdm(total=num_train + num_val, desc="fine-detail", unit="sample", disable=not progress) as bar:
        for code, (split, n) in enumerate((("train", num_train), ("val", num_val))):
            plan = _balanced_plan(np.random.default_rng([seed, code, 2, 2**31]), n, qtypes, DETAIL_ANSWERS)
            folder = out / "images" / split
            folder.mkdir(parents=True, exist_ok=True)
            records, names = [], set()
            for i, (qtype, answer) in enumerate(plan):
                contrast = faint_contrast(np.random.default_rng([seed, code, 3, i]), faint, FAINT_CONTRAST)
                offset = ((np.random.default_rng([seed, code, 4, i]).integers(0, scale, size=2) * patch_size)
                          if unaligned else (0, 0))
                img, question, meta = detail_sample(np.random.default_rng([seed, code, 2, i]), qtype, answer,
                                                    image_size, patch_size, curriculum=curriculum and split == "train",
                                                    scale=scale, layout=layout, contrast=contrast,
                                                    offset=(int(offset[0]), int(offset[1])))
                name = f"{i:06d}.png"
                _write_png(folder / name, img)
                names.add(name)
                records.append({"id": f"detail-{split}-{i:06d}", "image": f"images/{split}/{name}", "conversations": [
                    {"from": "human", "value": f"{question}\n<image>" if question_first else f"<image>\n{question}"},
                    {"from": "gpt", "value": answer}], "meta": meta})
                bar.update(1)
            _remove_stale(folder, names)
            counts = _answer_counts(records, qtypes, DETAIL_ANSWERS)
            if captions and split == "train":
                records += _caption_records(records, None, caption)
            path = out / f"{split}.json"
            _write_records(path, records)
            summary.files[split], summary.records[split], summary.answer_counts[split] = path, len(records), counts
            splits[split] = {"file": path.name, "records": len(records), "answer_counts": counts}
    _write_json(out / "meta.json", {
        "generator": "vlmod.data.detail", "seed": seed, "image_size": image_size, "patch_size": patch_size,
        "glyph_scale": scale, "question_first": question_first, "layout": layout, "faint": faint,
        **({"unaligned": True} if unaligned else {}),
        "faint_contrast": list(FAINT_CONTRAST), "max_answer_share": MAX_ANSWER_SHARE,
        "curriculum": curriculum, "captions": captions, "question_types": list(qtypes), "questions": DETAIL_QUESTIONS,
        "answers": {k: list(v) for k, v in DETAIL_ANSWERS.items()}, "splits": splits,
    })
    return summary


__all__ = ["DETAIL_ANSWERS", "DETAIL_QUESTIONS", "DETAIL_TYPES", "DIGITS", "FAINT_CONTRAST", "FONT", "GLYPH_TYPES", "LAYOUTS",
           "MAX_ANSWER_SHARE", "Layout", "answer_share", "box_patches", "caption", "check_layout", "check_resolution",
           "detail_sample", "generate_detail", "glyph_mask"]
