"""Qwen2.5-VL and Qwen3-VL (`Qwen2_5_VLForConditionalGeneration`, `Qwen3VLForConditionalGeneration`):
the language model, images and video.

Multimodal RoPE: the text model turns the (time, height, width) position ids of every token into
one (cos, sin) pair per token before the first layer, and hands each layer those plus the 1D text
positions; the decoder adapter gathers both per selected token, so a processed token keeps all
three of its position ids and nothing is recomputed. The 3D ids come from `mm_token_type_ids`,
as the processor returns them (without them Qwen2.5-VL falls back to 1D positions and Qwen3-VL
raises): pass the processor's output whole. Vision start / end tokens are text and always run.

Qwen3-VL deepstack adds vision features to the visual tokens' states after each of the first
language layers. That addition happens in the text model's loop, on the full-length states, not
inside a decoder layer: a token a MoD layer skipped still receives exactly the features the dense
model adds there, so those layers can be routed like any other (layer 0 stays dense as in every
family).

The vision towers run packed variable-resolution sequences (window attention in Qwen2.5-VL), not
a plain ViT, so only the language part converts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins.base import PartSpec
from vlmod.plugins.decoder import check_part, language_part, vision_part

FAMILIES = ("Hugging Face Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
VARIANTS = ("qwen2_5_vl", "qwen3_vl")
PACKED_TOWER = "it runs packed variable-resolution patch sequences (cu_seqlens), not a plain ViT"
# The model numbers its (time, height, width) positions itself from `mm_token_type_ids` and the
# grids, left padding included: callers pass the processor's outputs and no `position_ids`.
OWN_POSITIONS = True


def _classes() -> tuple[type, ...]:
    import transformers as tf

    names = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
    return tuple(getattr(tf, n) for n in names if hasattr(tf, n))


def matches(model: nn.Module) -> bool:
    return isinstance(model, _classes())


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    family = "qwen3_vl" if type(model).__name__.startswith("Qwen3") else "qwen2_5_vl"
    if check_part(model, part) == "vision":
        return vision_part(model, config, family, why_not=PACKED_TOWER)
    return language_part(model, config, family)



def tower_patches(model: nn.Module, inputs: dict[str, Any]) -> list[int]:
    """Patches of each image and each video the packed tower encodes (t x h x w of its grid)."""
    grids = [inputs[k] for k in ("image_grid_thw", "video_grid_thw") if inputs.get(k) is not None]
    return [int(t * h * w) for grid in grids for t, h, w in grid.tolist()]
