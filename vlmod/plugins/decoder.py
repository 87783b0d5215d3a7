"""The language part of a Hugging Face vision-language model beyond LLaVA (Qwen2.5-VL, Qwen3-VL,
InternVL, Gemma 3): what their plugins share.

Their decoder layers take the call LLaVA's do (`hidden_states, attention_mask, position_ids,
past_key_values, position_embeddings`), the language model sits at `model.model.language_model`
and the image / video placeholder ids in the top-level config, so the LLaVA plugin's
`DecoderAdapter` (token types from a pre-hook on the top-level model, gathered positions and RoPE,
a per-layer mask and routed KV cache) serves them as it is; a family file says only what differs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

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


# -- what the commands (rank, finetune, eval, audit, demo) need to know of a family ---------------


@dataclass(frozen=True)
class TokenGrid:
    """One picture's vision tokens on a grid: `tokens` index the sequence's tokens of that kind
    (image or video) in order, row-major, rows * cols of them; `cell`: the side in model input
    pixels that one token covers."""

    name: str
    rows: int
    cols: int
    tokens: list[int]
    cell: int


def vlm_plugin(model: nn.Module) -> Any:
    """The plugin module of a whole vision-language model, or None (an encoder, another model)."""
    return next((p for p in vlm_plugins() if p.matches(model)), None)


def own_positions(model: nn.Module) -> bool:
    """True when the model numbers its positions itself from the processor's outputs (Qwen's
    multimodal RoPE): a caller must not pass `position_ids` then, not even for left padding."""
    return bool(getattr(vlm_plugin(model), "OWN_POSITIONS", False))


def token_grids(
    model: nn.Module, inputs: dict[str, Any], sizes: Sequence[tuple[int, int]], as_video: bool = False
) -> list[list[TokenGrid]] | None:
    """Per picture of one prompt, its token grids (the first covers the whole picture), from the
    processor's `inputs` and each picture's (width, height); None when the family's plugin has no
    layout of its own (LLaVA: the demo works its layouts out from token counts)."""
    layout = getattr(vlm_plugin(model), "token_grids", None)
    return None if layout is None else layout(model, inputs, sizes, as_video)


def token_runs(input_ids: Tensor, token_id: int) -> list[int]:
    """Lengths of the runs of `token_id` in a 1-D `input_ids`, in order (one run per picture in
    families that bracket each picture's tokens with begin / end tokens)."""
    hit = (input_ids == token_id).long()
    edges = torch.diff(torch.cat([hit.new_zeros(1), hit, hit.new_zeros(1)]))
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    return (ends - starts).tolist()


def square_grids(runs: Sequence[int], per_picture: int, cell: int) -> list[list[TokenGrid]]:
    """Fixed square grids of `per_picture` tokens, one per picture (Gemma 3)."""
    side = math.isqrt(per_picture)
    grids, start = [], 0
    for run in runs:
        for first in range(start, start + run, per_picture):
            grids.append([TokenGrid("tokens", side, side, list(range(first, first + per_picture)), cell)])
        start += run
    return grids


def tower_patches(model: nn.Module, inputs: dict[str, Any]) -> list[int] | None:
    """Patches of every picture a packed vision tower encodes for `inputs` (Qwen: from the
    processor's grids), or None where every picture is the tower's fixed patch grid."""
    count = getattr(vlm_plugin(model), "tower_patches", None)
    return None if count is None else count(model, inputs)
