"""A pre-LLM keep that reads the question: `PreLLMReduction(scoring="query", scorer=...)`.

The other rankings of the pre-LLM reduction (the tower's attention, the features' deviation,
merging) choose the vision tokens before anything has read the question. Where the picture holds
more candidate answers than the keep has slots (a page of about 20 glyphs, each over 4 of 144
tokens, at 8x: at most 46.5% of the tokens may enter layer 0), such a keep cannot know which one is
asked. `QueryScorer` scores each projected vision token against the mean input embedding of the
prompt's text tokens (a rank-r bilinear term plus a question-blind one: 8,609 weights at width 128,
about 1.4 MFLOPs a 144-token picture), so the keep is chosen for the question.

`fit_query_scorer` fits it, on training media, to what a fine-tuned MoD model's routed layers run
when every token enters (each vision token's share of those layers, a listwise softmax loss): the
model's own routing is the teacher, no answer box is read. On the crowded fine-detail page the
fitted scorer keeps the asked glyph's patches in its 28.5% for 92-95% of pictures (deviation:
36-46%), and the stacked stage trained behind it holds 8x within a point of dense on three seeds
where the stack on merging lost 4.6 on one (docs/results-history.md).

A scorer is saved as `query_scorer.safetensors` with its shape in `query_scorer.json`, each written
under a temporary name and renamed, so neither is ever half-written (a folder left with one of them
says so when loaded).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.tools.reduction import IGNORE_INDEX, PreLLMReduction

SCORER_WEIGHTS = "query_scorer.safetensors"
SCORER_CONFIG = "query_scorer.json"


class QueryScorer(nn.Module):
    """s_i = <K norm(v_i), Q q> / sqrt(r) + p(norm(v_i)): vision token i (a projected feature, what
    the language model reads) against q, the mean input embedding of its row's prompt."""

    def __init__(self, dim: int, rank: int = 32) -> None:
        super().__init__()
        if dim < 1 or rank < 1:
            raise ValueError(f"QueryScorer needs a width and a rank of at least 1, got {dim} and {rank}")
        self.dim, self.rank = int(dim), int(rank)
        self.norm = nn.LayerNorm(dim)
        self.key = nn.Linear(dim, rank)
        self.query = nn.Linear(dim, rank, bias=False)
        self.prior = nn.Linear(dim, 1)

    def forward(self, vision: Tensor, question: Tensor) -> Tensor:
        """vision [..., N, D], question [..., D] -> scores [..., N], float32 (inputs in the scorer's dtype)."""
        dtype = self.key.weight.dtype
        h = self.norm(vision.to(dtype))
        q = self.query(question.to(dtype)).unsqueeze(-2)
        return ((self.key(h) * q).sum(-1) / math.sqrt(self.rank) + self.prior(h).squeeze(-1)).float()

    def score_media(self, features: Tensor, inputs: Mapping[str, Any], token_id: int, embeddings: nn.Module) -> Tensor:
        """[N]: the vision features [N, D] of a batch (placeholder order) scored against their rows'
        prompts (`inputs`: input_ids, attention_mask, labels where training), what the reduction asks."""
        is_media = inputs["input_ids"] == token_id
        return self(per_row(features, is_media), prompt_mean(embeddings, inputs, token_id)).reshape(-1)

    def flops(self, tokens: float) -> float:
        """FLOPs for one row of `tokens` vision tokens: the norm, the key and prior projections and
        the dot product of each token, and the question's projection once."""
        return tokens * (8.0 * self.dim + 2.0 * self.dim * (self.rank + 1) + 2.0 * self.rank) + 2.0 * self.dim * self.rank


def prompt_mean(embeddings: nn.Module, inputs: Mapping[str, Any], media_token_id: int) -> Tensor:
    """[B, D] float32: the mean input embedding of each row's text tokens (neither media
    placeholders, padding nor, where `labels` are given, the answer being trained on)."""
    ids = inputs["input_ids"]
    text = (ids != media_token_id) & inputs["attention_mask"].bool()
    if inputs.get("labels") is not None:
        text &= inputs["labels"] == IGNORE_INDEX
    with torch.no_grad():
        embeds = embeddings(ids).float()
    return (embeds * text.unsqueeze(-1)).sum(1) / text.sum(1, keepdim=True).clamp_min(1)


def per_row(values: Tensor, is_media: Tensor) -> Tensor:
    """[B, n, ...] from `values` [N, ...] in placeholder order: every row must hold as many media
    tokens (images of one size, clips of one length), as the scorer's listwise view needs."""
    counts = is_media.sum(1)
    if bool((counts != counts[0]).any()):
        raise ValueError("the query keep scores rows of as many vision tokens each; this batch's rows hold "
                         f"{sorted(set(counts.tolist()))}: give images of one size (clips of one length) a batch")
    return values.view(is_media.shape[0], int(counts[0]), *values.shape[1:])


