"""The pre-LLM keep that reads the question (`vlmod.tools.query_keep`, `PreLLMReduction(scoring=
"query")`) on the tiny LLaVA of tests/tools/conftest.py: what it keeps, what it costs, how it is
fitted to a MoD model's routing, saved and loaded, and what it refuses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.reduction import SIDE, image_features

import vlmod
from vlmod.data.collate import collate
from vlmod.tools.query_keep import (
    SCORER_CONFIG,
    SCORER_WEIGHTS,
    QueryScorer,
    fit_query_scorer,
    load_query_scorer,
    per_row,
    prompt_mean,
    save_query_scorer,
)
from vlmod.tools.reduction import PreLLMReduction, reduction_flops


def _scorer(model: torch.nn.Module, seed: int = 0) -> QueryScorer:
    torch.manual_seed(seed)
    scorer = QueryScorer(model.config.text_config.hidden_size, rank=4)
    for p in scorer.parameters():
        torch.nn.init.normal_(p)
    torch.nn.init.zeros_(scorer.prior.weight)  # the ranking then rests on the question alone
    return scorer.eval()


def _kept(reducer: PreLLMReduction, batch: dict) -> list[set[int]]:
    """Each row's kept vision tokens, as indices into its image's patches."""
    out = reducer.reduce(batch)
    image_token = reducer.model.config.image_token_id
    rows = []
    for row in range(batch["input_ids"].shape[0]):
        first = int((batch["input_ids"][row] == image_token).nonzero()[0])
        kept = out["index"][row][out["attention_mask"][row].bool()]
        rows.append({int(i) - first for i in kept if batch["input_ids"][row, i] == image_token})
    return rows


def test_the_keep_is_each_rows_top_k_by_its_scorer_against_that_rows_prompt(model, batch) -> None:
    """The kept vision tokens are the scorer's top ceil(keep * 64) for each row, their features
    scored against the mean embedding of that row's text; another prompt keeps other tokens of the
    same picture."""
    scorer, keep = _scorer(model), 0.25
    reducer = PreLLMReduction(model, keep, "query", scorer=scorer)
    features = image_features(model, batch).view(2, SIDE * SIDE, -1)
    scores = scorer(features, prompt_mean(model.get_input_embeddings(), batch, model.config.image_token_id))
    k = math.ceil(keep * SIDE * SIDE)
    assert _kept(reducer, batch) == [set(scores[row].topk(k).indices.tolist()) for row in range(2)]

    other = {**batch, "input_ids": batch["input_ids"].clone()}
    text = other["input_ids"] != model.config.image_token_id
    other["input_ids"][text] = 9  # another prompt, the same pictures
    assert _kept(reducer, other) != _kept(reducer, batch)


def test_the_answer_is_left_out_of_the_prompts_mean(model, batch) -> None:
    """Training rows carry their answer: only the prompt is read (the answer is not known when
    the keep runs at inference)."""
    embed, image = model.get_input_embeddings(), model.config.image_token_id
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, -2:] = batch["input_ids"][:, -2:]
    changed = batch["input_ids"].clone()
    changed[:, -2:] = 11
    trained = prompt_mean(embed, {**batch, "input_ids": changed, "labels": labels}, image)
    prompt_only = prompt_mean(embed, {"input_ids": batch["input_ids"][:, :-2],
                                      "attention_mask": batch["attention_mask"][:, :-2]}, image)
    assert torch.allclose(trained, prompt_only)


def test_its_flops_count_the_scorer(model, batch) -> None:
    scorer = _scorer(model)
    query = reduction_flops(PreLLMReduction(model, 0.25, "query", scorer=scorer), batch)
    deviation = reduction_flops(PreLLMReduction(model, 0.25, "deviation"), batch)
    dim = model.config.text_config.hidden_size
    assert query["language"] == deviation["language"]  # as many tokens kept
    assert query["vision"] - deviation["vision"] == pytest.approx(scorer.flops(SIDE * SIDE) - 4.0 * dim * SIDE * SIDE)
    assert QueryScorer(128, 32).flops(144) == pytest.approx(1.38e6, rel=0.01)  # the docs' 1.4 MFLOPs a picture


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"scoring": "query"}, "give both, or neither"),
    ({"scoring": "deviation", "scorer": "fitted"}, "give both, or neither"),
    ({"scoring": "query", "scorer": "fitted", "merge": True}, "no pool, merge or contextual"),
    ({"scoring": "query", "scorer": "fitted", "contextual": 0.2}, "no pool, merge or contextual"),
])
def test_what_the_query_keep_refuses(model, kwargs: dict, message: str) -> None:
    if kwargs.get("scorer") == "fitted":
        kwargs = {**kwargs, "scorer": _scorer(model)}
    with pytest.raises(ValueError, match=message):
        PreLLMReduction(model, 0.25, **kwargs)


def test_rows_of_unequal_vision_tokens_are_refused_in_one_line() -> None:
    """The listwise view needs as many vision tokens in every row (images of one size a batch)."""
    is_media = torch.zeros(2, 10, dtype=torch.bool)
    is_media[0, 2:7] = True
    is_media[1, 2:6] = True
    with pytest.raises(ValueError, match=r"as many vision tokens each; this batch's rows hold \[4, 5\]"):
        per_row(torch.randn(9, 3), is_media)
    even = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # padding apart
    assert torch.equal(per_row(torch.arange(8.0), even), torch.arange(8.0).view(2, 4))


class _Items:
    """A dataset of training rows (prompt, picture, answer) as `fit_query_scorer` reads them."""

    def __init__(self, model: torch.nn.Module, count: int) -> None:
        torch.manual_seed(4)
        self.items = []
        for i in range(count):
            ids = torch.tensor([5 + i % 3, 6] + [model.config.image_token_id] * SIDE * SIDE + [7, 8 + i % 2])
            labels = torch.full_like(ids, -100)
            labels[-1] = ids[-1]
            self.items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                               "pixel_values": torch.randn(1, 3, 32, 32)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    @staticmethod
    def collate(items: list) -> dict:
        return collate(items)


def test_a_scorer_is_fitted_to_the_mod_models_routing_saved_whole_and_loaded(model, tmp_path) -> None:
    """Fitted from a MoD model's routed layers (every token entering), the same seed gives the same
    scorer; saved under temporary names and renamed, it loads to the same scores."""
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.25, router="attention"))
    data = _Items(model, 6)
    first = fit_query_scorer(mod, data, samples=6, steps=20, rank=4, batch_size=4, progress=False)
    again = fit_query_scorer(mod, data, samples=6, steps=20, rank=4, batch_size=4, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True))
    assert not any(p.requires_grad for p in first.parameters())

    save_query_scorer(first, tmp_path / "keep")
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == sorted([SCORER_CONFIG, SCORER_WEIGHTS])
    loaded = load_query_scorer(tmp_path / "keep")
    v, q = torch.randn(2, 64, first.dim), torch.randn(2, first.dim)
    assert torch.equal(loaded(v, q), first(v, q))

    with pytest.raises(ValueError, match="holds no query keep scorer"):
        load_query_scorer(tmp_path)
    with pytest.raises(ValueError, match="needs a model with MoD language layers"):
        fit_query_scorer(model, data, samples=2, steps=1, progress=False)


def test_a_bfloat16_keep_scores_bfloat16_features(model, batch) -> None:
    """A reduction moved to bfloat16 (the model's and the scorer's weights) still scores, in
    float32 out, and keeps as many tokens."""
    low = PreLLMReduction(copy.deepcopy(model), 0.25, "query", scorer=_scorer(model)).to(torch.bfloat16)
    kept = _kept(low, batch)
    assert [len(row) for row in kept] == [math.ceil(0.25 * SIDE * SIDE)] * 2
    assert low.scorer(torch.randn(1, 3, low.scorer.dim), torch.randn(1, low.scorer.dim)).dtype == torch.float32
