"""open_clip `CLIP` (its `.visual` tower) and `VisionTransformer`."""

from __future__ import annotations

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins import PartSpec
from vlmod.plugins.vit import ViTAdapter

FAMILIES = ("open_clip CLIP / VisionTransformer",)


def _classes() -> tuple[type, ...]:
    try:
        from open_clip.model import CLIP, CustomTextCLIP
        from open_clip.transformer import VisionTransformer
    except ImportError:
        return ()
    return CLIP, CustomTextCLIP, VisionTransformer


def matches(model: nn.Module) -> bool:
    classes = _classes()
    return bool(classes) and isinstance(model, classes)


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    from open_clip.transformer import VisionTransformer

    if part not in (None, "vision"):
        raise ValueError(f"open_clip models convert their image tower only: use part='vision', not {part!r}")
    visual = model if isinstance(model, VisionTransformer) else model.visual
    if not isinstance(visual, VisionTransformer):
        raise TypeError(
            f"this open_clip model's image tower is a {type(visual).__name__} (a timm or CNN trunk), "
            "not an open_clip VisionTransformer; convert the timm trunk (model.visual.trunk) instead"
        )
    transformer = visual.transformer
    blocks = transformer.resblocks
    # open_clip ViTs always carry one class token ahead of the patches.
    return PartSpec(
        name="vision",
        family="open_clip",
        root=visual,
        entry=visual,
        blocks=blocks,
        dim=transformer.width,
        adapter=ViTAdapter(
            type(blocks[0]),
            num_prefix=1,
            config=config,
            batch_first=getattr(transformer, "batch_first", True),
            mask_arg="attn_mask",
        ),
    )
