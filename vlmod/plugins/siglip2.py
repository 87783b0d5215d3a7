"""Hugging Face `Siglip2VisionModel` (NaFlex): images of any aspect ratio, their patches padded to
a fixed count per row.

The padded patches are `padding`: they never count toward k and never run a MoD layer. The
routable image patches of each row compete for k = ceil(capacity * n_real) slots; rows with fewer
real patches fill their tail with skipped slots, which the gathered attention mask hides as keys
(the upstream mask hides the padded ones already). The attention pooling head runs after the
encoder on every token with the upstream padding mask, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlmod.config import MoDConfig, TokenType
from vlmod.plugins.base import PartSpec
from vlmod.plugins.vit import ViTAdapter, gather_attention_mask
from vlmod.routing import masks
from vlmod.routing.layer import MoDPart
from vlmod.routing.selection import Selection, TokenLayout

FAMILIES = ("Hugging Face Siglip2VisionModel",)


def _classes() -> tuple[type, ...]:
    import transformers as tf

    return (tf.Siglip2VisionModel,) if hasattr(tf, "Siglip2VisionModel") else ()


def matches(model: nn.Module) -> bool:
    return isinstance(model, _classes())


def part_spec(model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec:
    if part not in (None, "vision"):
        raise ValueError(f"a Siglip2VisionModel has only a 'vision' part, got part={part!r}")
    blocks = model.encoder.layers
    return PartSpec(
        name="vision",
        family="siglip2",
        root=model,
        entry=model,
        blocks=blocks,
        dim=model.config.hidden_size,
        adapter=Siglip2Adapter(type(blocks[0]), config, model.config),
    )


class Siglip2Adapter(ViTAdapter):
    """A ViT adapter whose padded patches are padding, from the `pixel_attention_mask` of the call."""

    def __init__(self, block_cls: type, config: MoDConfig, vision_config: object):
        super().__init__(block_cls, num_prefix=0, config=config, mask_arg="attention_mask")
        self.vision_config = vision_config
        self.routable = config.routable_types
        self._layout: TokenLayout | None = None

    def begin_forward(self, part: MoDPart, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("pixel_attention_mask", args[1] if len(args) > 1 else None)
        if mask is None:
            raise ValueError("a Siglip2VisionModel is called with pixel_attention_mask (the processor returns it)")
        real = mask.bool()
        types = torch.where(real, int(TokenType.IMAGE), int(TokenType.PADDING)).long()
        self._layout = TokenLayout.from_types(types, self.routable, part.capacities.values())

    def layout(self, part: MoDPart, x: Tensor, args: tuple, kwargs: dict) -> TokenLayout:
        if self._layout is None or self._layout.shape != tuple(x.shape[:2]):
            raise RuntimeError("Siglip2 MoD layers need the patch mask: call the Siglip2VisionModel itself")
        return self._layout

    def run(
        self, upstream: Callable, x_sel: Tensor, sel: Selection, args: tuple, kwargs: dict, layer_idx: int
    ) -> Tensor:
        args, kwargs = list(args), dict(kwargs)
        args[0] = x_sel
        mask = self.mask.get(args, kwargs)
        if mask is not None:
            mask = gather_attention_mask(mask, sel)
        if sel.valid is not None:
            # Skipped slots of rows with fewer real patches: no query may attend to them.
            keys = sel.valid[:, None, None, :]
            if mask is None:
                mask = masks.as_attention_mask(keys, self.vision_config._attn_implementation, x_sel.dtype)
            else:
                mask = masks.hide_keys(mask, keys)
        self.mask.set(args, kwargs, mask)
        return upstream(*args, **kwargs)