def routed_targets(model: nn.Module, reducer: PreLLMReduction, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """(vision [B, n, D], question [B, D], target [B, n]) of one batch: the projected vision
    features, the prompt's mean embedding, and the share of the MoD model's routed language layers
    that ran each vision token when every token entered. `reducer`: a `PreLLMReduction` of the
    model, for its features in placeholder order."""
    from vlmod.routing.trace import trace_routing

    with torch.no_grad():
        with trace_routing(model) as trace:
            model(**batch)
        features, _, token_id = reducer._ranked_media(batch)
    ran = [p.float() for (part, _), p in trace.processed.items() if part == "language"]
    is_media = batch["input_ids"] == token_id
    target = torch.stack(ran).mean(0)[is_media]
    question = prompt_mean(model.get_input_embeddings(), batch, token_id)
    return per_row(features.float(), is_media), question, per_row(target, is_media)


def routed_dataset(model: nn.Module, dataset: Any, count: int, batch_size: int = 16,
                   progress: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """`routed_targets` of the first `count` items of `dataset`, batch by batch, joined:
    (vision [count, n, D], question [count, D], target [count, n])."""
    from tqdm import tqdm

    reducer = PreLLMReduction(model, 1.0, "deviation")
    parts = []
    for start in tqdm(range(0, count, batch_size), desc="query keep: targets", disable=not progress):
        parts.append(routed_targets(model, reducer, dataset.collate([dataset[i] for i in range(start, min(start + batch_size, count))])))
    if len({v.shape[1] for v, _, _ in parts}) > 1:
        raise ValueError("the query keep is fitted on media of one size: every picture (clip) must give as many "
                         "vision tokens")
    vision, question, target = (torch.cat(chunk) for chunk in zip(*parts, strict=True))
    return vision, question, target


def fit_query_scorer(model: nn.Module, dataset: Any, samples: int, steps: int = 1500, rank: int = 32,
                     batch_size: int = 16, seed: int = 0, progress: bool = True) -> QueryScorer:
    """A `QueryScorer` fitted to `model`'s routing (a fine-tuned MoD model) on the first `samples`
    items of `dataset` (a `LlavaDataset` of training records): their targets once, then `steps`
    Adam steps of a listwise loss on random batches of 64 rows."""
    from tqdm import tqdm

    from vlmod.routing.trace import find_parts

    if samples < 1 or steps < 1:
        raise ValueError(f"fitting the query keep needs at least one sample and one step, got {samples} and {steps}")
    if not any(part.name == "language" for part in find_parts(model)):
        raise ValueError("fitting the query keep needs a model with MoD language layers (vlmod.apply_mod) to learn from")
    v_all, q_all, t_all = routed_dataset(model, dataset, min(samples, len(dataset)), batch_size, progress)
    goal = t_all / t_all.sum(1, keepdim=True).clamp_min(1e-6)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # the scorer's initial weights from `seed`, the caller's RNG untouched
        torch.manual_seed(seed)
        scorer = QueryScorer(v_all.shape[-1], rank)
    optimizer = torch.optim.Adam(scorer.parameters(), lr=3e-3)
    for _ in tqdm(range(steps), desc="query keep: fit", disable=not progress):
        pick = torch.randint(0, v_all.shape[0], (64,), generator=generator)
        loss = -(goal[pick] * F.log_softmax(scorer(v_all[pick], q_all[pick]), -1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return scorer.eval().requires_grad_(False)


def save_query_scorer(scorer: QueryScorer, folder: str | Path) -> Path:
    """Write `scorer` into `folder` (created if needed): weights, then shape, each renamed into place."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in scorer.state_dict().items()}
    for name, write in ((SCORER_WEIGHTS, lambda p: save_file(weights, str(p))),
                        (SCORER_CONFIG, lambda p: p.write_text(json.dumps({"dim": scorer.dim, "rank": scorer.rank})))):
        partial = folder / f".{name}.partial"
        write(partial)
        os.replace(partial, folder / name)
    return folder


def load_query_scorer(folder: str | Path) -> QueryScorer:
    """The scorer `save_query_scorer` wrote into `folder`; a clear error where there is none."""
    from safetensors.torch import load_file

    folder = Path(folder)
    missing = [name for name in (SCORER_WEIGHTS, SCORER_CONFIG) if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder} holds no query keep scorer (no {' or '.join(missing)}); fit one with "
                         "vlmod.tools.query_keep.fit_query_scorer and save it there")
    shape = json.loads((folder / SCORER_CONFIG).read_text())
    scorer = QueryScorer(int(shape["dim"]), int(shape["rank"]))
    scorer.load_state_dict(load_file(str(folder / SCORER_WEIGHTS)))
    return scorer.eval().requires_grad_(False)


__all__: Sequence[str] = ["QueryScorer", "fit_query_scorer", "load_query_scorer", "per_row", "prompt_mean", "routed_dataset", "routed_targets",
                          "save_query_scorer"]
