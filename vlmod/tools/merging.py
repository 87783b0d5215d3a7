"""Token merging by similarity (ToMe's bipartite soft matching): the pre-LLM reduction's
alternative to dropping (`PreLLMReduction(merge=True)`). Each frame's vision tokens are merged
down to the kept count, the most alike first, so what stands apart (a small glyph, an edge) stays a
token of its own and what repeats (a uniform background, a shape's inside) becomes one token that
carries its group's mean. A dropped token is gone; a merged one still says what was there.

A round pairs each token of one half (every other token in reading order) with the most
cosine-similar token of the other half and merges the r best pairs into their partners (means
weighted by how many patches each already holds), as ToMe does in each ViT block. Here rounds
repeat until a frame holds its kept count, at most `ROUND_SHARE` of a half merging a round: letting
a whole half merge at once forces every one of its tokens into a partner, glyphs too (fine-detail
set with the glyphs off the pooling windows, seed 0, dense weights, first 400 questions, a quarter
kept: 67.5% against 88.8% at 0.5; 86.2% at 0.25). A survivor keeps its place and so its position
id: the language model reads the group where one of its patches was.

The matching reads the features (detached); the means carry gradients, so a model trained behind
the merging learns through them. Every frame merges alone (a clip's frames are not merged with
each other) and every frame of a batch alike, in one set of tensor ops a round: no host sync and
no Python loop over tokens or frames, a few rounds (about log(1 / keep) / log(1 / (1 - share / 2))).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vlmod.routing.schedule import capacity_to_k

ROUND_SHARE = 0.5  # of the half that merges, the share that may merge in one round


def _round_sizes(tokens: int, keep: int, share: float) -> list[tuple[int, int]]:
    """(tokens before the round, pairs it merges) of each round that takes `tokens` down to `keep`."""
    rounds = []
    while tokens > keep:
        merged = min(tokens - keep, max(1, int(math.ceil(tokens / 2) * share)))
        rounds.append((tokens, merged))
        tokens -= merged
    return rounds


def _half(x: Tensor, first: bool) -> Tensor:
    """The first (even places) or second (odd places) half of each frame's tokens."""
    return x[:, ::2] if first else x[:, 1::2]


def _take(x: Tensor, index: Tensor) -> Tensor:
    """x [F, T, C] at `index` [F, K] of each frame."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def merge_tokens(features: Tensor, keep: int, share: float = ROUND_SHARE) -> tuple[Tensor, Tensor]:
    """(merged [F, T, D]: each survivor's group mean in its place, the other tokens as given;
    survivors [F, T], `keep` a frame) of `features` [F, T, D] (each frame's tokens in reading
    order), merged a frame at a time."""
    if features.dim() != 3:
        raise ValueError(f"merge_tokens takes features [frames, tokens, dim], got shape {tuple(features.shape)}")
    frames, tokens, dim = features.shape
    if not 1 <= keep <= tokens:
        raise ValueError(f"keep must be between 1 and the {tokens} tokens a frame, got {keep}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1] (the part of a half that may merge a round), got {share}")
    origin = torch.arange(tokens, device=features.device).expand(frames, -1)  # each token's first patch
    sums = features.float()
    sizes = sums.new_ones(frames, tokens, 1)
    for _, merged in _round_sizes(tokens, keep, share):
        first, second = F.normalize(_half(sums, True).detach(), dim=-1), F.normalize(_half(sums, False).detach(), dim=-1)
        sims = first @ second.transpose(1, 2)
        best, partner = sims.max(-1)  # [F, A]: each token of the first half, its nearest of the second
        ranked = best.argsort(dim=-1, descending=True, stable=True)
        moving, staying = ranked[:, :merged], ranked[:, merged:]
        into = partner.gather(1, moving).unsqueeze(-1)
        targets_sum = _half(sums, False).scatter_add(1, into.expand(-1, -1, dim), _take(_half(sums, True), moving))
        targets_size = _half(sizes, False).scatter_add(1, into, _take(_half(sizes, True), moving))
        origin_left = torch.cat([_half(origin, True).gather(1, staying), _half(origin, False)], 1)
        order = origin_left.argsort(1)  # back to reading order, so the halves alternate in space again
        origin = origin_left.gather(1, order)
        sums = _take(torch.cat([_take(_half(sums, True), staying), targets_sum], 1), order)
        sizes = _take(torch.cat([_take(_half(sizes, True), staying), targets_size], 1), order)
    means = (sums / sizes).to(features.dtype)
    merged_features = features.scatter(1, origin.unsqueeze(-1).expand(-1, -1, dim), means)
    survivors = torch.zeros(frames, tokens, dtype=torch.bool, device=features.device).scatter(1, origin, True)
    return merged_features, survivors


def merge_flops(tokens: int, keep: int, dim: int, share: float = ROUND_SHARE) -> float:
    """FLOPs of merging one frame's `tokens` features of width `dim` down to `keep`: each round's
    normalisation and similarities (a multiply-add per pair and channel), the merged sums, and
    the final division."""
    rounds = _round_sizes(tokens, keep, share)
    total = sum(3.0 * n * dim + 2.0 * ((n + 1) // 2) * (n // 2) * dim + merged * (dim + 1) for n, merged in rounds)
    return total + keep * dim if rounds else 0.0


def _per_frame(tokens: int, frames: int, keep: float) -> tuple[int, int]:
    """(tokens a frame, survivors a frame: ceil(keep * that), as the engine counts kept slots)."""
    per_frame = tokens // frames if frames else 0
    if per_frame == 0 or per_frame * frames != tokens:
        raise ValueError(f"merge: {tokens} vision tokens do not split evenly over {frames} frames")
    return per_frame, max(1, capacity_to_k(keep, per_frame))


def merge_frames(features: Tensor, frames: int, keep: float) -> tuple[Tensor, Tensor]:
    """`merge_tokens` on `features` [N, D], `frames` frames of equal length one after another,
    each merged to the `keep` fraction of its tokens: ([N, D], survivors [N])."""
    per_frame, survivors = _per_frame(features.shape[0], frames, keep)
    merged, kept = merge_tokens(features.view(frames, per_frame, -1), survivors)
    return merged.view_as(features), kept.flatten()


def frame_merge_flops(tokens: int, frames: int, keep: float, dim: int) -> float:
    """`merge_flops` of `merge_frames` on `tokens` features over `frames` frames."""
    per_frame, survivors = _per_frame(tokens, frames, keep)
    return merge_flops(per_frame, survivors, dim) * frames


__all__ = ["ROUND_SHARE", "frame_merge_flops", "merge_flops", "merge_frames", "merge_tokens"]
