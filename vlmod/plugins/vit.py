"""The block adapter shared by ViT encoders: prefix tokens first, then image patches.

A ViT block is `block(x, ..., mask, ...) -> x`; the frameworks differ only in where the
blocks live, how many prefix tokens there are, the token axis and the name of the mask argument,
which their plugin files supply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from vlmod.config import MoDConfig, TokenType
from vlmod.plugins.calls import ArgSlot
from vlmod.routing.layer import MoDPart
from vlmod.routing.selection import Selection, TokenLayout


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
    ):
        self.num_prefix = num_prefix
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
