"""Hugging Face LLaVA families (transformers 5.x): the language backbone through the shared
decoder adapter, and the vision tower through the HF vision plugin. What only LLaVA has: four
top-level classes and a choice of text backbones."""

from __future__ import annotations

from torch import nn

import vlmod.plugins.hf_vision as hf_vision
from vlmod.config import MoDConfig
from vlmod.plugins.base import PartSpec
from vlmod.plugins.decoder import check_part, language_part

FAMILIES = (
    "Hugging Face LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaNextVideoForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration (Llama, Mistral or Qwen2 text backbones)",
)
VARIANTS = ("llava", "llava_mistral", "llava_next", "llava_next_video", "llava_onevision")
TEXT_BACKBONES = ("LlamaModel", "MistralModel", "Qwen2Model")


def _classes() -> tuple[type, ...]:
    import transformers as tf

    names = (
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
        "LlavaNextVideoForConditionalGeneration",
        "LlavaOnevisionForConditionalGeneration",
    )
    return tuple(getattr(tf, n) for n in names if hasattr(tf, n))


def matches(model: nn.Module) -> bool:
    return isinstance(model, _classes())


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if check_part(model, part) == "vision":
        tower = model.model.vision_tower
        if not hf_vision.matches(tower):
            raise TypeError(
                f"this model's vision tower is a {type(tower).__name__}; vlmod converts CLIP and "
                "SigLIP towers"
            )
        return hf_vision.part_spec(tower, "vision", config)
    lm = model.model.language_model
    if type(lm).__name__ not in TEXT_BACKBONES:
        raise TypeError(
            f"the text backbone is a {type(lm).__name__}; vlmod supports {', '.join(TEXT_BACKBONES)}"
        )
    return language_part(model, config, "llava")
