"""InternVL (`InternVLForConditionalGeneration`): the language model (Qwen2 or Llama), images and
video (its frames are image tokens), and the InternViT tower.

The decoder layers are the Qwen2 / Llama ones the LLaVA plugin already wraps, so this file only
says where they are. `<img>` / `</img>` around each image's context tokens are text and always
run. InternViT (`InternVLVisionModel`) is a plain pre-norm ViT with layer scale and one class
token, its blocks called as `layer(hidden_states)`: the shared ViT adapter routes its patches
(the attention router is not supported there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from vlmod.config import MoDConfig
from vlmod.plugins import PartSpec
from vlmod.plugins.decoder import TokenGrid, check_part, language_part, token_runs
from vlmod.plugins.vit import ViTAdapter

FAMILIES = ("Hugging Face InternVLForConditionalGeneration",)


def _classes() -> tuple[type, ...]:
    import transformers as tf

    return (tf.InternVLForConditionalGeneration,) if hasattr(tf, "InternVLForConditionalGeneration") else ()


def matches(model: nn.Module) -> bool:
    return isinstance(model, _classes())


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if check_part(model, part) == "vision":
        tower = model.model.vision_tower
        blocks = tower.encoder.layer
        return PartSpec(
            name="vision", family="internvl", root=tower, entry=tower, blocks=blocks,
            dim=tower.config.hidden_size, adapter=ViTAdapter(type(blocks[0]), num_prefix=1, config=config),
        )
    return language_part(model, config, "internvl")


def token_grids(
    model: nn.Module, inputs: dict[str, Any], sizes: Sequence[tuple[int, int]], as_video: bool = False
) -> list[list[TokenGrid]]:
    """Fixed tiles: each picture's `<img>`...`</img>` run holds `image_seq_length` tokens per
    tile, a square grid (the tower's patch grid, pixel-shuffled). More than one tile: rows x cols
    crops of the picture (the grid whose aspect ratio is nearest the picture's, as the processor
    chooses it), then a thumbnail of the whole picture."""
    config = model.config
    per_tile = config.image_seq_length
    side = math.isqrt(per_tile)
    cell = config.vision_config.patch_size[0] if isinstance(config.vision_config.patch_size, (list, tuple)) else config.vision_config.patch_size
    cell = int(round(cell / config.downsample_ratio))
    grids, start = [], 0
    for i, run in enumerate(token_runs(inputs["input_ids"][0], config.image_token_id)):
        tiles = run // per_tile
        thumb = start + (tiles - 1) * per_tile
        overview = TokenGrid("overview" if tiles > 1 else "tokens", side, side, list(range(thumb, thumb + per_tile)), cell)
        if tiles == 1:
            grids.append([overview])
        else:
            width, height = sizes[min(i, len(sizes) - 1)]
            n = tiles - 1
            r, c = min(((r, n // r) for r in range(1, n + 1) if n % r == 0),
                       key=lambda rc: abs(math.log(rc[1] / rc[0]) - math.log(width / height)))
            detail = [start + (tr * c + tc) * per_tile + y * side + x
                      for tr in range(r) for y in range(side) for tc in range(c) for x in range(side)]
            grids.append([TokenGrid("high-res", r * side, c * side, detail, cell), overview])
        start += run
    return grids
