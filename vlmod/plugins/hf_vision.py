"""Hugging Face `CLIPVisionModel` / `SiglipVisionModel` (and the same towers inside LLaVA models)."""

from __future__ import annotations

from torch import Tensor, nn

from vlmod.config import MoDConfig
from vlmod.plugins.base import PartSpec
from vlmod.plugins.vit import ViTAdapter, gather_rows, split_heads

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
        adapter=ViTAdapter(
            type(blocks[0]), num_prefix, config, mask_arg="attention_mask", qk=_qk, qk_check=_qk_check
        ),
    )


def _qk_check(block: nn.Module) -> str | None:
    attn = getattr(block, "self_attn", None)
    if not hasattr(block, "layer_norm1") or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "num_heads", "scale")):
        return "expected layer_norm1 -> self_attn with q_proj / k_proj (a CLIP / SigLIP encoder layer)"
    return None


def _qk(block: nn.Module, x: Tensor, query_index: Tensor) -> tuple[Tensor, Tensor, float]:
    """The encoder layer runs self_attn(layer_norm1(x)) with separate q/k projections."""
    attn = block.self_attn
    h = block.layer_norm1(x)
    q = attn.q_proj(gather_rows(h, query_index))
    k = attn.k_proj(h)
    return split_heads(q, attn.num_heads), split_heads(k, attn.num_heads), attn.scale
