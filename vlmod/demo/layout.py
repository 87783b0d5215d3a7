"""Where each vision token of a prompt sits on its picture: the trace knows token positions in the
sequence, the page needs cells on a picture's grid.

The mapping follows the families' token layouts:

- LLaVA, worked out from token counts so that it holds for any checkpoint of the family: one image
  = a side x side grid (side = image_size / patch_size), row-major; a video on an image-only model
  is sent as its frames, one image each. LLaVA-NeXT / OneVision images (anyres): a side x side
  overview of the whole picture, then the high-resolution grid (h rows of w cells, each row
  followed by a newline token) unpadded to the picture's aspect ratio. Video models: T frames of
  equal square grids (pooled), OneVision with one newline at the end.
- Qwen2.5-VL / Qwen3-VL, from `image_grid_thw` / `video_grid_thw` (dynamic resolution, 2x2 merged
  patches; a video's temporal step covers two frames); InternVL's tiles and thumbnail; Gemma 3's
  pooled square grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.config import TokenType
from vlmod.plugins import gemma3, internvl, qwen_vl, vlm_plugin


class AnalysisError(RuntimeError):
    """The model's tokens could not be mapped onto the picture (an unsupported layout)."""


@dataclass
class View:
    """A grid of vision tokens that covers the whole (displayed) picture."""

    name: str
    rows: int
    cols: int
    tokens: list[int]  # sequence positions, row-major, rows * cols of them
    cell: int | None = None  # model input pixels per token side, where the family's layout says


def side_of(size: Any) -> int:
    """One side of a config size (an int, or a (height, width) pair of equal sides)."""
    return int(size[0] if isinstance(size, (list, tuple)) else size)


# ------------------------------------------------------------------- LLaVA: from token counts


