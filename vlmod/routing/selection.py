"""Which tokens run a MoD layer: protected tokens always, the top-k routable ones by score.

Shapes are static per batch: a selection is a `[B, K]` index of processed positions in their
original order, with K the largest per-row count of the batch. Rows that process fewer tokens
(padding, fewer image tokens) fill their tail with skipped positions marked invalid, which are
written back unchanged.

Every op here is a kernel launch on a GPU, and this runs per MoD layer (docs/engine.md, host
cost): a selection is one `where` (protected tokens ranked first, padding last), one stable sort
of the row and one sort of the K kept positions; the batch's layout (who is routable, how many
slots) is computed once per forward, lazily, and from shapes where the call allows it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vlmod.config import TokenType
from vlmod.routing.schedule import capacity_to_k, capacity_to_k_tensor


class Budget(NamedTuple):
    """Slots of one capacity in one batch."""

    k: Tensor | int  # routable tokens each row keeps ([B] or one count for every row)
    total: int  # K: processed slots per row of the gathered batch (the largest row count)
    uniform: bool  # every row processes exactly `total` tokens: no filler slots
    full: bool  # every token of every row is processed: nothing to gather


class TokenLayout:
    """Who may be skipped in one batch, computed once per forward and shared by its MoD layers.

    Only `routable` is computed up front; the token types (for a trace), the padding and the
    per-row counts are computed when something asks for them, so a forward that needs none of
    them (a decode step, a batch of one whose counts follow from shapes) launches nothing for
    them. `num_prefix` is set for the layout of a ViT (prefix tokens first, then image tokens,
    the same in every row and no padding): selection then needs no host sync at all.
    """

    def __init__(
        self,
        routable: Tensor | Callable[[], Tensor],
        token_types: Tensor | Callable[[], Tensor] | None = None,
        protected: Tensor | None = None,
        *,
        padding: Tensor | Callable[[], Tensor | None] | None = None,
        num_prefix: int | None = None,
        threshold: bool = False,
        every_token: bool = False,
        shape: tuple[int, int] | None = None,
        device: torch.device | None = None,
    ):
        if not isinstance(routable, Tensor) and (shape is None or device is None):
            raise ValueError("a layout with routable tokens computed on demand needs its shape and device")
        self._routable = routable  # [B, L] bool, or how to compute it
        self.shape: tuple[int, int] = tuple(routable.shape) if shape is None else tuple(shape)  # type: ignore[assignment]
        self.device = routable.device if device is None else device
        self._types = token_types  # [B, L] long (TokenType values), or how to compute them
        # Real tokens that always run; None: every real token that is not routable.
        self._protected = protected
        # [B, L] bool, a callable giving it (or None), or None: the batch has no padding.
        self._padding = padding
        self.num_prefix = num_prefix
        # Decode steps with routable text: a token runs iff its router logit is > 0 (the causal
        # predictor trained by aux_loss="bce"), since it cannot be ranked against future tokens.
        self.threshold = threshold
        # Every token of the batch runs every MoD layer whatever the capacity (a decode step), known
        # without looking at the types: no budget, no ranking, no host sync.
        self.every_token = every_token
        # Routable tokens of the one row of a batch without padding, known from shapes (the
        # vision features' count) rather than by reading a tensor: budgets then need no host sync.
        self.routable_count: int | None = None
        # With `routable_count` where the batch may hold padding that nobody read: padding runs
        # as filler (ranked with the protected tokens, its slots marked invalid, so nothing
        # attends to it and its states are kept), and the budgets still follow from shapes.
        self.padding_as_filler = False
        self._budgets: dict[float, Budget] = {}
        self._counts: dict[float, Tensor] = {}  # [B] processed tokens per row, by capacity
        self._shared: dict[str, Any] = {}  # what other parts of the engine compute once (`per_forward`)
        self._positions: Tensor | None = None
        self._fill: Tensor | float | None = None

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_types(
        cls,
        token_types: Tensor,
        routable_types: Iterable[TokenType],
        capacities: Iterable[float] = (),
    ) -> TokenLayout:
        """Layout of a batch with arbitrary token types; precomputes the budgets of `capacities`
        in a single host sync."""
        routable = routable_mask(token_types, routable_types)
        layout = cls(routable, token_types, padding=lambda: token_types == int(TokenType.PADDING))
        layout.prepare(capacities)
        return layout

    @classmethod
    def all_processed(
        cls,
        token_types: Tensor | Callable[[], Tensor],
        routable: Tensor | Callable[[], Tensor],
        shape: tuple[int, int] | None = None,
        device: torch.device | None = None,
    ) -> TokenLayout:
        """Layout of a batch of one token per row that is not padding (a decode step of
        `generate`): whatever its type, the token runs, since a lone routable token gets
        k = ceil(capacity * 1) = 1 slot. Nothing is computed from the types (with callables, not
        even the types), so no op and no host sync."""
        layout = cls(routable, token_types, every_token=True, shape=shape, device=device)
        if layout.shape[1] != 1:
            raise ValueError(f"all_processed is for one token per row, got {layout.shape[1]}")
        return layout

    @classmethod
    def prefix_then_image(
        cls, batch: int, length: int, num_prefix: int, image_routable: bool, device: torch.device
    ) -> TokenLayout:
        types = torch.full((batch, length), int(TokenType.IMAGE), dtype=torch.long, device=device)
        types[:, :num_prefix] = int(TokenType.PREFIX)
        routable = torch.zeros(batch, length, dtype=torch.bool, device=device)
        if image_routable:
            routable[:, num_prefix:] = True
        return cls(routable, types, ~routable, num_prefix=num_prefix if image_routable else length)

    # -- what is computed on demand, once ---------------------------------------------------------

    @property
    def routable(self) -> Tensor:
        """[B, L] bool: tokens of a routable type."""
        if not isinstance(self._routable, Tensor):
            self._routable = self._routable()
        return self._routable

    @property
    def token_types(self) -> Tensor:
        """[B, L] long of TokenType values (computed on first use: a trace, a router that reads
        types)."""
        if not isinstance(self._types, Tensor):
            if self._types is None:
                raise RuntimeError("this token layout was built without token types")
            self._types = self._types()
        return self._types

    @property
    def padding(self) -> Tensor | None:
        """[B, L] bool, or None when the batch has no padding."""
        if callable(self._padding):
            self._padding = self._padding()
        return self._padding

    def no_padding(self) -> None:
        """The caller knows the batch has no padding (e.g. transformers passed no mask)."""
        if not isinstance(self._padding, Tensor):
            self._padding = None

    @property
    def protected(self) -> Tensor:
        """[B, L] bool: real tokens that always run."""
        if self._protected is None:
            padding = self.padding
            self._protected = ~self.routable if padding is None else ~(self.routable | padding)
        return self._protected

    def rank_fill(self) -> Tensor | float:
        """What `select_tokens` ranks in place of a non-routable token's key: +inf for protected
        tokens (always kept, first), -inf for padding (never kept, last)."""
        if self._fill is None:
            padding = self.padding
            if padding is None or self.padding_as_filler:
                self._fill = float("inf")
            else:
                self._fill = torch.where(padding, float("-inf"), float("inf"))
        return self._fill

    def per_forward(self, key: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, run once for this layout and shared by its MoD layers (a layout serves one
        forward, or every forward of one shape where the types follow from the shape: a ViT):
        what a router kind derives from the token types alone, e.g. the attention router's
        query tokens."""
        if key not in self._shared:
            self._shared[key] = compute()
        return self._shared[key]

    def not_routable(self) -> Tensor:
        """[B, L] ~routable, once per forward."""
        return self.per_forward("not routable", lambda: ~self.routable)

    def positions(self) -> Tensor:
        """[B, L] token index in the row (one arange per forward, shared by its MoD layers)."""
        if self._positions is None:
            batch, length = self.shape
            self._positions = torch.arange(length, device=self.device).expand(batch, length)
        return self._positions

    # -- budgets ----------------------------------------------------------------------------------

    def prepare(self, capacities: Iterable[float]) -> None:
        """Compute the budget of each capacity with one host sync for all of them."""
        caps = [c for c in dict.fromkeys(capacities) if c not in self._budgets]
        if not caps or self.num_prefix is not None or self.every_token:
            return
        n_routable = self.routable.sum(1)
        n_protected = self.protected.sum(1)
        ks = [capacity_to_k_tensor(c, n_routable) for c in caps]
        counts = [k + n_protected for k in ks]
        extremes = torch.stack([torch.stack([n.max(), n.min()]) for n in counts]).tolist()
        length = self.shape[1]
        for c, k, count, (most, least) in zip(caps, ks, counts, extremes, strict=True):
            self._budgets[c] = Budget(k, int(most), most == least, least == length)
            self._counts[c] = count

    def budget(self, capacity: float) -> Budget:
        """The slots of this batch at `capacity`."""
        if self.every_token:
            length = self.shape[1]
            return Budget(self.routable.sum(1), length, True, True)
        if self.num_prefix is not None:
            length = self.shape[1]
            k = capacity_to_k(capacity, length - self.num_prefix)
            total = self.num_prefix + k
            return Budget(k, total, True, total == length)
        if capacity not in self._budgets:
            n = self.known_routable_count()
            if n is not None:
                length = self.shape[1]
                k = capacity_to_k(capacity, n)
                full = k == n and not self.padding_as_filler
                self._budgets[capacity] = Budget(k, length - n + k, True, full)
            else:
                self.prepare([capacity])
        return self._budgets[capacity]

    def known_routable_count(self) -> int | None:
        """The routable tokens of the batch's one row where they follow from shapes (`routable_count`,
        no padding or padding run as filler), else None: what lets budgets, and the attention
        router's query slots, be sized without reading a tensor."""
        if self.routable_count is not None and self.shape[0] == 1 and (
            self.padding_as_filler or self.padding is None
        ):
            return self.routable_count
        return None

    def slot_valid(self, capacity: float) -> Tensor:
        """[B, K] bool, once per forward and capacity where rows process different counts: True on
        a row's processed slots, which come first (see `select_tokens`); every MoD layer of that
        capacity shares this tensor, and so can share the masks built from it."""
        def compute() -> Tensor:
            slots = torch.arange(self.budget(capacity).total, device=self.device)
            return slots < self._counts[capacity].unsqueeze(1)

        return self.per_forward(f"slot valid {capacity}", compute)

    def filler_offset(self, capacity: float) -> Tensor:
        """[B, K] long, once per forward and capacity: 0 on a row's processed slots in rank order,
        L on its filler slots (see `select_tokens`)."""
        return self.per_forward(
            f"filler offset {capacity}", lambda: (~self.slot_valid(capacity)).long() * self.shape[1]
        )


