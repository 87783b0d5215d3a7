"""Gemma 3 (`Gemma3ForConditionalGeneration`): the language model, and its SigLIP vision tower
through the Hugging Face vision plugin.

Two things differ from the shared decoder adapter and both live in the per-layer mask over the
processed tokens, by original position:

- Image tokens attend to the other tokens of their own image both ways while text stays causal
  (when the call carries `token_type_ids`, as the processor returns them; without them the
  upstream model is causal everywhere, and so is this one).
- Sliding-window and full-attention layers alternate. A sliding layer's key at position j is
  visible to the query at position i only if j > i - window, however few tokens the layer
  processed in between. Its KV cache keeps the last window - 1 slots, as upstream; a row's filler
  slots are handed to the layer first, so the slots it keeps are its most recent real tokens and
  every processed token inside the window survives eviction.

Layer 0 and the first full-attention layer stay dense: transformers sizes the shared sliding and
full masks from their KV caches. flash_attention_2 cannot express either rule with a padding
mask and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.config import MoDConfig
from vlmod.plugins.base import PartSpec
from vlmod.plugins.decoder import DecoderAdapter, check_part, language_part, vision_part
from vlmod.routing import masks
from vlmod.routing.layer import MoDPart
from vlmod.routing.selection import Selection

FAMILIES = ("Hugging Face Gemma3ForConditionalGeneration",)
VARIANTS = ("gemma3",)


def _classes() -> tuple[type, ...]:
    import transformers as tf

    return (tf.Gemma3ForConditionalGeneration,) if hasattr(tf, "Gemma3ForConditionalGeneration") else ()


def matches(model: nn.Module) -> bool:
    return isinstance(model, _classes())


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if check_part(model, part) == "vision":
        return vision_part(model, config, "gemma3")
    text = model.model.language_model.config
    if text._attn_implementation == "flash_attention_2":
        raise ValueError(
            "Gemma 3 MoD layers need a mask of their own (bidirectional image blocks, sliding windows by "
            "position), which flash_attention_2 cannot take; load the model with attn_implementation='sdpa'"
        )
    kinds = list(text.layer_types)
    dense = (0, kinds.index("full_attention")) if "full_attention" in kinds else (0,)
    adapter = Gemma3Adapter(model, type(model.model.language_model.layers[0]), config)
    return language_part(
        model, config, "gemma3", adapter, layer_types=("full_attention", "sliding_attention"),
        dense_layers=tuple(sorted(set(dense))),
    )


class Gemma3Adapter(DecoderAdapter):
    """The decoder adapter with Gemma 3's mask: image blocks both ways, sliding windows."""

    def __init__(self, model: nn.Module, layer_cls: type, config: MoDConfig):
        super().__init__(model, layer_cls, config)
        text = self.text_config
        self.windows = [text.sliding_window if t == "sliding_attention" else None for t in text.layer_types]
        self.blocks: Tensor | None = None  # [B, L] image block of each token, -1 for text
        self._layer = 0

    def begin_forward(self, part: MoDPart, args: tuple, kwargs: dict) -> None:
        super().begin_forward(part, args, kwargs)
        if args:
            kwargs = {**dict(zip(self.entry_params, args, strict=False)), **kwargs}
        token_type_ids = kwargs.get("token_type_ids")
        self.blocks = None
        # One new token (a decode step) is its own block at most, which causal attention covers.
        if token_type_ids is not None and self.batch.layout.shape[1] > 1:
            from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

            length = self.batch.positions.shape[1]
            blocks = get_block_sequence_ids_for_mask(token_type_ids, device=self.batch.positions.device)
            # A decode step may be handed the whole prompt's types: keep the current tokens'.
            self.blocks = blocks[:, -length:]

    def run(
        self, upstream: Callable, x_sel: Tensor, sel: Selection, args: tuple, kwargs: dict, layer_idx: int
    ) -> Tensor:
        self._layer = layer_idx
        if self.windows[layer_idx] is None or sel.valid is None:
            return super().run(upstream, x_sel, sel, args, kwargs, layer_idx)
        # Filler slots first, real ones after in their order: the sliding cache keeps the last
        # window - 1 slots, which are then the row's latest real tokens.
        rows = torch.arange(x_sel.shape[0], device=x_sel.device).unsqueeze(1)
        order = sel.valid.long().argsort(dim=1, stable=True)
        first = Selection(index=sel.index[rows, order], valid=sel.valid[rows, order], length=sel.length)
        y = super().run(upstream, x_sel[rows, order], first, args, kwargs, layer_idx)
        return y[rows, order.argsort(dim=1)]

    def check_attention_router(self, blocks: list[nn.Module]) -> None:
        """The attention router's scores are causal over every key; a sliding-window layer's
        instruction tokens see only their window, so only full-attention layers can be scored."""
        super().check_attention_router(blocks)
        for block in blocks:
            if block.self_attn.sliding_window is not None or block.self_attn.attn_logit_softcapping:
                raise ValueError(
                    f"the attention router cannot score Gemma 3 layer {block.self_attn.layer_idx}: it uses a sliding "
                    "window (or logit soft-capping); name full-attention layers, or use the learned router"
                )

    def _cached_keys(
        self, layer_idx: int, cache: Any, query_pos: Tensor, query_valid: Tensor | None
    ) -> tuple[Tensor, Tensor | None, int]:
        """As the shared adapter, but the slots a sliding layer still holds are its last ones, and
        the validity is explicit wherever the mask is more than causal (so one is built)."""
        window = self.windows[layer_idx]
        stored = 0
        if cache is not None and layer_idx < len(cache.layers) and cache.layers[layer_idx].is_initialized:
            stored = int(cache.layers[layer_idx].keys.shape[-2])
        prev = self.cache_slots.get(layer_idx) if stored else None
        if prev is None:
            key_pos, key_valid = query_pos, query_valid
        else:
            prev_pos, prev_valid = prev
            if prev_pos.shape[1] < stored:
                raise RuntimeError(
                    f"the KV cache of MoD layer {layer_idx} holds {stored} tokens that vlmod did not route; "
                    "start generation from an empty cache"
                )
            keep = slice(-stored, None) if window is not None else slice(None, stored)
            key_pos = torch.cat([prev_pos[:, keep], query_pos], dim=1)
            if prev_valid is not None or query_valid is not None:  # else no filler slot anywhere: None
                old_valid = prev_valid[:, keep] if prev_valid is not None else torch.ones_like(prev_pos[:, keep],
                                                                                            dtype=torch.bool)
                new_valid = query_valid if query_valid is not None else torch.ones_like(query_pos, dtype=torch.bool)
                key_valid = torch.cat([old_valid, new_valid], dim=1)
            else:
                key_valid = None
        if window is not None and cache is not None:
            # Keep what the sliding cache keeps (its last window - 1 slots after this update).
            self.cache_slots[layer_idx] = (
                key_pos[:, -(window - 1):],
                None if key_valid is None else key_valid[:, -(window - 1):],
            )
        elif cache is not None:
            self.cache_slots[layer_idx] = (key_pos, key_valid)
        return key_pos, key_valid, stored

    def _keys_then_mask(
        self, layer_idx: int, cache: Any, query_pos: Tensor, query_valid: Tensor | None, dtype: torch.dtype
    ) -> Tensor | None:
        """The layer's mask, built as cheaply as its case allows: none where attention is plain
        causal (a full-attention layer with no image block in reach and no filler slot), the
        forward's whole-sequence mask at the selected positions in a prefill from an empty cache
        (two gathers a layer), the general mask by position otherwise."""
        key_pos, key_valid, cached = self._cached_keys(layer_idx, cache, query_pos, query_valid)
        window, single = self.windows[layer_idx], query_pos.shape[1] == 1
        if key_valid is None:
            if (self._impl != "eager" and window is None and (cached == 0 or single)
                    and (self.blocks is None or single)):
                return None  # a decode token is text: no image block reaches it
            if cached == 0 and not single:
                return self._selected_mask(query_pos, window, dtype)
            if single and window is not None:  # every key precedes the decode token: its window alone
                allowed = masks.within_window(query_pos, key_pos, window).unsqueeze(1)
                return masks.as_attention_mask(allowed, self._impl, dtype)
            key_valid = torch.ones_like(key_pos, dtype=torch.bool)
        return self._mask(query_pos, key_pos, key_valid, dtype)

    def _selected_mask(self, query_pos: Tensor, window: int | None, dtype: torch.dtype) -> Tensor:
        """[B, 1, k, k] mask of the selected tokens of a prefill from an empty cache (their keys are
        the queries): rows then columns of the forward's [B, L, L] mask for this kind of layer,
        built once per forward (sliding and full) by the same rules as `_mask`."""
        full = self.batch.masks.get(("gemma3", window))
        if full is None:
            pos = self.batch.positions
            full = masks.causal(pos, pos)
            if self.blocks is not None:
                full = full | masks.same_block(self.blocks, self.blocks)
            if window is not None:
                full = full & masks.within_window(pos, pos, window)
            self.batch.masks[("gemma3", window)] = full
        batch, k = query_pos.shape
        full = full.expand(batch, -1, -1)
        rows = full.gather(1, query_pos[:, :, None].expand(-1, -1, full.shape[-1]))
        allowed = rows.gather(2, query_pos[:, None, :].expand(-1, k, -1))
        return masks.as_attention_mask(allowed.unsqueeze(1), self._impl, dtype)

    def _mask(
        self, query_pos: Tensor, key_pos: Tensor, key_valid: Tensor | None, dtype: torch.dtype
    ) -> Tensor | None:
        allowed = masks.causal(query_pos, key_pos)
        if self.blocks is not None:
            n_new = query_pos.shape[1]
            # The current forward's queries are the last keys; cached keys are text to them.
            start = self.batch.past
            q_block = self.blocks.gather(1, query_pos - start)
            k_block = torch.cat([torch.full_like(key_pos[:, : key_pos.shape[1] - n_new], -1), q_block], dim=1)
            allowed = allowed | masks.same_block(q_block, k_block)
        window = self.windows[self._layer]
        if window is not None:
            allowed = allowed & masks.within_window(query_pos, key_pos, window)
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, :]
        allowed = masks.keep_own_slot(allowed).unsqueeze(1)
        return masks.as_attention_mask(allowed, self.text_config._attn_implementation, dtype)
