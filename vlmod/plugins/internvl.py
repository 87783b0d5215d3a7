"""InternVL (`InternVLForConditionalGeneration`): the language model (Qwen2 or Llama), images and
video (its frames are image tokens), and the InternViT tower.

The decoder layers are the Qwen2 / Llama ones the shared decoder adapter already wraps, so this
file only says where they are. `<img>` / `</img>` around each image's context tokens are text and
always run. InternViT (`InternVLVisionModel`) is a plain pre-norm ViT with layer scale and one class
token, its blocks called as `layer(hidden_states)`: the shared ViT adapter routes its patches
(the attention router is not supported there).
"""

from __future__ import annotations

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins.base import PartSpec
from vlmod.plugins.decoder import check_part, language_part
from vlmod.plugins.vit import ViTAdapter

FAMILIES = ("Hugging Face InternVLForConditionalGeneration",)
VARIANTS = ("internvl",)


def _classes() -> tuple[type, ...]:
    import transformers as tf

    return (tf.InternVLForConditionalGeneration,) if hasattr(tf, "InternVLForConditionalGeneration") else ()


def matches(model: nn.Module) -> bool:
    return isinstance(model, _classes())


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if check_part(model, part) == "vision":
        tower = model.model.vision_tower
        blocks = tower.encoder.layer
        return PartSpec(
            name="vision", family="internvl", root=tower, entry=tower, blocks=blocks,
            dim=tower.config.hidden_size, adapter=ViTAdapter(type(blocks[0]), num_prefix=1, config=config),
        )
    return language_part(model, config, "internvl")

