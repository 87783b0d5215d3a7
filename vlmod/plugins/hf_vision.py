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
    from transformers.models.clip import modeling_clip
    from transformers.models.siglip import modeling_siglip

    towers = {CLIPVisionModel: 1, SiglipVisionModel: 0}
    # Older transformers wrap the encoder in a *VisionTransformer inside the model.
    for module, name, prefix in ((modeling_clip, "CLIPVisionTransformer", 1), (modeling_siglip, "SiglipVisionTransformer", 0)):
        if hasattr(module, name):
            towers[getattr(module, name)] = prefix
    return towers


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