def routable_mask(token_types: Tensor, routable_types: Iterable[TokenType]) -> Tensor:
    """[B, L] bool: the tokens of any of these types (the routable ones; the attention router's
    query types too). One comparison per type (two at most), not a tensor of ids: building one on
    the host and copying it to a GPU would be a host sync in every forward."""
    routable = None
    for t in routable_types:
        hit = token_types == int(t)
        routable = hit if routable is None else routable | hit
    return torch.zeros_like(token_types, dtype=torch.bool) if routable is None else routable


@dataclass
class Selection:
    """The processed tokens of one MoD layer: `index` [B, K] ascending (filler slots, where
    `valid` is False, after a row's processed ones), `valid` [B, K] or None."""

    index: Tensor | None  # None: every token runs (no gather needed)
    valid: Tensor | None
    length: int
    _flat_index: Tensor | None = field(default=None, repr=False)  # [B * K] rows * L + index, once per layer

    def gather(self, x: Tensor) -> Tensor:
        """x [B, L, ...] (or [1, L, ...], shared by every row: positions, RoPE cos / sin) ->
        [B, K, ...]. One `index_select` over the flattened rows: 2-4x faster on CPU than advanced
        indexing x[rows, index], and no [B, 1] row arange per gathered tensor."""
        if self.index is None:
            return x
        batch, k = self.index.shape
        if x.shape[0] == 1 and batch > 1:
            return x[0].index_select(0, self.index.reshape(-1)).view(batch, k, *x.shape[2:])
        rest = x.shape[2:]
        return x.reshape(batch * x.shape[1], *rest).index_select(0, self.flat_index()).view(batch, k, *rest)

    def scatter(self, x: Tensor, values: Tensor) -> Tensor:
        """A copy of x [B, L, ...] with the selected positions replaced by values [B, K, ...]: one
        out-of-place `index_copy`."""
        if self.index is None:
            return values
        batch, length = x.shape[:2]
        rest = x.shape[2:]
        flat = x.reshape(batch * length, *rest).index_copy(0, self.flat_index(), values.reshape(-1, *rest))
        return flat.view(batch, length, *rest)

    def flat_index(self) -> Tensor:
        """[B * K]: the selected positions as rows of the [B * L, ...] flattened batch."""
        if self._flat_index is None:
            batch = self.index.shape[0]
            flat = self.index
            if batch > 1:
                flat = flat + torch.arange(0, batch * self.length, self.length, device=flat.device).unsqueeze(1)
            self._flat_index = flat.reshape(-1)
        return self._flat_index

    def processed_mask(self) -> Tensor:
        """[B, L] bool: True where the token ran the layer."""
        if self.index is None:
            raise RuntimeError("processed_mask of a full selection needs the batch shape")
        mask = torch.zeros(self.index.shape[0], self.length, dtype=torch.bool, device=self.index.device)
        src = self.valid if self.valid is not None else torch.ones_like(self.index, dtype=torch.bool)
        return mask.scatter(1, self.index, src)


