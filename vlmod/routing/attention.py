"""The training-free "attention" router: rank routable tokens by the attention text pays them.

For a MoD layer about to run on token states `x` (the previous layer's output), the key of a
routable token j is the attention it receives from the query tokens Q of its row,

    a_j = 1/(H |Q|) * sum_{h, t in Q} softmax_j( q_{h,t} . k_{h,j} * scale  [masked] )

with q and k this layer's own attention projections of its normed input (RoPE and q/k norms
included, exactly as the layer would apply them), the softmax over the keys query t would see
in the dense layer (causal in a decoder, never padding). So a_j is the row-mean over heads and
query tokens of the dense attention map this layer would compute; rows of Q that precede every
routable token (a system prompt before the image) add the same zero to every j and do not change
the ranking. Query tokens are the protected `instruction` tokens (a LLaVA prompt; `response`
tokens, known only when labels are given, are left out so teacher-forced scoring and generation
rank alike) and `prefix` tokens (a ViT's CLS/register tokens).

Why this variant of FastV's "attention from text in the previous layer": the decision is about
the layer about to run, whose input is the previous layer's output, so it needs no attention map
from another layer (none exists under sdpa/flash, and an eager map is O(L^2) memory), no state
between layers, and it works in the first converted layer as in any other.

Cost per MoD layer and row, L tokens, T = |Q|, D width, H heads of size d, H_kv key heads: the
key projection of every token, L*D*H_kv*d MACs (at most one of the layer's four attention
projections: about 1/12 of a dense Llama layer per token, under 2% with 7:1 grouped-query
attention), the query projection of the T query tokens, T*D*H*d, and the scores, H*T*L*d; memory
H*T*L floats. No L x L map is ever formed. At capacity 1.0, and when a batch has nothing
routable (decode steps), nothing is computed. Runs under no_grad: top-k has no gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from vlmod.config import TokenType
from vlmod.routing.selection import TokenLayout, routable_mask

# Protected token types whose attention ranks the routable tokens.
QUERY_TYPES = (TokenType.INSTRUCTION, TokenType.PREFIX)


class AttentionQK(NamedTuple):
    """What a plugin computes for the attention router, in the layer's own attention space."""

    # [B, H_kv, G, T, d] queries of the query tokens (RoPE / q-norm applied), the G = H / H_kv query
    # heads that read key head j at q[:, j] (transformers' repeat_kv order; `by_key_head` makes it
    # from [B, H, T, d]); so grouped, a plugin that computes them beside the keys passes a view.
    q: Tensor
    k: Tensor  # [B, H_kv, L, d] keys of every token
    scale: float  # the layer's softmax scale (usually d ** -0.5)
    causal: bool  # a query sees only keys at or before its own position


class AttentionSource(Protocol):
    """The plugin side of the attention router (an optional part of a block adapter)."""

    def check_attention_router(self, blocks: list[nn.Module]) -> None:
        """Raise ValueError (saying why) if these blocks cannot be scored by attention."""

    def attention_qk(
        self, block: nn.Module, x: Tensor, query_index: Tensor, args: tuple, kwargs: dict
    ) -> AttentionQK:
        """Queries of the tokens at `query_index` [B, T] and keys of all tokens of `x` [B, L, D]."""


def check_attention_router(adapter: Any, blocks: list[nn.Module], family: str) -> None:
    """ValueError unless `adapter` can score `blocks` by attention."""
    check = getattr(adapter, "check_attention_router", None)
    if check is None or not hasattr(adapter, "attention_qk"):
        raise ValueError(f"the attention router is not supported for {family} models")
    check(blocks)


def query_tokens(layout: TokenLayout) -> tuple[Tensor, Tensor | None]:
    """(index [B, T], valid [B, T] or None) of each row's query tokens, in order; computed once
    per forward (one host read, T and whether every row has T, unless the layout knows its routable
    count from shapes) and shared by its MoD layers."""
    return layout.per_forward("attention queries", lambda: _query_tokens(layout))


