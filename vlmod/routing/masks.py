"""Attention masks over routed tokens: which key each query may see, in the form an attention
implementation takes.

A MoD layer runs on a gathered subset of the tokens, so the mask the upstream model built for the
full sequence no longer fits: plugins build one per layer from the tokens' original positions
(causal by position, never by slot), their validity (filler slots of rows that process fewer
tokens) and family rules (image blocks seen both ways, sliding windows). Every rule is a bool
tensor `allowed[..., query, key]`; `as_attention_mask` turns it into what the implementation
takes (eager: additive float, 0 allowed and the dtype's minimum not; sdpa: the bool itself).
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal(query_pos: Tensor, key_pos: Tensor) -> Tensor:
    """[B, Q, K] bool: key j is at or before query i by original position (query_pos [B, Q],
    key_pos [B, K])."""
    return key_pos[:, None, :] <= query_pos[:, :, None]


def within_window(query_pos: Tensor, key_pos: Tensor, window: int) -> Tensor:
    """[B, Q, K] bool: key j lies inside query i's sliding window (j > i - window), however few
    tokens a layer processed in between."""
    return key_pos[:, None, :] > query_pos[:, :, None] - window


def same_block(query_block: Tensor, key_block: Tensor) -> Tensor:
    """[B, Q, K] bool: query and key belong to one block (block ids >= 0; -1 is no block): the
    tokens of one image that see each other both ways."""
    return (query_block[:, :, None] == key_block[:, None, :]) & (query_block[:, :, None] >= 0)


def block_diagonal(
    query_rows: Tensor, key_rows: Tensor, query_pos: Tensor | None = None, key_pos: Tensor | None = None
) -> Tensor:
    """[1, 1, Nq, Nk] bool over packed queries and keys (several rows in one sequence): same row,
    and key position <= query position where positions are given."""
    allowed = query_rows[:, None] == key_rows[None, :]
    if query_pos is not None:
        allowed = allowed & (key_pos[None, :] <= query_pos[:, None])
    return allowed[None, None]


def keep_own_slot(allowed: Tensor) -> Tensor:
    """`allowed` [..., Q, K] with every query allowed its own slot, the current queries being the
    last Q keys in order: a filler query (a row with fewer processed tokens) then has a finite
    softmax; its output is discarded."""
    n_query, n_key = allowed.shape[-2:]
    device = allowed.device
    own = torch.arange(n_key, device=device) == (torch.arange(n_query, device=device)[:, None] + (n_key - n_query))
    return allowed | own


def additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as the additive float mask of eager attention (0 allowed, dtype's min not)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def as_attention_mask(allowed: Tensor, impl: str, dtype: torch.dtype) -> Tensor:
    """`allowed` as attention implementation `impl` takes it: additive in `dtype` for eager, the
    bool mask for the others (sdpa)."""
    return additive(allowed, dtype) if impl == "eager" else allowed


def hide_keys(mask: Tensor, keys: Tensor) -> Tensor:
    """An existing mask (bool or additive) that also hides every key where `keys` is False
    (`keys` broadcasts against it)."""
    if mask.dtype == torch.bool:
        return mask & keys
    return mask.masked_fill(~keys, torch.finfo(mask.dtype).min)
