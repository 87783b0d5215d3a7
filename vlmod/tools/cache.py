"""A KV cache that writes in place: one preallocated buffer per layer, each with its own length.

transformers' `DynamicCache` concatenates every layer's keys and values with the new ones at
every step, a copy of the whole cache per token (at batch 8 and 1,191 tokens it costs more than
the attention that reads it). `StaticCache` writes in place, but at one position shared by all
layers, while a MoD layer holds only the tokens it processed. `PreallocatedCache` gives each
full-attention layer a buffer of its own, sized on the layer's first write (the tokens the
prefill put there) plus `max_new_tokens`; later writes are a copy of the new tokens into the
next free slots, and attention reads a view of the filled part (no copy: sdpa takes strided
keys). A layer that runs out of room grows once by another `max_new_tokens`, so a longer
generation stays correct. Lengths are Python ints: no host sync.

It is a `DynamicCache` (same masks, same cropping, `get_seq_length` per layer), so MoD layers'
key-position bookkeeping, which counts what each layer's cache holds, works as with the default.

    cache = vlmod.preallocated_cache(model, max_new_tokens=32)
    model.generate(**inputs, max_new_tokens=32, cache=cache)

(`past_key_values=cache` before transformers 5.24.) One cache per generate call, as with any
cache object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in a buffer [B, H, capacity, d]; `keys` / `values` are views of
    its first `length` slots."""

    def __init__(self, max_new_tokens: int) -> None:
        super().__init__()
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self.length = 0
        self._keys: Tensor | None = None
        self._values: Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def _view(self) -> None:
        self.keys = self._keys[..., : self.length, :]
        self.values = self._values[..., : self.length, :]

    def _reserve(self, key_states: Tensor, value_states: Tensor, needed: int) -> None:
        """Buffers of at least `needed` slots shaped like the new states, the filled part kept."""
        same = (
            self._keys is not None
            and self._keys.shape[:2] == key_states.shape[:2]
            and self._keys.dtype == key_states.dtype
            and self._keys.device == key_states.device
        )
        if same and needed <= self.capacity:
            return
        size = needed + max(self.max_new_tokens, 1)
        keys = key_states.new_empty((*key_states.shape[:2], size, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:2], size, value_states.shape[-1]))
        if same and self.length:
            keys[..., : self.length, :].copy_(self._keys[..., : self.length, :])
            values[..., : self.length, :].copy_(self._values[..., : self.length, :])
        elif self.length:
            raise ValueError(
                f"new key states {tuple(key_states.shape)} do not match the {tuple(self.keys.shape)} cached; "
                "start from an empty cache"
            )
        self._keys, self._values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._reserve(key_states, value_states, end)
        self._keys[..., start:end, :].copy_(key_states)
        self._values[..., start:end, :].copy_(value_states)
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        """Empty, the buffers kept for the next fill."""
        self.length = 0
        if self._keys is not None:
            self._view()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self._keys is not None:
            self.length = max(self.length + tokens_to_remove, 0)
            self._view()

    def _rebatch(self, pick: Any) -> None:
        if self._keys is not None:
            self._keys, self._values = pick(self._keys), pick(self._values)
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebatch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._rebatch(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rebatch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def offload(self) -> None:
        self._rebatch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self._keys is not None and self._keys.device != self.device:
            self._rebatch(lambda t: t.to(self.device, non_blocking=True))


class PreallocatedCache(DynamicCache):
    """A `DynamicCache` whose full-attention layers are `PreallocatedLayer`s (sliding-window and
    other layer kinds keep transformers' own)."""

    def __init__(self, config: Any, max_new_tokens: int) -> None:
        super().__init__(config=config)
        self.max_new_tokens = max_new_tokens
        self.layers = [
            PreallocatedLayer(max_new_tokens) if type(layer) is DynamicLayer else layer for layer in self.layers
        ]

    def allocated_bytes(self) -> int:
        """Bytes of the buffers, free slots included."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (getattr(layer, "_keys", None), getattr(layer, "_values", None))
            if t is not None
        )


# Compiled decoding sizes each layer's buffers to a multiple of this: prompts whose lengths round
# to the same size reuse one compiled decode step instead of compiling another.
SLOT_BUCKET = 128


class CompiledLayer(StaticLayer):
    """One layer's keys and values for compiled decoding (transformers' `StaticLayer` pattern):
    buffers at static addresses and the length on the device, so a decode step has no Python
    branch on a tensor and no host sync, and CUDA graphs can replay it. Unlike `StaticLayer`, the
    buffers are sized at the layer's first write (the tokens the prefill put there, which for a
    MoD layer is only what it processed, plus `max_new_tokens`, rounded up to `SLOT_BUCKET`), so
    the per-layer KV saving stays.

    The prefill runs eager and sees only the filled slots (a view, as `PreallocatedLayer`); a
    decode step (one token, buffers allocated) writes at the device-side length and attends over
    the whole buffer, the slots past the length masked: by transformers for dense layers (slot j
    holds position j there), by `decode_mask` for MoD layers. `valid` marks the filler slots of
    rows that processed fewer tokens (written at the prefill), which no query sees."""

    is_compileable = True
    vlmod_compiled = True  # what the MoD layers look for (vlmod.plugins.key_slots.compiled_layer)

    def __init__(self, max_new_tokens: int) -> None:
        super().__init__(max_cache_len=0)
        self.max_new_tokens = max_new_tokens
        self.filled = 0  # slots written by prefills (a Python int; decode steps count on the device)
        self.valid: Tensor | None = None  # [B, capacity] bool
        self.slot_ids: Tensor | None = None  # [capacity] long

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        needed = key_states.shape[-2] + max(self.max_new_tokens, 1)
        self.max_cache_len = -(-needed // SLOT_BUCKET) * SLOT_BUCKET
        # On the device from the start: StaticLayer's host tensor moved there would be a blocking copy
        # (a host sync per layer in every prefill).
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=key_states.device)
        super().lazy_initialization(key_states, value_states)
        self.valid = torch.ones(self.batch_size, self.max_cache_len, dtype=torch.bool, device=self.device)
        self.slot_ids = torch.arange(self.max_cache_len, device=self.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.valid)

    def decoding(self, query_length: int) -> bool:
        return self.is_initialized and query_length == 1

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if self.decoding(key_states.shape[-2]):
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            start = 0
        else:  # a second prompt on this cache (eager): where the decode steps left off
            start = int(self.cumulative_length)
        end = start + key_states.shape[-2]
        if end > self.max_cache_len:
            raise ValueError(
                f"the compiled cache holds {self.max_cache_len} slots per layer and this forward needs {end}; "
                "start from a fresh cache (vlmod.compiled_cache) sized for the whole prompt"
            )
        self.keys[..., start:end, :].copy_(key_states)
        self.values[..., start:end, :].copy_(value_states)
        self.cumulative_length.fill_(end)
        self.filled = end
        self._apply_validity()
        return self.keys[..., :end, :], self.values[..., :end, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.decoding(query_length):
            return self.max_cache_len, 0
        return self.filled + query_length, 0

    def set_validity(self, valid: Tensor, start: int) -> None:
        """Mark the slots from `start` on as `valid` [B, n] (a prefill's filler slots, False); called
        before the prefill's write, which allocates the buffers, so kept until then."""
        self._pending = (valid, start)

    _pending: tuple[Tensor, int] | None = None

    def _apply_validity(self) -> None:
        if self._pending is not None:
            valid, start = self._pending
            self.valid[:, start : start + valid.shape[1]].copy_(valid)
            self._pending = None

    def decode_mask(self) -> Tensor:
        """[B, 1, 1, capacity] bool: what a decode step's query sees, every written slot that is
        valid and its own (at the current length, written during its attention)."""
        return ((self.slot_ids <= self.cumulative_length) & self.valid)[:, None, None, :]


class CompiledCache(Cache):
    """A cache of `CompiledLayer`s (every layer of the language model must be full attention):
    what `vlmod.compile` decodes with."""

    def __init__(self, config: Any, max_new_tokens: int) -> None:
        text = config.get_text_config(decoder=True)
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        if any(kind != "full_attention" for kind in kinds):
            raise ValueError(
                "compiled decoding needs full-attention layers only; this model has "
                f"{sorted(set(kinds) - {'full_attention'})} layers: generate without compile"
            )
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        super().__init__(layers=[CompiledLayer(max_new_tokens) for _ in kinds])
        self.max_new_tokens = max_new_tokens

    def allocated_bytes(self) -> int:
        """Bytes of the buffers, free slots included."""
        return sum(
            t.numel() * t.element_size() for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values)
        )


