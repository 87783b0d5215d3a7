"""Pre-LLM reduction with pooling: each frame's tokens averaged in pool x pool windows before the
ranking (`PreLLMReduction(pool=...)`), on a tiny LLaVA (an 8 x 8 grid of patches an image)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.reduction import SIDE, image_features

from vlmod.tools.reduction import PreLLMReduction, reduction_flops


def _pooled_features(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """[images, (SIDE / 2) ** 2, D] each 2 x 2 window's mean feature, the windows row-major."""
    grid = image_features(model, batch).view(-1, SIDE, SIDE, model.config.text_config.hidden_size).permute(0, 3, 1, 2)
    return F.avg_pool2d(grid, 2).flatten(2).transpose(1, 2)


def test_pooling_keeps_every_window_mean_at_its_first_patch(model: torch.nn.Module, batch: dict) -> None:
    """keep 1/4 at pool 2: every window enters as its mean, at its first patch's place and
    position id, in order; the text around it as before."""
    with torch.no_grad():
        reduced = PreLLMReduction(model, 0.25, "deviation", pool=2).reduce(batch)
        expected = _pooled_features(model, batch)
    anchors = [3 + r * SIDE + c for r in range(0, SIDE, 2) for c in range(0, SIDE, 2)]
    for row in range(2):
        kept = reduced["attention_mask"][row].bool()
        index = reduced["index"][row][kept]
        real_text = [i for i in range(batch["input_ids"].shape[1]) if batch["attention_mask"][row, i]
                     and batch["input_ids"][row, i] != model.config.image_token_id]
        assert index.tolist() == sorted(real_text + anchors)
        vision = reduced["inputs_embeds"][row][kept][torch.isin(index, torch.tensor(anchors))]
        assert torch.allclose(vision, expected[row], atol=1e-5)
        assert reduced["position_ids"][row][kept].tolist() == index.tolist()


@pytest.mark.parametrize("scoring", ["deviation", "mean", "cls"])
def test_pooling_ranks_the_windows(model: torch.nn.Module, batch: dict, scoring: str) -> None:
    """Below 1/4 the windows are ranked: by their pooled features' deviation, or by the
    attention their patches receive, summed."""
    keep = 0.125  # 8 of 64 patches: half the 16 windows
    reducer = PreLLMReduction(model, keep, scoring, pool=2)
    with torch.no_grad():
        _, scores, _ = reducer._media(batch)
        _, patch_scores, _ = PreLLMReduction(model, keep, scoring)._media(batch)
        reduced = reducer.reduce(batch)
        pooled = _pooled_features(model, batch)
    windows = scores.view(2, SIDE, SIDE)[:, ::2, ::2].flatten(1)
    if scoring == "deviation":
        expected = (pooled - pooled.mean(1, keepdim=True)).norm(dim=-1)
    else:
        expected = F.avg_pool2d(patch_scores.view(2, 1, SIDE, SIDE), 2).flatten(1) * 4
    assert torch.allclose(windows, expected, atol=1e-5)
    others = torch.ones(SIDE, SIDE, dtype=torch.bool)
    others[::2, ::2] = False
    assert bool(torch.isneginf(scores.view(2, SIDE, SIDE)[:, others]).all())  # never kept
    top = windows.topk(math.ceil(keep * SIDE * SIDE), dim=1).indices.sort(dim=1).values
    anchor_of = torch.tensor([3 + r * SIDE + c for r in range(0, SIDE, 2) for c in range(0, SIDE, 2)])
    for row in range(2):
        kept = reduced["index"][row][reduced["attention_mask"][row].bool()]
        assert torch.equal(kept[torch.isin(kept, anchor_of)], anchor_of[top[row]])


def test_pooling_counts_its_flops(model: torch.nn.Module, batch: dict) -> None:
    """The same language model FLOPs as dropping to the same keep; the pooling's adds and
    divisions on the vision side."""
    plain = reduction_flops(PreLLMReduction(model, 0.25, "deviation"), batch)
    pooled = reduction_flops(PreLLMReduction(model, 0.25, "deviation", pool=2), batch)
    assert pooled["language"] == plain["language"]
    dim = model.config.text_config.hidden_size
    assert pooled["vision"] - plain["vision"] == pytest.approx(dim * SIDE * SIDE * 1.25)


def test_pooling_refuses_what_it_cannot_do(model: torch.nn.Module, batch: dict) -> None:
    with pytest.raises(ValueError, match=r"keep 0.5 is more than pooling 2 x 2 leaves .*give keep <= 0.25"):
        PreLLMReduction(model, 0.5, "deviation", pool=2)
    for pool in (0, 1.5, True):
        with pytest.raises(ValueError, match="pool must be a whole number >= 1"):
            PreLLMReduction(model, 0.1, "deviation", pool=pool)
    with pytest.raises(ValueError, match="two ways of merging"):
        PreLLMReduction(model, 0.2, "deviation", contextual=0.2, pool=2)
    with pytest.raises(ValueError, match="do not form square grids whose side divides by 3: give pool=1"):
        PreLLMReduction(model, 0.1, "deviation", pool=3).reduce(batch)