def select_tokens(keys: Tensor, layout: TokenLayout, capacity: float) -> Selection:
    """Protected tokens plus, per row, the k = ceil(capacity * n_routable) routable tokens with the
    highest `keys` [B, L] (ties to the earlier token); original order kept. No loop over rows or
    tokens.

    One stable sort ranks a row with protected tokens first (+inf), routable ones by key and
    padding last (-inf); its first K entries are a row's processed tokens (and, in a row that
    processes fewer than K, the next-ranked as filler), and a sort of those K puts them back in
    order. Filler slots are offset by L before that sort, so they land after the processed ones:
    `valid` is then the same tensor for every layer of one capacity (`TokenLayout.slot_valid`)."""
    batch, length = layout.shape
    if layout.threshold:
        processed = layout.protected | (layout.routable & (keys > 0))
        positions = layout.positions()
        return _ordered_selection(processed, positions, int(processed.sum(1).max()), uniform=False)
    if layout.every_token:
        return Selection(index=None, valid=None, length=length)
    budget = layout.budget(capacity)
    if budget.full:
        return Selection(index=None, valid=None, length=length)
    if layout.num_prefix is not None:
        p = layout.num_prefix
        top = keys[:, p:].topk(budget.k, dim=1, sorted=False).indices.sort(dim=1).values + p
        prefix = torch.arange(p, device=keys.device).expand(batch, p)
        return Selection(index=torch.cat([prefix, top], dim=1), valid=None, length=length)
    if keys.dtype != torch.float32:  # a no-op .float() still costs a dispatch per layer
        keys = keys.float()
    ranked = torch.where(layout.routable, keys, layout.rank_fill())
    order = ranked.sort(dim=1, descending=True, stable=True).indices[:, : budget.total]
    if budget.uniform:
        index = order.sort(dim=1).values
        valid = None
        if layout.padding_as_filler and layout.padding is not None:
            valid = layout.per_forward("not padding", lambda: ~layout.padding).gather(1, index)
        return Selection(index=index, valid=valid, length=length)
    slots = (order + layout.filler_offset(capacity)).sort(dim=1).values
    return Selection(index=slots.remainder(length), valid=layout.slot_valid(capacity), length=length)


def _ordered_selection(processed: Tensor, positions: Tensor, total: int, uniform: bool) -> Selection:
    """The `total` slots per row: processed positions ascending, then skipped ones as filler
    (`valid` False; None when no row has filler)."""
    length = processed.shape[1]
    slot_key = torch.where(processed, positions, positions + length)
    index = slot_key.topk(total, dim=1, largest=False, sorted=True).indices
    return Selection(index=index, valid=None if uniform else processed.gather(1, index), length=length)
