"""The language part of a Hugging Face vision-language model beyond LLaVA (Qwen2.5-VL, Qwen3-VL,
InternVL, Gemma 3): what their plugins share.

Their decoder layers take the call LLaVA's do (`hidden_states, attention_mask, position_ids,
past_key_values, position_embeddings`), the language model sits at `model.model.language_model`
and the image / video placeholder ids in the top-level config, so the LLaVA plugin's
`DecoderAdapter` (token types from a pre-hook on the top-level model, gathered positions and RoPE,
a per-layer mask and routed KV cache) serves them as it is; a family file says only what differs.
"""

from __future__ import annotations

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins import PartSpec, hf_vision
from vlmod.plugins.llava import DecoderAdapter


def language_part(
    model: nn.Module,
    config: MoDConfig,
    family: str,
    adapter: DecoderAdapter | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
    dense_layers: tuple[int, ...] = (0,),
) -> PartSpec:
    """The PartSpec of `model.model.language_model`. `layer_types`: the attention kinds the
    adapter can route (others are a ValueError naming the layer). `dense_layers`: layers whose
    KV cache transformers reads to size masks and default positions for every layer."""
    lm = model.model.language_model
    for i, layer in enumerate(lm.layers):
        kind = _layer_type(lm, i, layer)
        if kind not in layer_types:
            raise ValueError(
                f"{family} language layer {i} uses {kind}; vlmod routes {' and '.join(layer_types)} layers only"
            )
    return PartSpec(
        name="language",
        family=family,
        root=lm,
        entry=model,
        blocks=lm.layers,
        dim=lm.config.hidden_size,
        adapter=adapter or DecoderAdapter(model, type(lm.layers[0]), config),
        dense_layers=dense_layers,
    )


def _layer_type(lm: nn.Module, index: int, layer: nn.Module) -> str:
    types = getattr(lm.config, "layer_types", None)
    if types:
        return types[index]
    return getattr(layer, "attention_type", "full_attention")


def vision_part(model: nn.Module, config: MoDConfig, family: str, why_not: str | None = None) -> PartSpec:
    """The vision tower as a plain ViT (the Hugging Face vision plugin), or a ValueError saying
    why this family's tower cannot be routed."""
    tower = model.model.vision_tower if hasattr(model.model, "vision_tower") else model.model.visual
    if why_not is None and hf_vision.matches(tower):
        return hf_vision.part_spec(tower, "vision", config)
    reason = why_not or f"its vision tower is a {type(tower).__name__}, not a CLIP / SigLIP tower"
    raise ValueError(f"vlmod cannot route the {family} vision tower: {reason}; convert part='language'")


def check_part(model: nn.Module, part: str | None) -> str:
    part = part or "language"
    if part not in ("language", "vision"):
        raise ValueError(f"part must be 'language' or 'vision' for {type(model).__name__}, got {part!r}")
    return part


def vlm_plugins() -> list:
    """The plugins of whole vision-language models (a language part, maybe a vision part)."""
    from vlmod.plugins import gemma3, internvl, llava, qwen_vl

    return [llava, qwen_vl, internvl, gemma3]


def vlm_classes() -> tuple[type, ...]:
    """Every top-level model class `vlmod convert` accepts."""
    return tuple(cls for plugin in vlm_plugins() for cls in plugin._classes())


def vlm_families() -> list[str]:
    return [f for plugin in vlm_plugins() for f in plugin.FAMILIES]
