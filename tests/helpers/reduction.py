"""The pre-LLM reduction tests' grid and features (their fixtures: tests/tools/conftest.py)."""

from __future__ import annotations

import torch

SIDE = 8  # patches a side: 32 px images, 4 px patches


def image_features(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """[images * SIDE ** 2, D]: the projected features the language model would read, image by image."""
    cfg = model.config
    out = model.model.get_image_features(batch["pixel_values"], vision_feature_layer=cfg.vision_feature_layer,
                                         vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                                         return_dict=True).pooler_output
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in out])