def image_views(n: int, side: int, aspect: float) -> list[View]:
    """Views of the `n` tokens of one image (positions 0..n-1) given the family's base grid side and
    the picture's width / height; see the module doc."""
    base = side * side
    if n == base or n == base + 1:  # plain LLaVA; anyres with a single tile (+ newline)
        return [View("tokens", side, side, list(range(base)))]
    rest = n - base
    if rest > 0:
        fits = [(h, rest // h - 1) for h in range(1, rest + 1) if rest % h == 0 and rest // h >= 2]
        if fits:
            h, w = min(fits, key=lambda hw: abs(math.log(hw[1] / hw[0]) - math.log(aspect)))
            detail = [base + r * (w + 1) + c for r in range(h) for c in range(w)]
            return [View("high-res", h, w, detail), View("overview", side, side, list(range(base)))]
    if math.isqrt(n) ** 2 == n:
        s = math.isqrt(n)
        return [View("tokens", s, s, list(range(n)))]
    raise AnalysisError(f"cannot lay out {n} image tokens on a grid (base grid {side}x{side})")


def video_views(n: int, frames: int) -> list[list[View]]:
    """Per frame, the view of its tokens out of the `n` video tokens of `frames` frames."""
    for extra in (0, 1):  # OneVision appends one newline token after all frames
        if (n - extra) % frames == 0:
            per = (n - extra) // frames
            s = math.isqrt(per)
            if s * s == per:
                return [[View("tokens", s, s, list(range(f * per, (f + 1) * per)))] for f in range(frames)]
    raise AnalysisError(f"cannot lay out {n} video tokens as {frames} square frame grids")


# ------------------------------------------- families with a layout of their own: from the inputs


def token_runs(input_ids: Tensor, token_id: int) -> list[int]:
    """Lengths of the runs of `token_id` in a 1-D `input_ids`, in order (one run per picture in
    families that bracket each picture's tokens with begin / end tokens)."""
    hit = (input_ids == token_id).long()
    edges = torch.diff(torch.cat([hit.new_zeros(1), hit, hit.new_zeros(1)]))
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    return (ends - starts).tolist()


def qwen_views(model: nn.Module, inputs: dict[str, Any], sizes: Sequence[tuple[int, int]], as_video: bool) -> list[list[View]]:
    """Dynamic resolution: each image (each temporal step of a video: `temporal_patch_size`
    frames) is a grid of `image_grid_thw` / `video_grid_thw` patches, merged `spatial_merge_size`
    x `spatial_merge_size` into one token, row-major."""
    vision = model.config.vision_config
    merge = vision.spatial_merge_size
    grids, start = [], 0
    for steps, h, w in inputs["video_grid_thw" if as_video else "image_grid_thw"].tolist():
        rows, cols = h // merge, w // merge
        for _ in range(steps):
            grids.append([View("tokens", rows, cols, list(range(start, start + rows * cols)), vision.patch_size * merge)])
            start += rows * cols
    return grids


def internvl_views(model: nn.Module, inputs: dict[str, Any], sizes: Sequence[tuple[int, int]], as_video: bool) -> list[list[View]]:
    """Fixed tiles: each picture's `<img>`...`</img>` run holds `image_seq_length` tokens per
    tile, a square grid (the tower's patch grid, pixel-shuffled). More than one tile: rows x cols
    crops of the picture (the grid whose aspect ratio is nearest the picture's, as the processor
    chooses it), then a thumbnail of the whole picture."""
    config = model.config
    per_tile = config.image_seq_length
    side = math.isqrt(per_tile)
    cell = int(round(side_of(config.vision_config.patch_size) / config.downsample_ratio))
    grids, start = [], 0
    for i, run in enumerate(token_runs(inputs["input_ids"][0], config.image_token_id)):
        tiles = run // per_tile
        thumb = start + (tiles - 1) * per_tile
        overview = View("overview" if tiles > 1 else "tokens", side, side, list(range(thumb, thumb + per_tile)), cell)
        if tiles == 1:
            grids.append([overview])
        else:
            width, height = sizes[min(i, len(sizes) - 1)]
            n = tiles - 1
            r, c = min(((r, n // r) for r in range(1, n + 1) if n % r == 0),
                       key=lambda rc: abs(math.log(rc[1] / rc[0]) - math.log(width / height)))
            detail = [start + (tr * c + tc) * per_tile + y * side + x
                      for tr in range(r) for y in range(side) for tc in range(c) for x in range(side)]
            grids.append([View("high-res", r * side, c * side, detail, cell), overview])
        start += run
    return grids


def gemma3_views(model: nn.Module, inputs: dict[str, Any], sizes: Sequence[tuple[int, int]], as_video: bool) -> list[list[View]]:
    """Every image is pooled to `mm_tokens_per_image` tokens, a square grid over the whole
    (squashed) picture, between its begin / end-of-image tokens."""
    config = model.config
    per = config.mm_tokens_per_image
    side = math.isqrt(per)
    cell = config.vision_config.image_size // side
    grids, start = [], 0
    for run in token_runs(inputs["input_ids"][0], config.image_token_id):
        for first in range(start, start + run, per):
            grids.append([View("tokens", side, side, list(range(first, first + per)), cell)])
        start += run
    return grids


# Per plugin, its layout: (model, processor outputs, each picture's (width, height), as_video) ->
# per picture its views, token indices counted among the prompt's tokens of that kind.
FamilyLayout = Callable[[nn.Module, dict[str, Any], Sequence[tuple[int, int]], bool], list[list[View]]]
FAMILY_LAYOUTS: dict[Any, FamilyLayout] = {qwen_vl: qwen_views, internvl: internvl_views, gemma3: gemma3_views}


# ----------------------------------------------------------------------------- one prompt


def base_side(model: nn.Module) -> int:
    vision = model.config.vision_config
    return side_of(vision.image_size) // side_of(vision.patch_size)


def picture_views(
    model: nn.Module, pictures: Sequence[Any], types: Tensor, as_video: bool, inputs: dict[str, Any]
) -> list[list[View]]:
    """Per picture (a PIL image: an image, or a video frame), its views with the sequence
    positions of their tokens; `types` [L]: the prompt's token types."""
    kind = TokenType.VIDEO if as_video else TokenType.IMAGE
    positions = torch.nonzero(types == kind).flatten().tolist()
    n, frames = len(positions), len(pictures)
    layout = FAMILY_LAYOUTS.get(vlm_plugin(model))
    if layout is not None:
        local = layout(model, inputs, [picture.size for picture in pictures], as_video)
        if as_video and local:  # a temporal step of merged patches covers several frames
            local = [local[f * len(local) // frames] for f in range(frames)]
        if len(local) != frames or any(t >= n for views in local for v in views for t in v.tokens):
            raise AnalysisError(f"the {len(local)} token grids of this model do not fit {frames} picture(s) of {n} tokens")
    elif as_video:
        local = video_views(n, frames)
    else:
        if n % frames:
            raise AnalysisError(f"{n} image tokens do not split evenly over {frames} images")
        per = n // frames
        side = base_side(model)
        local = []
        for f, picture in enumerate(pictures):
            views = image_views(per, side, picture.width / picture.height)
            local.append([View(v.name, v.rows, v.cols, [t + f * per for t in v.tokens]) for v in views])
    return [[View(v.name, v.rows, v.cols, [positions[t] for t in v.tokens], v.cell) for v in views] for views in local]
