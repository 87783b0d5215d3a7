"""open_clip `CLIP` (its `.visual` tower) and `VisionTransformer`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

import vlmod.plugins.timm as timm_plugin
from vlmod.config import MoDConfig
from vlmod.plugins.base import PartSpec
from vlmod.plugins.vit import ViTAdapter, gather_rows, split_heads

FAMILIES = ("open_clip CLIP / VisionTransformer / TimmModel (timm ViT trunk: ViT-B-16-SigLIP, ...)",)


def _classes() -> tuple[type, ...]:
    try:
        from open_clip.model import CLIP, CustomTextCLIP
        from open_clip.timm_model import TimmModel
        from open_clip.transformer import VisionTransformer
    except ImportError:
        return ()
    return CLIP, CustomTextCLIP, VisionTransformer, TimmModel


def matches(model: nn.Module) -> bool:
    classes = _classes()
    return bool(classes) and isinstance(model, classes)


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    from open_clip.transformer import VisionTransformer

    if part not in (None, "vision"):
        raise ValueError(f"open_clip models convert their image tower only: use part='vision', not {part!r}")
    from open_clip.timm_model import TimmModel

    visual = model if isinstance(model, (VisionTransformer, TimmModel)) else model.visual
    if isinstance(visual, TimmModel) and timm_plugin.matches(visual.trunk):
        # A timm ViT trunk (the SigLIP towers): the timm plugin routes it; the trunk's own pooling
        # (attention pool "map", or none) and open_clip's head run after its blocks, on every token.
        return timm_plugin.part_spec(visual.trunk, "vision", config)
    if not isinstance(visual, VisionTransformer):
        raise TypeError(
            f"this open_clip model's image tower is a {type(visual).__name__} "
            f"({type(getattr(visual, 'trunk', visual)).__name__}), not a ViT; vlmod converts open_clip "
            "VisionTransformer towers and TimmModel towers whose trunk is a timm VisionTransformer"
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
            qk=_qk,
            qk_check=_qk_check,
        ),
    )


def _qk_check(block: nn.Module) -> str | None:
    attn = getattr(block, "attn", None)
    if not hasattr(block, "ln_1") or not isinstance(attn, nn.MultiheadAttention):
        return "only ResidualAttentionBlock (ln_1 -> nn.MultiheadAttention) is supported"
    if not attn._qkv_same_embed_dim or attn.in_proj_weight is None:
        return "its MultiheadAttention has separate q/k/v weights"
    return None


def _qk(block: nn.Module, x: Tensor, query_index: Tensor) -> tuple[Tensor, Tensor, float]:
    """ResidualAttentionBlock runs attn(ln_1(x)); nn.MultiheadAttention packs q, k, v in
    in_proj_weight and scales by head_dim ** -0.5."""
    attn = block.attn
    h = block.ln_1(x)
    width, heads = attn.embed_dim, attn.num_heads
    w, b = attn.in_proj_weight, attn.in_proj_bias
    q = F.linear(gather_rows(h, query_index), w[:width], None if b is None else b[:width])
    k = F.linear(h, w[width : 2 * width], None if b is None else b[width : 2 * width])
    return split_heads(q, heads), split_heads(k, heads), (width // heads) ** -0.5
