"""InternVL (`InternVLForConditionalGeneration`): the language model (Qwen2 or Llama), images and
video (its frames are image tokens).

The decoder layers are the Qwen2 / Llama ones the LLaVA plugin already wraps, so this file only
says where they are. `<img>` / `</img>` around each image's context tokens are text and always
run. The InternViT tower (`InternVLVisionModel`) is not converted.
"""

from __future__ import annotations

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins import PartSpec
from vlmod.plugins.decoder import check_part, language_part, vision_part

FAMILIES = ("Hugging Face InternVLForConditionalGeneration",)


def _classes() -> tuple[type, ...]:
    import transformers as tf

    return (tf.InternVLForConditionalGeneration,) if hasattr(tf, "InternVLForConditionalGeneration") else ()


def matches(model: nn.Module) -> bool:
    return isinstance(model, _classes())


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if check_part(model, part) == "vision":
        return vision_part(model, config, "internvl")
    return language_part(model, config, "internvl")
