"""timm `VisionTransformer` and its subclasses (DeiT distilled, registers, layer scale, ...)."""

from __future__ import annotations

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins import PartSpec
from vlmod.plugins.vit import ViTAdapter

FAMILIES = ("timm VisionTransformer (and subclasses: DeiT, registers, layer scale)",)


def _vit_class() -> type | None:
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:
        return None
    return VisionTransformer


def matches(model: nn.Module) -> bool:
    cls = _vit_class()
    return cls is not None and isinstance(model, cls)


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if part not in (None, "vision"):
        raise ValueError(f"a timm VisionTransformer has only a 'vision' part, got part={part!r}")
    blocks = model.blocks
    return PartSpec(
        name="vision",
        family="timm",
        root=model,
        entry=model,
        blocks=blocks,
        dim=model.embed_dim,
        adapter=ViTAdapter(type(blocks[0]), model.num_prefix_tokens, config, mask_arg="attn_mask"),
    )
