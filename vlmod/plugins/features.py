"""How many vision feature tokens a forward merged, as a shape: what lets a batch of one know its
routable count without reading a tensor (no host sync, docs/engine.md, host cost).

The families' inner models (`model.model` of LLaVA, Qwen-VL, InternVL, Gemma 3) merge image and
video features into the embeddings through `get_placeholder_mask(input_ids, inputs_embeds,
image_features=..., video_features=...)`, which checks that the placeholders match the features.
A class put in front of the inner model's records the features' sizes there.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from vlmod.config import TokenType

VISION_TYPES = frozenset({TokenType.IMAGE, TokenType.VIDEO})
# The `FeatureTally` of the family's inner model (vision feature tokens merged in this forward).
FEATURES_ATTR = "_vlmod_features"


class FeatureTally:
    """Vision feature tokens merged in the current forward, by kind (reset by each forward)."""

    def __init__(self) -> None:
        self.image = 0
        self.video = 0
        self.seen = False  # get_placeholder_mask ran in this forward

    def reset(self) -> None:
        self.image = self.video = 0
        self.seen = False

    def routable(self, types: Any) -> int:
        return (self.image if TokenType.IMAGE in types else 0) + (self.video if TokenType.VIDEO in types else 0)


class FeatureCounting:
    """Put in front of a family's inner model class (`model.model`): remembers how many image and
    video feature tokens its `get_placeholder_mask` was handed, a shape, so a batch of one knows
    how many of its tokens are routable without reading a tensor (no host sync; transformers
    itself checks that the placeholders match that count)."""

    def get_placeholder_mask(self, *args: Any, **kwargs: Any) -> Any:
        mask = super().get_placeholder_mask(*args, **kwargs)  # type: ignore[misc]
        tally = getattr(self, FEATURES_ATTR, None)
        if tally is not None:
            named = {**dict(zip(type(self)._vlmod_mask_params, args, strict=False)), **kwargs}
            embeds = named.get("inputs_embeds")
            if embeds is not None:
                width = embeds.shape[-1]
                image, video = named.get("image_features"), named.get("video_features")
                if isinstance(image, Tensor):
                    tally.image += image.numel() // width
                if isinstance(video, Tensor):
                    tally.video += video.numel() // width
                tally.seen = True
        return mask


_COUNTING_CLASSES: dict[type, type] = {}


def count_features(inner: nn.Module) -> None:
    """Give `inner` (a family's `model.model`) the `FeatureCounting` class in front of its own,
    under the same name; a class without `get_placeholder_mask` is left as it is."""
    cls = type(inner)
    if issubclass(cls, FeatureCounting) or not hasattr(cls, "get_placeholder_mask"):
        return
    if cls not in _COUNTING_CLASSES:
        params = [p for p in inspect.signature(cls.get_placeholder_mask).parameters if p != "self"]
        made = type(cls.__name__, (FeatureCounting, cls), {"_vlmod_mask_params": params})
        made.__qualname__, made.__module__ = cls.__qualname__, cls.__module__
        _COUNTING_CLASSES[cls] = made
    inner.__class__ = _COUNTING_CLASSES[cls]
    inner.__dict__[FEATURES_ATTR] = FeatureTally()


def uncount_features(inner: nn.Module) -> None:
    """Undo `count_features`."""
    cls = type(inner)
    if issubclass(cls, FeatureCounting):
        inner.__class__ = next(c for c in cls.__mro__[1:] if c is not FeatureCounting and not issubclass(c, FeatureCounting))
    inner.__dict__.pop(FEATURES_ATTR, None)


