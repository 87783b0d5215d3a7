"""Pre-LLM vision-token reduction (VisionZip-style): drop vision tokens before the language model.

What many users run today instead of MoD: the vision tower runs in full, its CLS token's
attention ranks the tower's output tokens, and only the `keep` fraction it attends to most
enters the language model (VisionZip's "dominant" tokens; FastV-like methods rank inside the
LLM instead, which is vlmod's training-free `attention` router). Unlike MoD, a dropped token is
gone for every layer; unlike frame subsampling, every frame keeps its most attended tokens.
With `contextual` > 0 a share of the kept slots carries VisionZip's "contextual" tokens instead:
the dropped tokens merged into a few by feature similarity, so what the ranking missed is not
wholly lost (video seed 0, 8x: reduction alone 55.0% -> 57.6% at 0.15 on the first 420 questions).

The score of a patch is the mean over heads of the softmax attention the CLS query pays it
(`scoring="cls"`, VisionZip's rule for CLIP) or the mean over every query of the attention it
receives (`scoring="mean"`, VisionZip's rule for towers without a CLS; also the choice where the
CLS was never trained, as in a tower trained from scratch under LLaVA, which reads only the
patches) in the tower layer that produces the features the projector reads (`vision_feature_layer`),
computed with that layer's own norm and projections (`vlmod.routing.attention`); pooled tokens
(LLaVA-NeXT-Video's frame pooling) sum the scores of the patches they pool. `scoring="deviation"`
reads no attention: it ranks each frame's (image's) features by their distance from that frame's
mean feature, so what stands out of a uniform background is kept (like the diversity rankings of
DART or DivPrune; cheaper than either); on towers whose attention ranks poorly it is the stronger
(image seed 0 at 3x: 69.2% against 56.0% for every query's attention, first 400 questions).
`scoring="novelty"` is the same on images and on a clip's first frame; past it, a feature scores
at most its distance from the same spot one frame earlier, so what stayed as it was (a still object,
the background) is not kept again and the slots go to what appeared, moved or changed (the
temporal redundancy DyCoke and FastVID prune; video seed 0, MoD stacked on it at 8x: 88.6% by
deviation -> 94.2% by novelty, trained behind each, all 2,520 questions; docs/results-history.md).
With `pool` > 1 each frame's (image's) square grid of tokens is first averaged in `pool` x `pool`
windows (LLaVA-OneVision's and LLaVA-NeXT-Video's 2 x 2 pooling): every patch still enters, four
to a token at 2, each pooled token at its window's first patch (its position id); the ranking then
scores the pooled tokens (a window's attention summed, the features' rankings on the pooled
features) and `keep`, at most 1 / pool ** 2, is still a share of the unpooled tokens. Where the
answer lies inside a window (a glyph over 2 x 2 patches aligned with it) pooling loses little
(fine-detail seed 0: 94.5% against 96.5% dense, first 400 questions), and MoD trained behind it
reaches 8x there (97.4% against 96.7%, all 1,200; docs/results.md).
With `merge` the tokens are merged instead of dropped (`vlmod.tools.merging`, ToMe's bipartite
matching): each frame's most alike tokens merge until `keep` of them are left, each survivor
carrying its group's mean at its own place (the ranking then only trims a clip's rounding).
Selection is the engine's: text is protected, the top-k vision tokens of each row are kept in their original
order (`vlmod.routing.selection`), and the kept sequence is left-padded for generation.

`scoring="query"` reads the question: a fitted `scorer` (`vlmod.tools.query_keep`) scores each
feature against the prompt's mean embedding.
Supported: `LlavaForConditionalGeneration` (images) and `LlavaNextVideoForConditionalGeneration`
(videos); the attention rankings need a CLIP tower (a CLS token), the feature rankings any tower
(SigLIP's too). Cost counted by `reduction_flops`: the dense tower, the scoring (the CLS query or
every query and the keys of one tower layer; a few FLOPs a feature), and the language model on
the kept tokens.

Stacked on MoD: `model` may carry MoD language layers (`vlmod.apply_mod`); the kept vision tokens
then compete for that model's k slots as usual. The language model is called with embeddings, in
which MoD cannot tell a vision token from text, so for the reduced prefill its token types are
taken from the kept positions' input ids (`_kept_token_types`); `reduction_flops` counts each MoD
layer on the tokens it ran (the prefill's routing trace).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.config import TokenType
from vlmod.routing.attention import AttentionQK, by_key_head, query_plan, received_attention
from vlmod.routing.schedule import capacity_to_k_tensor
from vlmod.routing.selection import TokenLayout, select_tokens
from vlmod.routing.trace import find_parts
from vlmod.tools.flops import vision_images
from vlmod.tools.merging import frame_merge_flops, merge_frames

IGNORE_INDEX = -100
SCORINGS = ("cls", "mean", "deviation", "novelty")
FEATURE_SCORINGS = ("deviation", "novelty", "query")  # read the features (and the prompt): no tower hook


def _check(model: nn.Module, scoring: str) -> None:
    """The attention rankings read one CLIP tower layer's CLS and patch queries; the feature
    rankings read only the features the projector gets, so any tower (SigLIP's too) and feature
    layout will do."""
    name = type(model).__name__
    if name not in ("LlavaForConditionalGeneration", "LlavaNextVideoForConditionalGeneration"):
        raise TypeError(
            f"pre-LLM reduction supports LlavaForConditionalGeneration and LlavaNextVideoForConditionalGeneration, "
            f"not {name}"
        )
    if scoring in FEATURE_SCORINGS:
        return
    ranked_by = f"scoring={scoring!r} ranks patches by a CLIP tower's attention"
    features = "scoring='deviation' or 'novelty' read the features alone"
    if getattr(model.config.vision_config, "model_type", "") != "clip_vision_model":
        raise ValueError(f"pre-LLM reduction: {ranked_by} (its CLS token's, or every query's); this tower is "
                         f"{model.config.vision_config.model_type}: {features}")
    if model.config.vision_feature_select_strategy != "default":
        raise ValueError(f"pre-LLM reduction: {ranked_by} with vision_feature_select_strategy='default' (the CLS "
                         f"token dropped); {features}")
    if not isinstance(model.config.vision_feature_layer, int):
        raise ValueError(f"pre-LLM reduction: {ranked_by} in one layer, and this model concatenates several "
                         f"(vision_feature_layer); {features}")


class PreLLMReduction(nn.Module):
    """`model` with only the `keep` fraction of each row's vision tokens entering its language model.

    Called like the model (teacher-forced: logits come back at the original positions, zeros
    where a token was dropped, so losses over answer tokens read them as usual) and through
    `generate` (greedy decoding from the kept tokens; returns prompt ids + new ids like
    `model.generate`)."""

    def __init__(self, model: nn.Module, keep: float, scoring: str = "cls", contextual: float = 0.0, pool: int = 1,
                 merge: bool = False, scorer: nn.Module | None = None):
        super().__init__()
        if scoring not in (*SCORINGS, "query"):
            raise ValueError(f"scoring must be one of {', '.join(SCORINGS)} or query, got {scoring!r}")
        if (scoring == "query") != (scorer is not None):
            raise ValueError("scoring='query' ranks by a fitted scorer: give both, or neither "
                             "(vlmod.tools.query_keep.fit_query_scorer fits one)")
        if scoring == "query" and (pool > 1 or merge or contextual > 0):
            raise ValueError("scoring='query' keeps the tokens its scorer ranks highest: give no pool, merge or contextual")
        _check(model, scoring)
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1] (the fraction of vision tokens kept), got {keep}")
        if not 0.0 <= contextual < 1.0:
            raise ValueError(f"contextual must be in [0, 1) (the share of the kept tokens that are merged), got {contextual}")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"pool must be a whole number >= 1 (the side of the square of tokens averaged into one), "
                             f"got {pool!r}")
        if pool > 1 and keep > 1.0 / pool**2:
            raise ValueError(f"keep {keep:g} is more than pooling {pool} x {pool} leaves (1/{pool ** 2} of the vision "
                             f"tokens): give keep <= {1.0 / pool ** 2:g}")
        if pool > 1 and contextual > 0:
            raise ValueError("contextual merging and pool are two ways of merging the tokens: give one of them")
        if merge and (pool > 1 or contextual > 0):
            raise ValueError("merge, pool and contextual are each a way of merging the tokens: give one of them")
        self.model = model
        self.keep = float(keep)
        self.scoring = scoring
        self.contextual = float(contextual)
        self.pool = pool
        self.merge = bool(merge)
        self.scorer = scorer
        self.last_length: int | None = None  # the language model's sequence length in the last forward

    @property
    def config(self) -> Any:
        return self.model.config

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    # -- scores and features ------------------------------------------------------------------

    def _media(self, inputs: Mapping[str, Any]) -> tuple[Tensor, Tensor, int]:
        """(features [N, D] in placeholder order, scores [N], token id) of the batch; with `merge`
        each survivor scores as its own patch did before the merging, the rest -inf."""
        features, scores, token_id = self._ranked_media(inputs)
        if not self.merge:
            return features, scores, token_id
        features, survivors = merge_frames(features, vision_images(inputs), self.keep)
        return features, scores.masked_fill(~survivors, float("-inf")), token_id

    def _ranked_media(self, inputs: Mapping[str, Any]) -> tuple[Tensor, Tensor, int]:
        """(features [N, D] in placeholder order, the scoring's scores [N], token id) of the batch."""
        inner, cfg = self.model.model, self.model.config
        layer, strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
        if inputs.get("pixel_values_videos") is not None and inputs.get("pixel_values") is not None:
            raise ValueError("pre-LLM reduction ranks one kind of media a batch, got images and clips together: "
                             "reduce them in separate batches")
        block = self._scoring_block()
        captured: list[Tensor] = []
        # The tower keeps only the hidden states LLaVA reads: capture the scoring layer's input.
        hook = None if self.scoring in FEATURE_SCORINGS else block.register_forward_pre_hook(
            lambda module, args, kwargs: captured.append(args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True,
        )
        try:
            if inputs.get("pixel_values_videos") is not None:
                out = inner.get_video_features(
                    inputs["pixel_values_videos"], vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                    return_dict=True,
                )
                token_id = cfg.video_token_id
                pool = getattr(getattr(inner, "vision_resampler", None), "pool", None)
            elif inputs.get("pixel_values") is not None:
                out = inner.get_image_features(
                    inputs["pixel_values"], vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                    return_dict=True,
                )
                token_id, pool = cfg.image_token_id, None
            else:
                raise ValueError("pre-LLM reduction needs pixel_values or pixel_values_videos")
        finally:
            if hook is not None:
                hook.remove()
        features = out.pooler_output
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        features = features.reshape(-1, features.shape[-1])
        images = vision_images(inputs)
        if self.pool > 1:
            features, anchors = self._pooled(features, images)
        if self.scoring == "query":
            return features, self._query_scores(features, inputs, int(token_id)), int(token_id)
        if self.scoring in FEATURE_SCORINGS:
            if self.pool == 1:
                return features, self._deviation(features, images, self._clip_frames(inputs)), int(token_id)
            scores = features.new_full(anchors.shape, float("-inf"), dtype=torch.float32)
            pooled = self._deviation(features[anchors], images, self._clip_frames(inputs))
            return features, scores.masked_scatter(anchors, pooled), int(token_id)
        scores = self._patch_attention(block, captured[-1], self.scoring == "cls")  # [frames, patches]
        if pool is not None:
            side = int(scores.shape[1] ** 0.5)
            grid = scores.view(-1, 1, side, side)
            scores = F.avg_pool2d(grid, kernel_size=pool.kernel_size, stride=pool.stride).flatten(1)
        scores = scores.reshape(-1)
        if scores.numel() != features.shape[0]:
            raise ValueError(f"{scores.numel()} scores for {features.shape[0]} vision features: unsupported feature layout")
        if self.pool > 1:  # a window's score: its patches' summed
            summed = self._window_means(scores.unsqueeze(-1), images).squeeze(-1) * self.pool**2
            scores = torch.full_like(scores, float("-inf")).masked_scatter(anchors, summed)
        return features, scores, int(token_id)

    def _query_scores(self, features: Tensor, inputs: Mapping[str, Any], token_id: int) -> Tensor:
        """[N]: each feature scored against its row's prompt by the fitted scorer."""
        with torch.no_grad():
            return self.scorer.score_media(features.detach(), inputs, token_id, self.model.get_input_embeddings())

    def _window_means(self, values: Tensor, images: int) -> Tensor:
        """[images * (side / pool) ** 2, C]: the mean of `values` [N, C] (each frame's square grid,
        row-major) over each `pool` x `pool` window, the windows row-major."""
        per_frame = values.shape[0] // images if images else 0
        side = int(round(per_frame**0.5))
        if images == 0 or per_frame * images != values.shape[0] or side * side != per_frame or side % self.pool:
            raise ValueError(f"pool {self.pool}: {values.shape[0]} vision tokens over {images} frames do not form "
                             f"square grids whose side divides by {self.pool}: give pool=1")
        grid = values.view(images, side // self.pool, self.pool, side // self.pool, self.pool, -1)
        return grid.mean((2, 4), dtype=torch.float32).flatten(0, 2)

    def _pooled(self, features: Tensor, images: int) -> tuple[Tensor, Tensor]:
        """(features [N, D] with each window's mean at its first patch, anchors [N]: those first
        patches); the other patches' features are left as they are and never kept."""
        pooled = self._window_means(features, images).to(features.dtype)  # checks the grid
        side = int(round((features.shape[0] // images) ** 0.5))
        cell = torch.arange(side, device=features.device) % self.pool == 0
        anchors = (cell[:, None] & cell[None, :]).flatten().repeat(images)
        return features.masked_scatter(anchors.unsqueeze(-1), pooled), anchors

    def _clip_frames(self, inputs: Mapping[str, Any]) -> int:
        """Frames a clip that the ranking compares one with the next: novelty on clips, else 1."""
        videos = inputs.get("pixel_values_videos")
        return videos.shape[1] if self.scoring == "novelty" and videos is not None else 1

    @staticmethod
    def _deviation(features: Tensor, images: int, frames: int = 1) -> Tensor:
        """[N]: how far each vision feature lies from the mean feature of its frame (image), which
        the language model would read from any of that frame's background tokens alike. With
        `frames` > 1 (clips of that many frames, `scoring="novelty"`) a feature past a clip's first
        frame scores the smaller of that and its distance from the same spot one frame earlier:
        what did not change since that frame has already entered, so its slot goes elsewhere."""
        if features.shape[0] % images:
            raise ValueError(f"{features.shape[0]} vision features do not split evenly over {images} frames: "
                             "rank them with scoring='cls' or 'mean'")
        grouped = features.detach().float().view(images, -1, features.shape[-1])
        deviation = (grouped - grouped.mean(1, keepdim=True)).norm(dim=-1)  # [images, patches]
        if frames > 1:
            clips = grouped.view(-1, frames, *grouped.shape[1:])
            step = (clips[:, 1:] - clips[:, :-1]).norm(dim=-1)  # [clips, frames - 1, patches]
            first = torch.full_like(step[:, :1], float("inf"))  # a clip's first frame is all new
            change = torch.cat([first, step], 1)
            deviation = torch.minimum(deviation.view_as(change), change)
        return deviation.reshape(-1)

    def _scoring_block(self) -> nn.Module:
        """The tower layer whose output LLaVA reads (`vision_feature_layer` counts the embeddings
        as hidden state 0, so hidden state i is the output of layer i - 1)."""
        tower = self.model.model.vision_tower
        blocks = getattr(tower, "vision_model", tower).encoder.layers
        layer = self.model.config.vision_feature_layer
        index = layer if layer >= 0 else len(blocks) + 1 + layer
        return blocks[max(index - 1, 0)]

    @staticmethod
    def _patch_attention(block: nn.Module, x: Tensor, cls_only: bool) -> Tensor:
        """[frames, patches]: the attention each patch receives in `block` (whose input is `x`
        [frames, 1 + patches, D]) from the CLS query (`cls_only`) or on average from every query."""
        attn = block.self_attn
        h = block.layer_norm1(x)
        frames, length = x.shape[:2]
        heads = attn.num_heads

        def split(t: Tensor) -> Tensor:
            return t.view(frames, t.shape[1], heads, -1).transpose(1, 2)

        queries = h[:, :1] if cls_only else h
        qk = AttentionQK(q=by_key_head(split(attn.q_proj(queries)), heads), k=split(attn.k_proj(h)), scale=attn.scale,
                         causal=False)
        index = torch.arange(queries.shape[1], device=x.device).expand(frames, -1)
        keys = torch.ones(frames, length, dtype=torch.bool, device=x.device)
        return received_attention(qk, query_plan(index, None, keys, causal=False, heads=heads))[:, 1:]

    # -- the reduced sequence -----------------------------------------------------------------

    @torch.no_grad()
    def _selection(self, is_media: Tensor, attention_mask: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """(index [B, K] of kept positions, left-aligned with filler first; valid [B, K]) of the
        top `keep` of each row's media positions (`is_media` [B, L]) by `keys` [B, L]."""
        types = torch.full_like(attention_mask, int(TokenType.INSTRUCTION))
        types = types.masked_fill(is_media, int(TokenType.VIDEO)).masked_fill(attention_mask == 0, int(TokenType.PADDING))
        layout = TokenLayout.from_types(types, (TokenType.VIDEO,), (self.keep,))
        sel = select_tokens(keys, layout, self.keep)
        if sel.index is None:
            index = torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
            return index, attention_mask.bool()
        valid = sel.valid if sel.valid is not None else torch.ones_like(sel.index, dtype=torch.bool)
        # Kept slots come first in `sel`, filler last; generation wants the filler on the left.
        width = sel.index.shape[1]
        shift = width - valid.sum(1, keepdim=True)
        order = (torch.arange(width, device=valid.device) - shift) % width
        return sel.index.gather(1, order), valid.gather(1, order)

    def _split(self, n_media: Tensor) -> tuple[Tensor, Tensor]:
        """([B] dominant, [B] contextual) counts of rows with `n_media` vision tokens: together the
        k = ceil(keep * n) the selection keeps; at least one dominant token where k > 0."""
        k = capacity_to_k_tensor(self.keep, n_media)
        context = torch.minimum(torch.floor(k.double() * self.contextual + 0.5).long(), (k - 1).clamp_min(0))
        return k - context, context

    def _merge_context(self, embeds: Tensor, is_media: Tensor, scores: Tensor) -> tuple[Tensor, Tensor]:
        """VisionZip's contextual tokens: past each row's dominant (best scored) tokens, the rest
        are grouped around c targets spread evenly over them (each joins the target its feature is
        most cosine-similar to) and each target carries its group's mean feature. Returns the
        embeddings with the targets' features replaced and keys that rank the dominant tokens,
        then the targets, above everything else (so the selection keeps exactly those)."""
        dominant_n, context_n = self._split(is_media.sum(1))
        width = max(int(context_n.max()), 1)
        ranked = scores.masked_fill(~is_media, float("-inf")).argsort(1, descending=True).argsort(1)
        dominant = is_media & (ranked < dominant_n.unsqueeze(1))
        rest = is_media & ~dominant
        order = rest.long().cumsum(1) - 1  # each remaining token's place among the row's rest
        step = ((is_media.sum(1) - dominant_n) // context_n.clamp_min(1)).clamp_min(1).unsqueeze(1)
        target = rest & (order % step == 0) & (order // step < context_n.unsqueeze(1))
        slot = torch.where(target, order // step, width)  # a target's group; `width`: no group
        dim = embeds.shape[-1]

        def group_sum(values: Tensor, members: Tensor) -> Tensor:
            out = values.new_zeros(values.shape[0], width + 1, values.shape[-1])
            return out.scatter_add(1, members.unsqueeze(-1).expand(-1, -1, values.shape[-1]), values)[:, :width]

        centres = F.normalize(group_sum(embeds * target.unsqueeze(-1), slot), dim=-1)
        similarity = F.normalize(embeds, dim=-1) @ centres.transpose(1, 2)  # [B, L, width]
        absent = torch.arange(width, device=embeds.device) >= context_n.unsqueeze(1)  # [B, width]
        nearest = similarity.masked_fill(absent.unsqueeze(1), float("-inf")).argmax(-1)
        group = torch.where(target, slot, torch.where(rest & (context_n > 0).unsqueeze(1), nearest, width))
        sums = group_sum(embeds, group)
        counts = group_sum(torch.ones_like(embeds[..., :1]), group)
        means = sums / counts.clamp_min(1)
        merged = means.gather(1, slot.clamp_max(width - 1).unsqueeze(-1).expand(-1, -1, dim))
        embeds = torch.where(target.unsqueeze(-1), merged.to(embeds.dtype), embeds)
        keys = dominant.to(scores.dtype) * 2 + target.to(scores.dtype)
        return embeds, keys

    def reduce(self, inputs: Mapping[str, Any], generation: bool = False) -> dict[str, Tensor]:
        """The model's inputs as the language model sees them after the reduction:
        {inputs_embeds, attention_mask, position_ids, labels (if given), index (kept positions
        [B, K]), input_ids (the kept positions' ids, for MoD's token types)}. Kept tokens keep the position ids the dense model gives them (a forward numbers
        the padded sequence, `generate` the real tokens: `generation` picks that rule), so RoPE
        still says where each kept patch and the text are, as MoD's gathered positions do."""
        input_ids, mask = inputs["input_ids"], inputs["attention_mask"]
        embeds = self.model.get_input_embeddings()(input_ids)
        features, scores, token_id = self._media(inputs)
        is_media = (input_ids == token_id).unsqueeze(-1)
        if int(is_media.sum()) != features.shape[0]:
            raise ValueError(f"{int(is_media.sum())} vision placeholders for {features.shape[0]} vision features")
        embeds = embeds.masked_scatter(is_media, features.to(embeds.dtype))
        is_media = is_media.squeeze(-1)
        keys = torch.zeros(input_ids.shape, dtype=scores.dtype, device=scores.device).masked_scatter(is_media, scores)
        if self.contextual > 0:
            embeds, keys = self._merge_context(embeds, is_media, keys)
        index, valid = self._selection(is_media, mask, keys)
        rows = torch.arange(index.shape[0], device=index.device).unsqueeze(1)
        if generation:
            positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        else:
            positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        kept = (mask[rows, index].bool() & valid).long()
        out = {
            "inputs_embeds": embeds[rows, index],
            "attention_mask": kept,
            "position_ids": positions[rows, index] * kept,
            "index": index,
            "input_ids": input_ids[rows, index],
        }
        if inputs.get("labels") is not None:
            out["labels"] = inputs["labels"][rows, index].masked_fill(~valid, IGNORE_INDEX)
        return out

    def forward(self, **inputs: Any) -> Any:
        reduced = self.reduce(inputs)
        self.last_length = reduced["index"].shape[1]
        with _kept_token_types(self.model, reduced["input_ids"]):
            out = self.model(
                inputs_embeds=reduced["inputs_embeds"], attention_mask=reduced["attention_mask"],
                position_ids=reduced["position_ids"], labels=reduced.get("labels"),
            )
        full = out.logits.new_zeros(*inputs["input_ids"].shape, out.logits.shape[-1])
        rows = torch.arange(full.shape[0], device=full.device).unsqueeze(1)
        keep = reduced["attention_mask"].bool()
        full[rows.expand_as(keep)[keep], reduced["index"][keep]] = out.logits[keep]
        out.logits = full
        return out

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Tensor:
        media = {k: kwargs.pop(k) for k in ("pixel_values", "pixel_values_videos", "image_sizes") if k in kwargs}
        reduced = self.reduce({"input_ids": input_ids, "attention_mask": attention_mask, **media}, generation=True)
        with _kept_token_types(self.model, reduced["input_ids"]):
            new = self.model.generate(
                inputs_embeds=reduced["inputs_embeds"], attention_mask=reduced["attention_mask"],
                position_ids=reduced["position_ids"], **kwargs
            )
        return torch.cat([input_ids, new.to(input_ids.device)], dim=1)

    def vision_tokens(self, inputs: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """([B] vision tokens of each row, [B] how many the reduction keeps): k = ceil(keep * n),
        as the selection takes them."""
        video = inputs.get("pixel_values_videos") is not None
        token_id = self.model.config.video_token_id if video else self.model.config.image_token_id
        n = ((inputs["input_ids"] == token_id) & inputs["attention_mask"].bool()).sum(1)
        return n, capacity_to_k_tensor(self.keep, n)


@contextmanager
def _kept_token_types(model: nn.Module, kept_ids: Tensor) -> Iterator[None]:
    """While the reduced sequence runs: the MoD language part (if any) types the prefill's tokens
    from `kept_ids` [B, K] (the kept positions' input ids) instead of from the embeddings it is
    given, in which a vision feature is not its placeholder's embedding and would pass for text.
    Decode steps (input ids of their own, a cache behind them) are typed as usual."""
    part = next((p for p in find_parts(model) if p.name == "language"), None)
    if part is None:
        yield
        return
    adapter = part.adapter
    typed = adapter.token_types  # the adapter's own rule, applied to the kept ids

    def kept_types(kwargs: dict, past_length: int) -> Tensor:
        embeds = kwargs.get("inputs_embeds")
        if (past_length == 0 and kwargs.get("input_ids") is None and embeds is not None
                and tuple(embeds.shape[:2]) == tuple(kept_ids.shape)):
            kwargs = {**kwargs, "input_ids": kept_ids}
        return typed(kwargs, past_length)

    adapter.token_types = kept_types
    try:
        yield
    finally:
        del adapter.token_types  # the class's method again


def reduction_flops(reducer: PreLLMReduction, inputs: Mapping[str, Any], trace: Any | None = None) -> dict[str, float]:
    """Prefill FLOPs per sequence of the reduced model: the dense tower plus the scoring (the CLS
    query, or every query, and every key of one tower layer, and their attention), the pooling
    (where `pool`), the contextual tokens' or the merging's similarities (`contextual`, `merge`), and the
    language model on the kept tokens (`vlmod.tools.flops`): a MoD layer of a stacked model (of its
    language model or its tower) on the tokens it ran in `trace` (the prefill's `RoutingTrace`),
    where given."""
    from vlmod.tools.flops import (
        DecoderDims,
        cls_attention_flops,
        frame_pooling_flops,
        hf_vision_dims,
        language_prefill_flops,
        processed_counts,
        vit_flops,
    )

    cfg = reducer.model.config
    batch = inputs["input_ids"].shape[0]
    frames = vision_images(inputs)
    dims = hf_vision_dims(cfg.vision_config)
    n_vision, kept = reducer.vision_tokens(inputs)
    if reducer.scoring == "query":  # the scorer on each row's features, and the prompt's mean embedding
        scoring, vision = 0.0, float(reducer.scorer.flops(float(n_vision.double().mean())))
    elif reducer.scoring in FEATURE_SCORINGS:  # a mean, a difference and a norm over every feature
        scoring = 0.0  # novelty on clips: a second difference and norm, and a minimum
        vision = (7.0 if reducer._clip_frames(inputs) > 1 else 4.0) * cfg.text_config.hidden_size * float(n_vision.double().mean())
    else:
        scoring = cls_attention_flops(dims, 1 if reducer.scoring == "cls" else dims.num_tokens)
        vision = 0.0
    tower = vit_flops(dims, processed_counts(trace.processed, "vision") if trace is not None else None)
    vision += ((tower + scoring) * frames + frame_pooling_flops(reducer.model, inputs)) / batch
    if reducer.pool > 1:  # each feature added into its window's sum, each sum divided once
        vision += cfg.text_config.hidden_size * float(n_vision.double().mean()) * (1 + 1 / reducer.pool**2)
    if reducer.merge:  # each frame's rounds of similarities
        vision += frame_merge_flops(int(n_vision.sum()), frames, reducer.keep, cfg.text_config.hidden_size) / batch
    if reducer.contextual > 0:  # each merged token's cosine similarity to every target of its row
        dominant, context = reducer._split(n_vision)
        dim = cfg.text_config.hidden_size
        vision += float((2 * dim * (n_vision - dominant) * context).double().mean())
    tokens = float((inputs["attention_mask"].sum(1) - n_vision + kept).double().mean())
    routed = processed_counts(trace.processed, "language") if trace is not None else None
    language = language_prefill_flops(DecoderDims.from_config(cfg.text_config), tokens, routed)
    return {"vision": vision, "language": language, "total": vision + language}


__all__ = ["PreLLMReduction", "reduction_flops"]
