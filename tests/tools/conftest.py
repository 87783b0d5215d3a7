"""What the pre-LLM reduction tests (test_reduction_pool, test_merging) share: `model`, a tiny
LLaVA with an 8 x 8 grid of patches an image (32 px, 4 px patches), and `batch`, two rows of it,
one left-padded. A module with fixtures of those names (the bench tests') shadows them."""

from __future__ import annotations

import pytest
import torch
from helpers.reduction import SIDE

from vlmod.models import tiny


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    built, _ = tiny.build("llava", width=64, layers=2, vision_width=32, vision_layers=2, image_size=32, patch_size=4,
                          vision_feature_layer=-1, seed=3)
    return built.eval()


@pytest.fixture(scope="module")
def batch(model: torch.nn.Module) -> dict:
    torch.manual_seed(0)
    ids = torch.full((2, SIDE * SIDE + 6), 5, dtype=torch.long)
    ids[:, 3 : 3 + SIDE * SIDE] = model.config.image_token_id
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(2, 3, 32, 32)}