def compiled_cache(model: nn.Module, max_new_tokens: int) -> CompiledCache:
    """A fresh `CompiledCache` for one generate call (or a manual decode loop) of a dense or MoD
    model whose decode step runs compiled."""
    return CompiledCache(model.config, max_new_tokens)


def preallocated_cache(model: nn.Module, max_new_tokens: int) -> PreallocatedCache:
    """A fresh `PreallocatedCache` for one `model.generate(..., max_new_tokens=N, cache=cache)`
    call (or a manual decode loop) of a dense or MoD model."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return PreallocatedCache(model.config, max_new_tokens)


def generate_cache(model: nn.Module, max_new_tokens: int) -> dict[str, PreallocatedCache]:
    """`model.generate(**inputs, max_new_tokens=N, **generate_cache(model, N))`: a fresh cache for
    one call, under the keyword the installed transformers' `generate` takes it by. vlmod's own
    generation (eval, the lmms-eval model, the demo) decodes this way: the same tokens as with
    `DynamicCache`, 1.2-1.9x faster per step on CPU (docs/speed.md). A model whose generation
    config names a cache implementation keeps it (nothing is passed)."""
    from vlmod.plugins.calls import CACHE

    if getattr(model, COMPILED_ATTR, False):
        return {CACHE: compiled_cache(model, max_new_tokens)}
    if getattr(getattr(model, "generation_config", None), "cache_implementation", None) is not None:
        return {}  # the checkpoint names its cache, and generate refuses a second one
    return {CACHE: preallocated_cache(model, max_new_tokens)}


# Set on a model by `vlmod.compile`: its generation decodes on a `CompiledCache`, compiled.
COMPILED_ATTR = "_vlmod_compiled"
