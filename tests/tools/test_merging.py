"""Token merging (`vlmod.tools.merging`, ToMe's bipartite matching in rounds) and the pre-LLM
reduction that merges instead of dropping (`PreLLMReduction(merge=True)`) on a tiny LLaVA."""

from __future__ import annotations

import pytest
import torch
from helpers.reduction import SIDE, image_features

from vlmod.tools.merging import (
    ROUND_SHARE,
    _round_sizes,
    frame_merge_flops,
    merge_flops,
    merge_frames,
    merge_tokens,
)
from vlmod.tools.reduction import PreLLMReduction, reduction_flops


def _background_and_glyphs(frames: int = 1) -> torch.Tensor:
    """[frames, 16, 8]: a background of nearly one feature with two tokens unlike it (and each other)."""
    torch.manual_seed(0)
    x = torch.ones(frames, 16, 8) + 0.01 * torch.randn(frames, 16, 8)
    x[:, 5] = torch.tensor([0.0, 0, 0, 0, 0, 0, 5, -5])
    x[:, 10] = torch.tensor([-5.0, 5, 0, 0, 0, 0, 0, 0])
    return x


def test_what_stands_apart_survives_and_the_background_merges() -> None:
    """Two tokens unlike the background and each other stay as they are, at their own places;
    the background's survivors are means of background tokens only."""
    x = _background_and_glyphs()
    merged, survivors = merge_tokens(x, 6)
    assert survivors.sum().item() == 6
    assert survivors[0, 5] and survivors[0, 10]
    assert torch.equal(merged[0, 5], x[0, 5]) and torch.equal(merged[0, 10], x[0, 10])
    rest = [i for i in survivors[0].nonzero().flatten().tolist() if i not in (5, 10)]
    assert (merged[0, rest] - 1).abs().max() < 0.05  # a glyph merged in would move a mean by over 0.3


def test_one_survivor_carries_the_mean_of_every_token() -> None:
    """Means are weighted by the patches each token already holds, so merging all the way down
    gives the plain mean, whatever the order of the rounds."""
    torch.manual_seed(1)
    x = torch.randn(2, 37, 5)
    merged, survivors = merge_tokens(x, 1)
    assert survivors.sum(1).tolist() == [1, 1]
    assert torch.allclose(merged[survivors], x.mean(1), atol=1e-5)
    assert torch.equal(merged[~survivors], x[~survivors])  # the rest as given: never kept


def test_frames_merge_alone_and_keep_their_count() -> None:
    torch.manual_seed(2)
    x = torch.randn(3, 20, 6)
    merged, survivors = merge_tokens(x, 7)
    assert survivors.sum(1).tolist() == [7, 7, 7]
    alone, kept = merge_tokens(x[1:2], 7)
    assert torch.equal(kept[0], survivors[1]) and torch.allclose(alone[0], merged[1])
    flat, flat_kept = merge_frames(x.reshape(60, 6), 3, 7 / 20)
    assert torch.equal(flat_kept, survivors.flatten()) and torch.allclose(flat, merged.reshape(60, 6))


def test_keeping_every_token_changes_nothing() -> None:
    x = torch.randn(2, 9, 4)
    merged, survivors = merge_tokens(x, 9)
    assert survivors.all() and torch.equal(merged, x)
    assert merge_flops(9, 9, 4) == 0.0


def test_gradients_reach_the_merged_tokens() -> None:
    x = _background_and_glyphs().requires_grad_(True)
    merged, survivors = merge_tokens(x, 3)
    merged[survivors].sum().backward()
    assert (x.grad[0].abs().sum(-1) > 0).all()  # every patch feeds its group's mean


def test_merging_counts_every_round() -> None:
    """Rounds until the count is reached, at most half of one half merging a round (144 -> 36:
    five rounds); each round's similarities (a x b pairs) dominate its FLOPs."""
    assert _round_sizes(144, 36, ROUND_SHARE) == [(144, 36), (108, 27), (81, 20), (61, 15), (46, 10)]
    dim = 8
    pairs = 2 * dim * (72 * 72 + 54 * 54 + 41 * 40 + 31 * 30 + 23 * 23)
    assert pairs < merge_flops(144, 36, dim) < 1.1 * pairs
    assert frame_merge_flops(288, 2, 0.25, dim) == 2 * merge_flops(144, 36, dim)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"keep": 0}, "keep must be between 1"),
    ({"keep": 17}, "keep must be between 1"),
    ({"keep": 3, "share": 0.0}, "share must be in"),
])
def test_merge_refuses_what_it_cannot_do(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        merge_tokens(_background_and_glyphs(), **kwargs)
    with pytest.raises(ValueError, match="features"):
        merge_tokens(torch.zeros(16, 8), 3)
    with pytest.raises(ValueError, match="do not split evenly"):
        merge_frames(torch.zeros(15, 8), 2, 0.5)


def test_the_reduction_enters_the_survivors_at_their_places(model: torch.nn.Module, batch: dict) -> None:
    """A quarter kept: each image's 16 survivors enter with their groups' means, in order and at
    their own position ids; the text around them as before."""
    with torch.no_grad():
        reduced = PreLLMReduction(model, 0.25, "deviation", merge=True).reduce(batch)
        merged, survivors = merge_frames(image_features(model, batch), 2, 0.25)
    for row in range(2):
        kept = reduced["attention_mask"][row].bool()
        index = reduced["index"][row][kept]
        places = (3 + survivors.view(2, -1)[row].nonzero().flatten()).tolist()
        real_text = [i for i in range(batch["input_ids"].shape[1]) if batch["attention_mask"][row, i]
                     and batch["input_ids"][row, i] != model.config.image_token_id]
        assert index.tolist() == sorted(real_text + places)
        vision = reduced["inputs_embeds"][row][kept][torch.isin(index, torch.tensor(places))]
        assert torch.allclose(vision, merged.view(2, SIDE * SIDE, -1)[row][survivors.view(2, -1)[row]], atol=1e-5)
        assert reduced["position_ids"][row][kept].tolist() == index.tolist()


def test_merging_nothing_is_the_dense_model(model: torch.nn.Module, batch: dict) -> None:
    with torch.no_grad():
        dense = model(**batch).logits
        merged = PreLLMReduction(model, 1.0, "deviation", merge=True)(**batch).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(merged[mask], dense[mask], atol=1e-5)


def test_the_reduction_counts_its_merging(model: torch.nn.Module, batch: dict) -> None:
    dropped = reduction_flops(PreLLMReduction(model, 0.25, "deviation"), batch)
    merged = reduction_flops(PreLLMReduction(model, 0.25, "deviation", merge=True), batch)
    assert merged["language"] == dropped["language"]  # the same kept tokens
    expected = frame_merge_flops(SIDE * SIDE * 2, 2, 0.25, model.config.text_config.hidden_size) / 2
    assert merged["vision"] == pytest.approx(dropped["vision"] + expected)


@pytest.mark.parametrize("kwargs", [{"pool": 2}, {"contextual": 0.2}])
def test_merging_is_one_way_of_merging(model: torch.nn.Module, kwargs: dict) -> None:
    with pytest.raises(ValueError, match="merge, pool and contextual"):
        PreLLMReduction(model, 0.25, "deviation", merge=True, **kwargs)
