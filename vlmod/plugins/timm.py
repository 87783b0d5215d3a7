"""timm `VisionTransformer` and its subclasses (DeiT distilled, registers, layer scale, ...)."""

from __future__ import annotations

from torch import Tensor, nn

from vlmod.config import MoDConfig
from vlmod.plugins.base import PartSpec
from vlmod.plugins.vit import ViTAdapter, gather_rows, linear_slice, split_heads

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
        adapter=ViTAdapter(
            type(blocks[0]), model.num_prefix_tokens, config, mask_arg="attn_mask", qk=_qk, qk_check=_qk_check
        ),
    )


def _qk_check(block: nn.Module) -> str | None:
    from timm.layers import Attention
    from timm.models.vision_transformer import Block

    if not isinstance(block, Block):
        return "only timm's pre-norm Block (norm1 -> attn) is supported"
    if type(block.attn) is not Attention:
        return f"its attention is a {type(block.attn).__name__}, not timm's Attention"
    return None


def _qk(block: nn.Module, x: Tensor, query_index: Tensor) -> tuple[Tensor, Tensor, float]:
    """Block.forward runs attn(norm1(x)); Attention splits qkv into (3, heads, head_dim) and
    applies q_norm / k_norm per head."""
    attn = block.attn
    h = block.norm1(x)
    width = attn.num_heads * attn.head_dim
    q = attn.q_norm(split_heads(linear_slice(attn.qkv, gather_rows(h, query_index), 0, width), attn.num_heads))
    k = attn.k_norm(split_heads(linear_slice(attn.qkv, h, width, 2 * width), attn.num_heads))
    return q, k, attn.scale
