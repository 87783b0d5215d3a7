"""A picture as the model saw it: the part the processor keeps, the resolution the model takes,
and the data URLs the page draws under its overlay."""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image

from vlmod.demo.layout import View

# Longest side of the pictures sent back to the page (they are drawn under the overlay).
PREVIEW_SIDE = 512


def setting(d: Any, key: str) -> Any:
    """`key` of a processor setting that is a dict or an object (None when absent)."""
    if d is None:
        return None
    return d.get(key) if isinstance(d, dict) else getattr(d, key, None)


def _hw(d: Any) -> tuple[Any, Any]:
    return setting(d, "height"), setting(d, "width")


def seen_box(size: tuple[int, int], processor: Any) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the part of a `size` = (width, height) picture the processor
    keeps: the centre crop of a resize-shortest-edge + center-crop processor (CLIP, LLaVA-NeXT-Video
    frames), else the whole picture (squashed, or tiled by an anyres processor, whose tiles are
    already square so its crop changes nothing)."""
    width, height = size
    whole = (0, 0, width, height)
    if not getattr(processor, "do_center_crop", False) or getattr(processor, "image_grid_pinpoints", None):
        return whole
    ch, cw = _hw(getattr(processor, "crop_size", None))
    if not ch or not cw:
        return whole
    processor_size = getattr(processor, "size", None)
    shortest = setting(processor_size, "shortest_edge")
    if shortest:
        scale = shortest / min(width, height)
        rh, rw = height * scale, width * scale
    else:
        rh, rw = _hw(processor_size)
        if not rh or not rw:
            return whole
    fx, fy = min(1.0, cw / rw), min(1.0, ch / rh)
    box = ((1 - fx) / 2 * width, (1 - fy) / 2 * height, (1 + fx) / 2 * width, (1 + fy) / 2 * height)
    left, top, right, bottom = (round(v) for v in box)
    return (left, top, right, bottom)


def seen_region(picture: Image.Image, processor: Any) -> Image.Image:
    """The part of `picture` the processor keeps (`seen_box`)."""
    box = seen_box(picture.size, processor)
    return picture if box == (0, 0, *picture.size) else picture.crop(box)


def model_resolution(processor: Any, view: View, patch_size: int) -> tuple[int, int]:
    """(width, height) of the pixels the model takes for one picture: the grid's own cells where the
    family's layout gives them, else the processor's crop or fixed size, else (anyres) the first
    grid's cells times the patch size."""
    if view.cell:
        return (view.cols * view.cell, view.rows * view.cell)
    if getattr(processor, "do_center_crop", False) and not getattr(processor, "image_grid_pinpoints", None):
        ch, cw = _hw(getattr(processor, "crop_size", None))
        if ch and cw:
            return (int(cw), int(ch))
    h, w = _hw(getattr(processor, "size", None))
    if h and w and not getattr(processor, "image_grid_pinpoints", None):
        return (int(w), int(h))
    return (view.cols * patch_size, view.rows * patch_size)


def data_url(picture: Image.Image, size: tuple[int, int] | None = None) -> str:
    """A PNG (small pictures) or JPEG data URL of `picture`, at most PREVIEW_SIDE px (or resized to
    exactly `size`, as the processor resizes: bicubic)."""
    if size is not None:
        img = picture.resize(size, Image.Resampling.BICUBIC)
    else:
        img = picture.copy()
        img.thumbnail((PREVIEW_SIDE, PREVIEW_SIDE))
    buf = io.BytesIO()
    if max(img.size) <= 256:
        img.save(buf, format="PNG")
        mime = "png"
    else:
        img.save(buf, format="JPEG", quality=88)
        mime = "jpeg"
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")
