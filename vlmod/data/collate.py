"""Batching: dataset items padded and joined into one batch a model's forward (or `generate`) takes.

Text (`input_ids`, `attention_mask`, `labels`) is padded on the tokenizer's padding side (left for
generation-ready batches), -100 in the labels of padding; per-token processor outputs (token
types) are padded like the text; media tensors are joined along dim 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from vlmod.data.answers import IGNORE_INDEX

TEXT_KEYS = ("input_ids", "attention_mask", "labels")


def _pad_1d(rows: Sequence[Tensor], value: int, side: str) -> Tensor:
    length = max(len(r) for r in rows)
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        if side == "left":
            out[i, length - len(r):] = r
        else:
            out[i, : len(r)] = r
    return out


def to_frame_count(frames: Any, num_frames: int) -> Any:
    """`num_frames` frames of a clip that has fewer (a 1-frame clip, a very short video): each frame
    repeated evenly, in order, so every video of a batch has the configured frame count (videos of
    different lengths cannot be stacked into one `pixel_values_videos`)."""
    if len(frames) >= num_frames:
        return frames
    index = ((torch.arange(num_frames, dtype=torch.float64) + 0.5) * len(frames) / num_frames).long()
    return frames[index.numpy()]


def _cat_media(key: str, tensors: list[Tensor]) -> Tensor:
    """Per-sample media tensors joined along dim 0 (the images of the batch in order, which is
    what LLaVA models expect). Anyres `pixel_values` [n, patches, C, H, W] with different patch
    counts are zero-padded to the most patches (the model cuts them back by `image_sizes`)."""
    shapes = {tuple(t.shape[1:]) for t in tensors}
    if len(shapes) == 1:
        return torch.cat(tensors, dim=0)
    if key == "pixel_values" and all(t.dim() == 5 for t in tensors) and len({s[1:] for s in shapes}) == 1:
        most = max(t.shape[1] for t in tensors)
        padded = [torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 0, 0, most - t.shape[1])) for t in tensors]
        return torch.cat(padded, dim=0)
    raise ValueError(
        f"cannot batch {key!r}: the samples have shapes {sorted(shapes)} past the first dimension "
        "(videos need the same number of frames, images the same processed size)"
    )


def collate(batch: Sequence[dict[str, Tensor]], pad_token_id: int = 0, padding_side: str = "left") -> dict[str, Tensor]:
    """Dataset items -> one batch: `input_ids` padded with `pad_token_id`, `attention_mask` 0 and
    `labels` -100 on padding, on `padding_side` ("left" keeps every prompt's end aligned, as
    generation needs); media tensors (`pixel_values`, `image_sizes`, `pixel_values_videos`, ...)
    joined along dim 0 over the items that have them."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    out: dict[str, Tensor] = {}
    fills = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    for key in TEXT_KEYS:
        have = [key in item for item in batch]
        if not any(have):
            continue
        if not all(have):
            raise ValueError(f"some items have {key!r} and some do not; collate training and prompt items apart")
        out[key] = _pad_1d([item[key] for item in batch], fills[key], padding_side)
    keys = dict.fromkeys(k for item in batch for k in item if k not in TEXT_KEYS)
    for key in keys:
        tensors = [item[key] for item in batch if key in item and isinstance(item[key], Tensor)]
        if tensors and len(tensors) == len(batch) and all(_per_token(t, item) for t, item in zip(tensors, batch, strict=True)):
            out[key] = _pad_1d(tensors, 0, padding_side)  # token types of a family (Qwen, Gemma 3): 0 = text
        elif tensors:
            out[key] = _cat_media(key, tensors)
    return out


def _per_token(value: Tensor, item: dict[str, Tensor]) -> bool:
    """Whether a processor output holds one integer per token (Qwen's `mm_token_type_ids`, Gemma 3's
    `token_type_ids`): padded like the text, not joined like media."""
    ids = item.get("input_ids")
    return ids is not None and not value.is_floating_point() and value.shape == ids.shape


__all__ = ["TEXT_KEYS", "collate", "to_frame_count"]
