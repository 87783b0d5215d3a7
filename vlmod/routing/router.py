"""The router (one scalar per token), the gate g(r) and the selection keys of each router kind."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vlmod.routing.selection import TokenLayout


class Router(nn.Linear):
    """Linear(d, 1) initialised to zero, so a fresh conversion gates every token by g(0) = 1."""

    def __init__(self, dim: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(dim, 1, device=device, dtype=dtype)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, L, D] -> router logits [B, L]."""
        if x.dtype != self.weight.dtype:  # a no-op .to() still costs a dispatch per layer and step
            x = x.to(self.weight.dtype)
        return super().forward(x).squeeze(-1)


def gate(scores: Tensor, kind: str, alpha: float) -> Tensor | None:
    """g(r) per token, or None when g is identically 1."""
    if kind == "tanh":
        return 1.0 + alpha * torch.tanh(scores)
    if kind == "sigmoid":
        return 2.0 * torch.sigmoid(scores)
    if kind == "none":
        return None
    raise ValueError(f"unknown gate {kind!r}")


def gated_residual(x: Tensor, y: Tensor, scores: Tensor, kind: str, alpha: float) -> Tensor:
    """x + g(r) (y - x) for token states x, y [B, K, D] and router logits r [B, K], as one
    `torch.lerp`: for weights >= 0.5 it computes y - (y - x)(1 - g), so g == 1 gives y bit for bit
    (a fresh conversion at capacity 1.0 is the upstream model exactly), and the gate stays on the
    gradient path of the router."""
    g = gate(scores, kind, alpha)
    if g is None:
        return y
    g = g.unsqueeze(-1)
    if g.dtype != y.dtype:
        g = g.to(y.dtype)
    return torch.lerp(x, y, g)


def selection_keys(
    kind: str, scores: Tensor, layout: TokenLayout, capacity: float, generator: torch.Generator | None
) -> Tensor:
    """What top-k ranks for each router kind that needs only the router `scores`; the gate always
    uses the learned `scores`. ("attention" ranks by the layer's own attention: routing/attention.py.)"""
    if kind == "learned":
        return scores
    if kind == "inverted":
        return -scores
    if kind == "random":
        return torch.rand(scores.shape, device=scores.device, generator=generator)
    if kind == "stride":
        # Routable token j of a row with n routable and k slots is kept iff (j * k) mod n < k:
        # exactly k evenly spaced tokens (j = ceil(i * n / k), i < k), the same for every input.
        routable = layout.routable
        j = routable.long().cumsum(1) - 1
        n = routable.sum(1, keepdim=True).clamp_min(1)
        k = layout.budget(capacity).k
        k = k.unsqueeze(1) if isinstance(k, Tensor) else k
        return -((j * k) % n).to(scores.dtype)
    if kind == "attention":
        raise ValueError(
            "the attention router needs the layer's attention projections: its keys come from "
            "vlmod.routing.attention.attention_keys (LayerRouting.keys), not from router scores"
        )
    raise ValueError(f"unknown router {kind!r}")
