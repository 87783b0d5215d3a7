"""The block adapter shared by ViT encoders: prefix tokens first, then image patches.

A ViT block is `block(x, ..., mask, ...) -> x`; the frameworks differ only in where the
blocks live, how many prefix tokens there are, the token axis and the name of the mask argument,
which their plugin files supply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.config import MoDConfig, TokenType
from vlmod.plugins.calls import ArgSlot
from vlmod.routing.attention import AttentionQK, by_key_head
from vlmod.routing.layer import MoDPart
from vlmod.routing.selection import Selection, TokenLayout

# Per framework, for the attention router: (block, x [B, L, D], query_index [B, T]) ->
# (q [B, H, T, d], k [B, H, L, d], scale) of the block's self-attention on its normed input.
QKFn = Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor, float]]
# Why a block cannot be scored by attention (None: it can).
QKCheck = Callable[[nn.Module], "str | None"]


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x [B, L, ...] at index [B, T] -> [B, T, ...]."""
    return x[torch.arange(x.shape[0], device=x.device).unsqueeze(1), index]


def linear_slice(linear: nn.Module, x: Tensor, start: int, stop: int) -> Tensor:
    """Output features [start, stop) of a fused projection (qkv): a plain Linear computes only
    those rows of its weight; anything else (a LoRA wrapper) runs whole and is sliced."""
    if type(linear) is nn.Linear:
        bias = None if linear.bias is None else linear.bias[start:stop]
        return F.linear(x, linear.weight[start:stop], bias)
    return linear(x)[..., start:stop]


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[B, L, H * d] -> [B, H, L, d]."""
    batch, length, width = x.shape
    return x.view(batch, length, heads, width // heads).transpose(1, 2)


def gather_attention_mask(mask: Tensor, sel: Selection) -> Tensor:
    """Restrict a self-attention mask ([L, L], [B, L, L], [B, H, L, L] or key padding [B, L])
    to the selected tokens."""
    if sel.index is None:
        return mask
    index = sel.index
    batch, k = index.shape
    length = sel.length
    if mask.dim() == 2 and mask.shape == (batch, length) and mask.shape != (length, length):
        return mask.gather(1, index)
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    squeeze_heads = mask.dim() == 3
    if squeeze_heads:
        mask = mask.unsqueeze(1)
    mask = mask.expand(batch, mask.shape[1], length, length)
    heads = mask.shape[1]
    mask = mask.gather(2, index[:, None, :, None].expand(batch, heads, k, length))
    mask = mask.gather(3, index[:, None, None, :].expand(batch, heads, k, k))
    return mask.squeeze(1) if squeeze_heads else mask


class ViTAdapter:
    """Routes the patch tokens of a ViT block; prefix tokens (CLS, distill, registers) always run."""

    def __init__(
        self,
        block_cls: type,
        num_prefix: int,
        config: MoDConfig,
        batch_first: bool = True,
        mask_arg: str | None = None,
        qk: QKFn | None = None,
        qk_check: QKCheck | None = None,
    ):
        self.num_prefix = num_prefix
        self.qk = qk
        self.qk_check = qk_check
        self.image_routable = TokenType.IMAGE in config.routable_types
        self.batch_first = batch_first
        self.mask = ArgSlot(block_cls.forward, mask_arg) if mask_arg else None
        self._layouts: dict[tuple[int, int, torch.device], TokenLayout] = {}

    def begin_forward(self, part: MoDPart, args: tuple, kwargs: dict) -> None:
        pass

    def hidden_states(self, args: tuple, kwargs: dict) -> Tensor:
        x = args[0]
        return x if self.batch_first else x.transpose(0, 1)

    def layout(self, part: MoDPart, x: Tensor, args: tuple, kwargs: dict) -> TokenLayout:
        batch, length = x.shape[:2]
        if length <= self.num_prefix:
            raise ValueError(
                f"{part.family}: a MoD layer got {length} tokens but the model has "
                f"{self.num_prefix} prefix tokens; there are no patch tokens to route"
            )
        key = (batch, length, x.device)
        if key not in self._layouts:
            self._layouts.clear()
            self._layouts[key] = TokenLayout.prefix_then_image(
                batch, length, self.num_prefix, self.image_routable, x.device
            )
        return self._layouts[key]

    def run(
        self, upstream: Callable, x_sel: Tensor, sel: Selection, args: tuple, kwargs: dict, layer_idx: int
    ) -> Tensor:
        args, kwargs = list(args), dict(kwargs)
        args[0] = x_sel if self.batch_first else x_sel.transpose(0, 1)
        mask = self.mask.get(args, kwargs) if self.mask is not None else None
        if mask is not None:
            self.mask.set(args, kwargs, gather_attention_mask(mask, sel))
        y = upstream(*args, **kwargs)
        return y if self.batch_first else y.transpose(0, 1)

    def output(self, out: Tensor, args: tuple, kwargs: dict) -> Any:
        return out if self.batch_first else out.transpose(0, 1)

    # -- the attention router: prefix (CLS / register) tokens are the queries -----------------

    def check_attention_router(self, blocks: list[nn.Module]) -> None:
        if self.num_prefix == 0:
            raise ValueError(
                "the attention router ranks patches by the attention they receive from prefix (CLS) "
                "tokens, and this ViT has none (SigLIP); use learned, random or stride routing"
            )
        if self.qk is None:
            raise ValueError("the attention router is not supported for this ViT family")
        for block in blocks:
            reason = self.qk_check(block) if self.qk_check is not None else None
            if reason:
                raise ValueError(f"the attention router cannot score a {type(block).__name__}: {reason}")

    def attention_qk(
        self, block: nn.Module, x: Tensor, query_index: Tensor, args: tuple, kwargs: dict
    ) -> AttentionQK:
        if self.mask is not None and self.mask.get(args, kwargs) is not None:
            raise ValueError("the attention router does not support ViT blocks called with an attention mask")
        q, k, scale = self.qk(block, x, query_index)
        return AttentionQK(q=by_key_head(q, k.shape[1]), k=k, scale=scale, causal=False)
