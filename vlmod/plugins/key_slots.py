"""What a MoD decoder layer's attention may see: the slots of its own KV cache, and the mask (or
none) that says so.

A MoD layer's cache holds only the tokens it processed, so the mask transformers built for the
full sequence does not fit it. Each layer keeps a record of its slots (`KeySlots`: absolute
positions and validity, filler slots of rows that processed fewer tokens being invalid) and
gets a mask of its own, built as rarely as the attention allows (docs/engine.md, host cost):

- no mask at all where the attention is plain causal: a prefill without filler slots (gathered
  tokens keep their order; sdpa then runs `is_causal`, flash-eligible) and a decode step over a
  cache without filler (the one query sees every key);
- a lower-right causal bias (`torch.nn.attention.bias.causal_lower_right`) for several queries
  after cached keys, which sdpa also runs without materialising a mask;
- otherwise a mask built once per forward and shared by every layer whose slots have the same
  validity (the layers of one capacity), never once per layer: a padded prefill, a decode step
  over filler slots, eager attention;
- by original positions only where nothing simpler is right (several queries after a cache with
  filler slots, a subclass's own rule such as Gemma 3's windows).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vlmod.routing import masks

ATTENTION = ("eager", "sdpa", "flash_attention_2")


def compiled_layer(cache: Any, layer_idx: int) -> Any:
    """The cache's layer if it is a compiled-decoding one (`vlmod.tools.cache.CompiledLayer`:
    buffers at static addresses, its length on the device), else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    return layer if getattr(layer, "vlmod_compiled", False) else None


def cached_length(cache: Any, layer_idx: int, query_length: int) -> int | None:
    """Tokens a layer's cache held before this forward, as a Python int without reading a device
    tensor; None for the decode step of a compiled cache (its length lives on the device, and a
    decode step needs none)."""
    if cache is None:
        return 0
    layer = compiled_layer(cache, layer_idx)
    if layer is None:
        return int(cache.get_seq_length(layer_idx))
    return None if layer.decoding(query_length) else layer.filled


class KeySlots:
    """Absolute positions and validity of the slots one MoD layer's KV cache holds, kept as the
    chunks each forward appended: a decode step appends its position as a number (no tensor, no
    op; consecutive steps merge into one range), and chunks are joined only when a mask by
    positions needs them. Unpacks as (positions, validity or None)."""

    def __init__(self) -> None:
        self.pos: list[Tensor | tuple[int, int, int]] = []  # a tensor [B, n], or (start, n, batch)
        self.valid: list[Tensor | None] = []
        self.length = 0
        self.with_filler = 0  # chunks with a validity tensor: none means every slot is valid
        self.device: torch.device | None = None

    def append(self, pos: Tensor, valid: Tensor | None) -> None:
        self.pos.append(pos)
        self.valid.append(valid)
        self.length += pos.shape[1]
        self.with_filler += valid is not None
        self.device = pos.device

    def append_range(self, start: int, n: int, batch: int, device: torch.device) -> None:
        """Positions start .. start + n - 1 in every row, all valid (a decode step)."""
        last = self.pos[-1] if self.pos else None
        if isinstance(last, tuple) and last[0] + last[1] == start and last[2] == batch:
            self.pos[-1] = (last[0], last[1] + n, batch)
        else:
            self.pos.append((start, n, batch))
            self.valid.append(None)
        self.length += n
        self.device = device

    def _tensor(self, chunk: Tensor | tuple[int, int, int]) -> Tensor:
        if isinstance(chunk, Tensor):
            return chunk
        start, n, batch = chunk
        return torch.arange(start, start + n, device=self.device).expand(batch, n)

    @staticmethod
    def _size(chunk: Tensor | tuple[int, int, int]) -> int:
        return chunk.shape[1] if isinstance(chunk, Tensor) else chunk[1]

    def trim(self, n: int, layer_idx: int) -> None:
        """Keep the first `n` slots (the cache was cropped, or a forward is recomputed)."""
        if n > self.length:
            raise RuntimeError(
                f"the KV cache of MoD layer {layer_idx} holds {n} tokens but vlmod routed {self.length}; "
                "start generation from an empty cache"
            )
        if n < self.length:
            pos, valid = self.positions(), self.validity()
            valid = None if valid is None else valid[:, :n]
            self.pos, self.valid, self.length, self.with_filler = [pos[:, :n]], [valid], n, int(valid is not None)

    def joined_validity(self, extra: int = 0) -> Tensor:
        """[B, length + extra] bool: the validity of every slot, then `extra` valid ones (the
        queries about to be appended), without changing the record."""
        parts = [
            torch.ones(self._batch(), self._size(p), dtype=torch.bool, device=self.device) if v is None else v
            for p, v in zip(self.pos, self.valid, strict=True)
        ]
        if extra:
            parts.append(torch.ones(self._batch(), extra, dtype=torch.bool, device=self.device))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def validity_key(self) -> tuple:
        """Equal for two records whose validity is equal by construction (the same tensors, the
        same lengths): what a shared mask is cached under."""
        return tuple((id(v), self._size(p)) for p, v in zip(self.pos, self.valid, strict=True))

    def _batch(self) -> int:
        first = self.pos[0]
        return first.shape[0] if isinstance(first, Tensor) else first[2]

    def _join(self) -> None:
        if len(self.pos) > 1 or (self.pos and not isinstance(self.pos[0], Tensor)):
            valid = self.joined_validity() if self.with_filler else None
            chunks = [self._tensor(p) for p in self.pos]
            joined = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
            self.pos, self.valid, self.with_filler = [joined], [valid], int(valid is not None)

    def positions(self) -> Tensor:
        """[B, n] absolute position of each slot."""
        self._join()
        return self.pos[0]

    def validity(self) -> Tensor | None:
        """[B, n] bool, or None when every slot is valid."""
        if not self.with_filler:
            return None
        self._join()
        return self.valid[0]

    def __iter__(self) -> Any:
        return iter((self.positions(), self.validity()))


