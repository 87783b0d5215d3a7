"""Pre-LLM vision-token reduction (VisionZip-style): drop vision tokens before the language model.

What many users run today instead of MoD: the vision tower runs in full, its CLS token's
attention ranks the tower's output tokens, and only the `keep` fraction it attends to most
enters the language model (VisionZip's "dominant" tokens; FastV-like methods rank inside the
LLM instead, which is vlmod's training-free `attention` router). Unlike MoD, a dropped token is
gone for every layer; unlike frame subsampling, every frame keeps its most attended tokens.

The score of a patch is the mean over heads of the softmax attention the CLS query pays it
(`scoring="cls"`, VisionZip's rule for CLIP) or the mean over every query of the attention it
receives (`scoring="mean"`, VisionZip's rule for towers without a CLS; also the choice where the
CLS was never trained, as in a tower trained from scratch under LLaVA, which reads only the
patches) in the tower layer that produces the features the projector reads (`vision_feature_layer`),
computed with that layer's own norm and projections (`vlmod.routing.attention`); pooled tokens
(LLaVA-NeXT-Video's frame pooling) sum the scores of the patches they pool. Selection is the
engine's: text is protected, the top-k vision tokens of each row are kept in their original
order (`vlmod.routing.selection`), and the kept sequence is left-padded for generation.

Supported: `LlavaForConditionalGeneration` (images) and `LlavaNextVideoForConditionalGeneration`
(videos) with a CLIP tower (a CLS token). Cost counted by `reduction_flops`: the dense tower, the
CLS query and the keys of one tower layer, and the language model on the kept tokens.

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
from vlmod.routing.attention import AttentionQK, received_attention
from vlmod.routing.selection import TokenLayout, select_tokens
from vlmod.routing.trace import find_parts

IGNORE_INDEX = -100
SCORINGS = ("cls", "mean")


def _check(model: nn.Module) -> None:
    name = type(model).__name__
    if name not in ("LlavaForConditionalGeneration", "LlavaNextVideoForConditionalGeneration"):
        raise TypeError(
            f"pre-LLM reduction supports LlavaForConditionalGeneration and LlavaNextVideoForConditionalGeneration, "
            f"not {name}"
        )
    if getattr(model.config.vision_config, "model_type", "") != "clip_vision_model":
        raise ValueError("pre-LLM reduction ranks patches by the attention of the tower's CLS token; this tower has none")
    if model.config.vision_feature_select_strategy != "default":
        raise ValueError("pre-LLM reduction needs vision_feature_select_strategy='default' (the CLS token dropped)")
    if not isinstance(model.config.vision_feature_layer, int):
        raise ValueError("pre-LLM reduction needs one vision_feature_layer (the model concatenates several)")


class PreLLMReduction(nn.Module):
    """`model` with only the `keep` fraction of each row's vision tokens entering its language model.

    Called like the model (teacher-forced: logits come back at the original positions, zeros
    where a token was dropped, so losses over answer tokens read them as usual) and through
    `generate` (greedy decoding from the kept tokens; returns prompt ids + new ids like
    `model.generate`)."""

    def __init__(self, model: nn.Module, keep: float, scoring: str = "cls"):
        super().__init__()
        _check(model)
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1] (the fraction of vision tokens kept), got {keep}")
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
        self.model = model
        self.keep = float(keep)
        self.scoring = scoring
        self.last_length: int | None = None  # the language model's sequence length in the last forward

    @property
    def config(self) -> Any:
        return self.model.config

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    # -- scores and features ------------------------------------------------------------------

    def _media(self, inputs: Mapping[str, Any]) -> tuple[Tensor, Tensor, int]:
        """(features [N, D] in placeholder order, CLS-attention scores [N], token id) of the batch."""
        inner, cfg = self.model.model, self.model.config
        layer, strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
        block = self._scoring_block()
        captured: list[Tensor] = []
        # The tower keeps only the hidden states LLaVA reads: capture the scoring layer's input.
        hook = block.register_forward_pre_hook(
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
            hook.remove()
        features = out.pooler_output
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        features = features.reshape(-1, features.shape[-1])
        scores = self._patch_attention(block, captured[-1], self.scoring == "cls")  # [frames, patches]
        if pool is not None:
            side = int(scores.shape[1] ** 0.5)
            grid = scores.view(-1, 1, side, side)
            scores = F.avg_pool2d(grid, kernel_size=pool.kernel_size, stride=pool.stride).flatten(1)
        scores = scores.reshape(-1)
        if scores.numel() != features.shape[0]:
            raise ValueError(f"{scores.numel()} scores for {features.shape[0]} vision features: unsupported feature layout")
        return features, scores, int(token_id)

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
        qk = AttentionQK(q=split(attn.q_proj(queries)), k=split(attn.k_proj(h)), scale=attn.scale, causal=False)
        index = torch.arange(queries.shape[1], device=x.device).expand(frames, -1)
        keys = torch.ones(frames, length, dtype=torch.bool, device=x.device)
        return received_attention(qk, index, None, keys)[:, 1:]

    # -- the reduced sequence -----------------------------------------------------------------

    @torch.no_grad()
    def _selection(self, input_ids: Tensor, attention_mask: Tensor, scores: Tensor, token_id: int) -> tuple[Tensor, Tensor]:
        """(index [B, K] of kept positions, left-aligned with filler first; valid [B, K])."""
        is_media = input_ids == token_id
        types = torch.full_like(input_ids, int(TokenType.INSTRUCTION))
        types = types.masked_fill(is_media, int(TokenType.VIDEO)).masked_fill(attention_mask == 0, int(TokenType.PADDING))
        keys = torch.zeros(input_ids.shape, dtype=scores.dtype, device=scores.device)
        keys = keys.masked_scatter(is_media, scores)
        layout = TokenLayout.from_types(types, (TokenType.VIDEO,), (self.keep,))
        sel = select_tokens(keys, layout, self.keep)
        if sel.index is None:
            index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return index, attention_mask.bool()
        valid = sel.valid if sel.valid is not None else torch.ones_like(sel.index, dtype=torch.bool)
        # Kept slots come first in `sel`, filler last; generation wants the filler on the left.
        width = sel.index.shape[1]
        shift = width - valid.sum(1, keepdim=True)
        order = (torch.arange(width, device=valid.device) - shift) % width
        return sel.index.gather(1, order), valid.gather(1, order)

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
        index, valid = self._selection(input_ids, mask, scores, token_id)
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
        from vlmod.routing.schedule import capacity_to_k_tensor

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
    query, or every query, and every key of one tower layer, and their attention), and the
    language model on the kept tokens (`vlmod.tools.flops`): a MoD layer of a stacked model on the
    tokens it ran in `trace` (the prefill's `RoutingTrace`), where given."""
    from vlmod.tools.flops import (
        DecoderDims,
        cls_attention_flops,
        frame_pooling_flops,
        hf_vision_dims,
        language_prefill_flops,
        processed_counts,
        vision_images,
        vit_flops,
    )

    cfg = reducer.model.config
    batch = inputs["input_ids"].shape[0]
    frames = vision_images(inputs)
    dims = hf_vision_dims(cfg.vision_config)
    queries = 1 if reducer.scoring == "cls" else dims.num_tokens
    scoring = cls_attention_flops(dims, queries)
    vision = ((vit_flops(dims) + scoring) * frames + frame_pooling_flops(reducer.model, inputs)) / batch
    n_vision, kept = reducer.vision_tokens(inputs)
    tokens = float((inputs["attention_mask"].sum(1) - n_vision + kept).double().mean())
    routed = processed_counts(trace.processed, "language") if trace is not None else None
    language = language_prefill_flops(DecoderDims.from_config(cfg.text_config), tokens, routed)
    return {"vision": vision, "language": language, "total": vision + language}


__all__ = ["PreLLMReduction", "reduction_flops"]