def _query_tokens(layout: TokenLayout) -> tuple[Tensor, Tensor | None]:
    batch, length = layout.shape
    device = layout.token_types.device
    if layout.num_prefix is not None:
        p = layout.num_prefix
        if p == 0:
            raise ValueError(
                "the attention router ranks patches by the attention they receive from prefix (CLS) "
                "tokens, and this ViT has none"
            )
        return torch.arange(p, device=device).expand(batch, p), None
    is_query = layout.protected & routable_mask(layout.token_types, QUERY_TYPES)  # no id tensor to copy
    positions = layout.positions()
    routable = layout.known_routable_count()
    if routable is not None:
        # One row whose routable count follows from shapes: every token that is not routable takes
        # a query slot, the ones that are not queries (padding, answer tokens under labels) as
        # filler. No host read; their rows of scores weigh 0.
        slots = max(length - routable, 1)
        slot_key = torch.where(layout.not_routable(), positions, positions + length)
        index = slot_key.topk(slots, dim=1, largest=False, sorted=True).indices
        return index, is_query.gather(1, index)
    counts = is_query.sum(1)
    most, fewest = torch.stack((counts.max(), counts.min())).tolist() if batch else (1, 1)
    total = max(most, 1)
    slot_key = torch.where(is_query, positions, positions + length)
    index = slot_key.topk(min(total, length), dim=1, largest=False, sorted=True).indices
    # Every row holds `total` queries: no filler slot to mask.
    return index, None if fewest == most and most > 0 else is_query.gather(1, index)


class QueryPlan(NamedTuple):
    """What the scores need besides q and k, the same for every layer of a forward."""

    blocked: Tensor  # [B, 1, T, L] bool: the keys a query slot does not see (padding, later tokens)
    weight: Tensor  # [B, T] each query slot's weight in the mean over heads and queries (0: filler)


def query_plan(query_index: Tensor, query_valid: Tensor | None, key_valid: Tensor, causal: bool,
               heads: int) -> QueryPlan:
    """The mask and weights of `received_attention` for queries at `query_index` [B, T] (`query_valid`
    [B, T]: the real ones, None: all), keys `key_valid` [B, L] (not padding), `heads` query heads:
    built once a forward, shared by its layers."""
    batch, t = query_index.shape
    length = key_valid.shape[1]
    allowed = key_valid[:, None, :].expand(batch, t, length)
    if causal:
        keys = torch.arange(length, device=key_valid.device)
        allowed = allowed & (keys[None, None, :] <= query_index[:, :, None])
    if query_valid is not None:
        # Filler query slots attend anywhere (a finite softmax) and get weight 0.
        allowed = allowed | ~query_valid[:, :, None]
    if query_valid is None:
        weight = torch.full((batch, t), 1.0 / (heads * t), device=key_valid.device)
    else:
        valid = query_valid.float()
        weight = valid / (heads * valid.sum(1, keepdim=True).clamp_min(1.0))
    return QueryPlan(~allowed[:, None], weight)


def by_key_head(q: Tensor, kv_heads: int) -> Tensor:
    """[B, H, T, d] queries as `AttentionQK.q` takes them, [B, H_kv, G, T, d] (a view)."""
    if q.shape[1] % kv_heads:
        raise ValueError(f"{q.shape[1]} query heads cannot share {kv_heads} key heads")
    return q.unflatten(1, (kv_heads, -1))


def received_attention(qk: AttentionQK, plan: QueryPlan) -> Tensor:
    """[B, L] float32: mean over heads and valid queries of the softmax attention each key gets,
    `plan` (`query_plan`) saying which keys each query sees and how much each query weighs. Rows
    without a valid query get 0."""
    if qk.q.dim() != 5:
        raise ValueError(f"AttentionQK.q must be [B, H_kv, G, T, d], got {tuple(qk.q.shape)}: group [B, H, T, d] "
                         "queries by key head with vlmod.routing.by_key_head")
    q, k = qk.q.float(), qk.k.float()
    batch, kv_heads, groups, t, d = q.shape
    length = k.shape[2]
    # Each key head meets its G query heads in one product: no copy of the keys or the queries.
    logits = q.flatten(2, 3) @ k.transpose(-1, -2)
    logits = logits.view(batch, kv_heads * groups, t, length) * qk.scale
    probs = logits.masked_fill(plan.blocked, float("-inf")).softmax(-1)
    return torch.einsum("bhtl,bt->bl", probs, plan.weight)


def attention_keys(
    adapter: Any, block: nn.Module, x: Tensor, layout: TokenLayout, args: tuple, kwargs: dict
) -> Tensor:
    """Selection keys [B, L] of the attention router for one MoD layer (see the module doc)."""
    index, valid = query_tokens(layout)
    with torch.no_grad():
        qk = adapter.attention_qk(block, x, index, args, kwargs)
        heads = qk.q.shape[1] * qk.q.shape[2]
        key_valid = layout.per_forward("attention keys", lambda: layout.token_types != int(TokenType.PADDING))
        plan = layout.per_forward(f"attention plan {qk.causal} {heads}",
                                  lambda: query_plan(index, valid, key_valid, qk.causal, heads))
        return received_attention(qk, plan)
