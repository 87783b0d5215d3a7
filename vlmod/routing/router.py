"""The router (one scalar per token), the gate g(r) and the selection keys of each router kind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.config import ATTENTION_ROUTERS
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
        # Where Module.__getattr__ finds them, without its miss in the instance dict first: this
        # runs per MoD layer and decode step. (FSDP may hold them elsewhere: then the attributes.)
        # Indexed, not `.get`: DeepSpeed ZeRO-3 gathers a partitioned parameter in its
        # `_parameters.__getitem__` (and registers it with the layer whose forward is running, so
        # that layer's backward gathers it again); `dict.get` would bypass that and read a
        # zero-size shard.
        params = self._parameters
        if "weight" in params and "bias" in params:
            weight, bias = params["weight"], params["bias"]
        else:
            weight, bias = self.weight, self.bias
        if weight.dtype is not torch.float32:  # a no-op .float() still costs a dispatch per layer and step
            weight, bias = self._float_weights(weight, bias)
        if torch.compiler.is_compiling():
            # One fused reduction (casts included) where compiled, not casts around a GEMV
            # library call: a decode step's router is one kernel, not four.
            return (x.float() * weight.float()).sum(-1, keepdim=True) + bias.float()
        if x.dtype is not torch.float32:
            x = x.float()
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return F.linear(x, weight, bias)
        return F.linear(x, weight, bias)


    def _float_weights(self, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 copies of low-precision weights, kept between calls while the weights do not
        change and no gradient flows to them (inference: two casts fewer per MoD layer and step);
        recomputed when an optimizer step or a load bumps their version."""
        if torch.is_grad_enabled() and weight.requires_grad or torch.compiler.is_compiling() or _gathered(weight):
            return weight.float(), bias.float()
        key = (weight.data_ptr(), weight._version, bias.data_ptr(), bias._version, weight.device)
        cached = self.__dict__.get("_vlmod_float")
        if cached is None or cached[0] != key:
            cached = (key, weight.detach().float(), bias.detach().float())
            self.__dict__["_vlmod_float"] = cached
        return cached[1], cached[2]


def _gathered(weight: Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions `weight`: it gathers the values into a fresh buffer
    each forward (same address and version possible after an optimizer step), so a copy keyed on
    them could be stale."""
    return hasattr(weight, "ds_id")


def _gate_parts(scores: Tensor, kind: str, alpha: float) -> tuple[Tensor, float] | None:
    """(t, scale) with g(r) = 1 + scale * t in float32, or None when g is identically 1."""
    if scores.dtype is not torch.float32:  # a no-op .float() still costs a dispatch per layer and step
        scores = scores.float()
    if kind == "tanh":
        return torch.tanh(scores), alpha
    if kind == "sigmoid":
        return torch.tanh(0.5 * scores), 1.0
    if kind == "none":
        return None
    raise ValueError(f"unknown gate {kind!r}")


def gate(scores: Tensor, kind: str, alpha: float, offset: bool = False) -> Tensor | None:
    """g(r) per token in float32, or None when g is identically 1; with `offset`, g(r) - 1.

    g(r) = 1 + alpha tanh(r) ("tanh"), 2 sigmoid(r) = 1 + tanh(r / 2) ("sigmoid"): exactly 1
    where r = 0, so a fresh router changes nothing. The offset, not g itself, is what meets
    low-precision token states: near g = 1 a bfloat16 g has a step of 2^-7 (0.2 tanh(r) would have
    to exceed it before the gate moved at all), while the offset in bfloat16 keeps 8 significant
    bits of its own size."""
    parts = _gate_parts(scores, kind, alpha)
    if parts is None:
        return None
    t, scale = parts
    if offset:
        return t if scale == 1.0 else t * scale
    return torch.add(1.0, t, alpha=scale)  # one op: g = 1 + scale * t


def gate_offset(scores: Tensor, kind: str, alpha: float) -> Tensor | None:
    """g(r) - 1 per token in float32, or None when g is identically 1 (`gate` with `offset`)."""
    return gate(scores, kind, alpha, offset=True)


def gated_residual(x: Tensor, y: Tensor, scores: Tensor, kind: str, alpha: float) -> Tensor:
    """x + g(r) (y - x) for token states x, y [B, K, D] and router logits r ([B, K] or [B, K, 1]),
    in the dtype of y (never upcast): g == 1 gives y bit for bit (a fresh conversion at capacity
    1.0 is the upstream model exactly, in any dtype), and the gate stays on the gradient path of
    the router.

    Float32 states take one `torch.lerp` (one pass over x and y; for g >= 0.5 it computes
    y - (1 - g)(y - x), so g == 1 is exact). Lower precisions take y + scale * t (y - x) in one
    `addcmul`, t = tanh(.) from float32 logits cast to the states' dtype and the scale a scalar
    of the op: a bfloat16 g near 1 would round small gates away, a bfloat16 t keeps 8 bits of
    its own size."""
    if y.dtype is torch.float32:
        weight = gate(scores, kind, alpha)
        if weight is None:
            return y
        if weight.dim() < y.dim():
            weight = weight.unsqueeze(-1)
        return torch.lerp(x, y, weight)
    parts = _gate_parts(scores, kind, alpha)
    if parts is None:
        return y
    t, scale = parts
    if t.dim() < y.dim():
        t = t.unsqueeze(-1)
    return torch.addcmul(y, y - x, t.to(y.dtype), value=scale)


def gated_decode_step(router: Router, x: Tensor, y: Tensor, kind: str, alpha: float) -> tuple[Tensor, Tensor]:
    """(`gated_residual(x, y, logits, kind, alpha)`, logits = `router.logits(x)`) for the one token
    per row of a decode step ([B, 1, D]; logits [B, 1, 1], the shape the gate meets the states in):
    the router and three ops of gate in float32 (tanh, add, lerp), this runs per MoD layer and
    token."""
    logits = router.logits(x)
    return gated_residual(x, y, logits, kind, alpha), logits


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
    if kind in ATTENTION_ROUTERS:
        raise ValueError(
            "the attention router needs the layer's attention projections: its keys come from "
            "vlmod.routing.attention.attention_keys (LayerRouting.keys), not from router scores"
        )
    raise ValueError(f"unknown router {kind!r}")
