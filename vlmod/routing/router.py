"""The router (one scalar per token), the gate g(r) and the selection keys of each router kind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.routing.selection import TokenLayout


class Router(nn.Linear):
    """Linear(d, 1) initialised to zero, so a fresh conversion gates every token by g(0) = 1."""

    def __init__(self, dim: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(dim, 1, device=device, dtype=dtype)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, L, D] -> router logits [B, L], always float32 (see `logits`)."""
        return self.logits(x).squeeze(-1)

    def logits(self, x: Tensor) -> Tensor:
        """x [B, L, D] -> router logits [B, L, 1], always float32: the shape the gate meets the
        token states in, so a decode step needs no squeeze or unsqueeze. MoD layers call this
        directly, inside their block's forward (whose hooks have run): a module call would add
        its hook machinery to every layer and step.

        The weights stay in the model's dtype (checkpoints and FSDP's flat parameters keep one
        dtype), but the logits are computed in float32, also under autocast: in bfloat16 they
        would carry 8 significant bits, so top-k would rank on ties and rounding. Only the
        router's own copy of x is upcast; the tokens the block runs on keep their dtype."""
        weight, bias = self.weight, self.bias
        if weight.dtype != torch.float32:  # a no-op .float() still costs a dispatch per layer and step
            weight, bias = weight.float(), bias.float()
        if x.dtype != torch.float32:
            x = x.float()
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return F.linear(x, weight, bias)
        return F.linear(x, weight, bias)


def gate_offset(scores: Tensor, kind: str, alpha: float) -> Tensor | None:
    """g(r) - 1 per token in float32, or None when g is identically 1.

    The offset, not g itself, is what meets low-precision token states: near g = 1 a bfloat16 g
    has a step of 2^-7 (0.2 tanh(r) would have to exceed it before the gate moved at all), while
    the offset in bfloat16 keeps 8 significant bits of its own size."""
    if scores.dtype != torch.float32:  # a no-op .float() still costs a dispatch per layer and step
        scores = scores.float()
    if kind == "tanh":
        return alpha * torch.tanh(scores)
    if kind == "sigmoid":
        return torch.tanh(0.5 * scores)  # 2 sigmoid(r) - 1
    if kind == "none":
        return None
    raise ValueError(f"unknown gate {kind!r}")


def gate(scores: Tensor, kind: str, alpha: float) -> Tensor | None:
    """g(r) per token in float32 (two ops), or None when g is identically 1."""
    if scores.dtype != torch.float32:
        scores = scores.float()
    if kind == "tanh":
        return torch.add(1.0, torch.tanh(scores), alpha=alpha)  # exactly 1 where r = 0
    if kind == "sigmoid":
        return 2.0 * torch.sigmoid(scores)
    if kind == "none":
        return None
    raise ValueError(f"unknown gate {kind!r}")


def gated_residual(x: Tensor, y: Tensor, scores: Tensor, kind: str, alpha: float) -> Tensor:
    """x + g(r) (y - x) for token states x, y [B, K, D] and router logits r ([B, K] or [B, K, 1]),
    in the dtype of y (never upcast): g == 1 gives y bit for bit (a fresh conversion at capacity
    1.0 is the upstream model exactly, in any dtype), and the gate stays on the gradient path of
    the router.

    Float32 states take one `torch.lerp` (one pass over x and y; for g >= 0.5 it computes
    y - (1 - g)(y - x), so g == 1 is exact). Lower precisions take y + (g - 1)(y - x) with the
    offset g - 1 from float32 (`gate_offset`): a bfloat16 g near 1 would round small gates away."""
    if y.dtype == torch.float32:
        weight = gate(scores, kind, alpha)
        if weight is None:
            return y
        return torch.lerp(x, y, weight if weight.dim() == y.dim() else weight.unsqueeze(-1))
    offset = gate_offset(scores, kind, alpha)
    if offset is None:
        return y
    if offset.dim() < y.dim():
        offset = offset.unsqueeze(-1)
    if offset.dtype != y.dtype:
        offset = offset.to(y.dtype)
    return torch.addcmul(y, y - x, offset)


def gated_decode_step(router: Router, x: Tensor, y: Tensor, kind: str, alpha: float) -> tuple[Tensor, Tensor]:
    """(`gated_residual(x, y, logits, kind, alpha)`, logits = `router.logits(x)`) for the one token
    per row of a decode step: the same numbers, with float32 states and the tanh gate in four
    tensor ops and no helper calls. It runs per MoD layer and token, right after the block's
    matmuls have evicted the interpreter's working set, where each Python step costs several
    times its warm cost (at the video preset, 8 frames, the helpers' path cost 0.3 ms more per
    52 ms step, 0.5%)."""
    params = router._parameters  # what Module.__getattr__ finds, without the miss before it
    weight, bias = params.get("weight"), params.get("bias")  # (FSDP may hold them elsewhere)
    if (
        weight is None or bias is None or kind != "tanh" or weight.dtype is not torch.float32
        or x.dtype is not torch.float32 or y.dtype is not torch.float32 or torch.is_autocast_enabled(x.device.type)
    ):
        logits = router.logits(x)
        return gated_residual(x, y, logits, kind, alpha), logits
    logits = F.linear(x, weight, bias)
    return torch.lerp(x, y, torch.add(1.0, torch.tanh(logits), alpha=alpha)), logits


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
