"""Hugging Face `CLIPVisionModel` / `SiglipVisionModel` (and the same towers inside LLaVA models)."""

from __future__ import annotations

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins import PartSpec
from vlmod.plugins.vit import ViTAdapter

FAMILIES = ("Hugging Face CLIPVisionModel", "Hugging Face SiglipVisionModel")


def _towers() -> dict[type, int]:
    """Supported tower classes and their number of prefix tokens."""
    from transformers import CLIPVisionModel, SiglipVisionModel
    from transformers.models.clip.modeling_clip import CLIPVisionTransformer
    from transformers.models.siglip.modeling_siglip import SiglipVisionTransformer

    return {CLIPVisionModel: 1, CLIPVisionTransformer: 1, SiglipVisionModel: 0, SiglipVisionTransformer: 0}


def matches(model: nn.Module) -> bool:
    return isinstance(model, tuple(_towers()))


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if part not in (None, "vision"):
        raise ValueError(f"a {type(model).__name__} has only a 'vision' part, got part={part!r}")
    num_prefix = next(n for cls, n in _towers().items() if isinstance(model, cls))
    transformer = getattr(model, "vision_model", model)
    blocks = transformer.encoder.layers
    return PartSpec(
        name="vision",
        family="hf_vision",
        root=model,
        entry=model,
        blocks=blocks,
        dim=transformer.config.hidden_size,
        adapter=ViTAdapter(type(blocks[0]), num_prefix, config, mask_arg="attention_mask"),
    )