class SlotMasks:
    """The mask side of the decoder adapter: per MoD layer, its key slots and the mask of its
    attention over them. Needs `text_config`, `cache_slots` ({layer: KeySlots}) and `batch` (with
    `past`, `positions` and a `masks` dict emptied every forward)."""

    text_config: Any
    cache_slots: dict[int, Any]
    batch: Any

    # A subclass with key bookkeeping or a mask of its own (Gemma 3's sliding windows) sets this, or
    # gets it by overriding `_cached_keys` / `_mask`: its layers then always go through both.
    own_keys = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_cached_keys" in cls.__dict__ or "_mask" in cls.__dict__:
            cls.own_keys = True

    @property
    def _impl(self) -> str:
        impl = self.text_config._attn_implementation
        if impl not in ATTENTION:
            raise ValueError(
                f"attention implementation {impl!r} is not supported by MoD layers; use one of {ATTENTION}"
            )
        return impl

    def _shared_mask(self, key: tuple, build: Any) -> Any:
        """`build()`, once per forward for every layer that asks under `key`."""
        store = self.batch.masks
        if key not in store:
            store[key] = build()
        return store[key]

    def _keys_then_mask(
        self, layer_idx: int, cache: Any, query_pos: Tensor, query_valid: Tensor | None, dtype: torch.dtype
    ) -> Tensor | None:
        key_pos, key_valid, cached = self._cached_keys(layer_idx, cache, query_pos, query_valid)
        if self._impl != "eager" and key_valid is None and (cached == 0 or query_pos.shape[1] == 1):
            # No filler slot anywhere and every key precedes its query: plain causal attention,
            # which sdpa and flash run without a mask (is_causal).
            return None
        return self._mask(query_pos, key_pos, key_valid, dtype)

    def _slots(self, layer_idx: int, cache: Any) -> tuple[KeySlots | None, int]:
        """This layer's key slots trimmed to what its cache holds (which also covers recomputation
        and resets; a fresh record when the cache is empty), and that count."""
        if cache is None:
            return None, 0
        layer = compiled_layer(cache, layer_idx)
        cached = int(cache.get_seq_length(layer_idx)) if layer is None else layer.filled
        slots = self.cache_slots.get(layer_idx) if cached else None
        if slots is None:
            if cached:
                raise RuntimeError(
                    f"the KV cache of MoD layer {layer_idx} holds {cached} tokens that vlmod did not route; "
                    "start generation from an empty cache"
                )
            slots = self.cache_slots[layer_idx] = KeySlots()
        slots.trim(cached, layer_idx)
        return slots, cached

    def _slot_mask(
        self, layer_idx: int, cache: Any, query_pos: Tensor, query_valid: Tensor | None, dtype: torch.dtype
    ) -> Any:
        """The mask of this layer's attention over its cached slots and the current queries (which
        the upstream attention appends to the cache), or None where plain causal attention is
        right (module doc)."""
        slots, cached = self._slots(layer_idx, cache)
        filler_before = bool(cached and slots.with_filler)
        n_query, impl = query_pos.shape[1], self._impl
        if n_query == 1 and cached:
            # A decode step: the query sees every valid cached key and itself.
            mask = self._decode_mask(slots, dtype) if filler_before or query_valid is not None else None
        elif cached == 0:
            mask = self._prefill_mask(query_valid, n_query, query_pos.device, dtype)
        elif not filler_before and query_valid is None and impl != "eager":
            # Several queries after cached keys, all valid: lower-right causal by slot.
            mask = None if impl == "flash_attention_2" else self._shared_mask(
                ("lower right", n_query, cached), lambda: _lower_right(n_query, cached + n_query)
            )
        else:
            # Several queries after a cache with filler slots (or eager): by original positions.
            slots.append(query_pos, query_valid)
            return self._mask(query_pos, slots.positions(), slots.validity(), dtype)
        if slots is not None:
            slots.append(query_pos, query_valid)
            compiled = compiled_layer(cache, layer_idx)
            if compiled is not None and query_valid is not None:
                compiled.set_validity(query_valid, cached)  # what its decode steps mask
        return mask

    def _prefill_mask(
        self, query_valid: Tensor | None, n_query: int, device: torch.device, dtype: torch.dtype
    ) -> Tensor | None:
        """Queries with nothing cached: causal by slot (processed tokens keep their order, filler
        slots come last), valid keys only; once per forward and validity."""
        impl = self._impl
        if query_valid is None and impl != "eager":
            return None
        if impl == "flash_attention_2":
            return self._shared_mask(("flash", id(query_valid)), lambda: query_valid.long())

        def build() -> Tensor:
            slot = torch.arange(n_query, device=device)
            allowed = slot[None, :] <= slot[:, None]  # [Q, K] causal
            if query_valid is not None:
                allowed = (allowed & query_valid[:, None, :]) | (slot[None, :] == slot[:, None])
            else:
                allowed = allowed[None]
            return masks.as_attention_mask(allowed.unsqueeze(1), impl, dtype)

        return self._shared_mask(("prefill", n_query, id(query_valid), dtype), build)

    def _decode_mask(self, slots: KeySlots, dtype: torch.dtype) -> Tensor:
        """One query per row after cached slots with filler: every valid slot and itself; once per
        forward for the layers whose slots share their validity."""
        return self._shared_mask(
            ("decode", slots.validity_key(), dtype), lambda: self._validity_mask(slots.joined_validity(1), dtype)
        )

    def _validity_mask(self, key_valid: Tensor, dtype: torch.dtype) -> Tensor:
        """The mask of one query per row that may see exactly the keys in `key_valid` [B, n_key]."""
        impl = self._impl
        if impl == "flash_attention_2":
            return key_valid.long()
        return masks.as_attention_mask(key_valid[:, None, None, :], impl, dtype)

    def _cached_keys(
        self, layer_idx: int, cache: Any, query_pos: Tensor, query_valid: Tensor | None
    ) -> tuple[Tensor, Tensor | None, int]:
        """Positions and validity (None: all valid) of every key this layer's attention will see,
        and how many were cached before: its cached slots and the current queries."""
        slots, cached = self._slots(layer_idx, cache)
        if slots is None:
            return query_pos, query_valid, 0
        slots.append(query_pos, query_valid)
        return slots.positions(), slots.validity(), cached

    def _mask(
        self, query_pos: Tensor, key_pos: Tensor, key_valid: Tensor | None, dtype: torch.dtype
    ) -> Tensor | None:
        impl = self._impl
        if impl == "flash_attention_2":
            # Processed tokens keep their order and the cache precedes the queries, so flash's
            # bottom-right causal alignment is right; the 2D mask drops the filler slots.
            return None if key_valid is None else key_valid.long()
        allowed = masks.causal(query_pos, key_pos)
        if key_valid is not None:
            allowed = masks.keep_own_slot(allowed & key_valid[:, None, :])
        return masks.as_attention_mask(allowed.unsqueeze(1), impl, dtype)


def _lower_right(n_query: int, n_key: int) -> Any:
    """sdpa's lower-right causal bias: query i sees keys up to n_key - n_query + i; sdpa runs it
    with its flash / memory-efficient kernels, materialising nothing."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n_query, n_key)
