"""A MoD layer: the upstream block class with routing put in front of its own forward.

Conversion swaps the class of each converted block for a subclass (ToMe style), so parameter
names, hooks on the upstream class and gradient checkpointing all stay as they were; the
routing state lives in a plain attribute, the router in `mod_router` of the part root (shared)
or of each block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.config import ATTENTION_ROUTERS, MoDConfig
from vlmod.routing.attention import attention_keys, check_attention_router
from vlmod.routing.router import Router, gated_decode_step, gated_residual, selection_keys
from vlmod.routing.selection import Selection, TokenLayout, select_tokens

ROUTER_ATTR = "mod_router"
PART_ATTR = "_vlmod_part"
LAYER_ATTR = "_vlmod_layer"


class BlockAdapter(Protocol):
    """What a plugin knows about its blocks; the routing math never looks past this."""

    def hidden_states(self, args: tuple, kwargs: dict) -> Tensor:
        """The token states [B, L, D] the block was called with."""

    def layout(self, part: MoDPart, x: Tensor, args: tuple, kwargs: dict) -> TokenLayout:
        """The token layout of this batch."""

    def run(
        self, upstream: Callable, x_sel: Tensor, sel: Selection, args: tuple, kwargs: dict, layer_idx: int
    ) -> Tensor:
        """Call the upstream block on the selected tokens (masks, positions, caches gathered)."""

    def output(self, out: Tensor, args: tuple, kwargs: dict) -> Any:
        """Turn the full-length states [B, L, D] into what the upstream block returns."""

    def begin_forward(self, part: MoDPart, args: tuple, kwargs: dict) -> None:
        """Called before each forward of the part's entry module."""


@dataclass
class MoDPart:
    """The converted layers of one model part ("vision" or "language") and their shared state."""

    name: str
    config: MoDConfig
    root: nn.Module
    blocks: nn.ModuleList
    adapter: BlockAdapter
    capacities: dict[int, float]
    family: str
    trace: Any = None
    aux_losses: dict[int, Tensor] = field(default_factory=dict)
    generator: torch.Generator | None = None
    hooks: list = field(default_factory=list)
    first_keys: Tensor | None = None  # the "fastv" router's ranking, made by this forward's first MoD layer

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.first_keys = None
        self.adapter.begin_forward(self, args, kwargs)

    def post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        end_forward = getattr(self.adapter, "end_forward", None)
        return output if end_forward is None else end_forward(self, output)

    def random_generator(self, layer_idx: int, device: torch.device) -> torch.Generator | None:
        """The seeded generator of the "random" router, reset per layer from (seed, layer), so a
        forward, its rerun under gradient checkpointing and every later forward draw alike."""
        if self.config.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
        return self.generator.manual_seed(self.config.seed * 1_000_003 + layer_idx)

    def check_attention_router(self) -> None:
        """ValueError (saying why) unless the attention router can score this part's MoD layers."""
        check_attention_router(self.adapter, [self.blocks[i] for i in sorted(self.capacities)], self.family)

    def router_for(self, layer_idx: int) -> Router:
        owner = self.root if self.config.share_router else self.blocks[layer_idx]
        return getattr(owner, ROUTER_ATTR)

    @property
    def recording(self) -> bool:
        """Whether every forward keeps something (a trace, or the BCE aux loss)."""
        return self.trace is not None or self.config.aux_loss == "bce"

    def record(
        self, layer_idx: int, sel: Selection, scores: Tensor, layout: TokenLayout, target: Tensor | None = None
    ) -> None:
        """Keep the aux loss and the trace of this layer's forward (by layer, so a checkpoint rerun
        overwrites rather than adds). `target` [B, L] bool: the attention aux loss's top-k (None
        where this forward has none to learn from: evaluation, decode steps, capacity 1.0)."""
        if self.config.aux_loss == "attention" and target is None:
            self.aux_losses.pop(layer_idx, None)  # never add an earlier forward's loss to this one
        if not self.recording and target is None:
            return
        processed = None
        if self.recording:
            if sel.index is None:
                processed = torch.ones(layout.shape, dtype=torch.bool, device=scores.device)
            else:
                processed = sel.processed_mask()
        if self.config.aux_loss == "bce":
            target = processed
        if target is not None:
            weight = layout.routable.float()
            bce = F.binary_cross_entropy_with_logits(scores.float(), target.float(), reduction="none")
            self.aux_losses[layer_idx] = (bce * weight).sum() / weight.sum().clamp_min(1.0)
        if self.trace is not None:
            self.trace.record(self.name, layer_idx, processed, scores.detach(), layout.token_types)


class LayerRouting:
    """Routing state of one converted block; not a module, so it adds no parameter names."""

    def __init__(self, part: MoDPart, layer_idx: int, capacity: float):
        self.part = part
        self.layer_idx = layer_idx
        self.capacity = capacity

    def forward(self, upstream: Callable, args: tuple, kwargs: dict) -> Any:
        """The routing equation in order: keys, select, gather, run, gate, scatter."""
        part, cfg, adapter = self.part, self.part.config, self.part.adapter
        x = adapter.hidden_states(args, kwargs)
        layout = adapter.layout(part, x, args, kwargs)
        if layout.every_token:
            # A decode step: every token runs, so no keys, ranking, gather or scatter. The router
            # runs after the block, right before the gate: after a block's matmuls the caches are
            # cold, and each run of small ops pays that once (a decode step is mostly small ops,
            # and this path runs per MoD layer and token: every call on it counts).
            sel = Selection(index=None, valid=None, length=x.shape[1])
            y = adapter.run(upstream, x, sel, args, kwargs, self.layer_idx)
            out, logits = gated_decode_step(part.router_for(self.layer_idx), x, y, cfg.gate, cfg.gate_alpha)
            if part.recording:
                part.record(self.layer_idx, sel, logits.squeeze(-1), layout)  # logits [B, 1, 1]
            return adapter.output(out, args, kwargs)
        router = part.router_for(self.layer_idx)
        # Training without an aux loss: only the gated (selected) tokens' logits get a gradient,
        # so the ranking logits of every token are computed without one and the gate's are
        # recomputed on the selected tokens: the backward then never touches the skipped tokens,
        # and the layer's full-length input is not kept for the router's weight gradient.
        ranked_only = torch.is_grad_enabled() and cfg.aux_loss is None
        if ranked_only:
            with torch.no_grad():
                logits = router.logits(x)  # [B, L, 1]
        else:
            logits = router.logits(x)
        scores = logits.squeeze(-1)
        keys = self.keys(x, scores, layout, args, kwargs)
        sel = select_tokens(keys, layout, self.capacity)
        if sel.index is not None and sel.index.shape[1] == 0:
            part.record(self.layer_idx, sel, scores, layout)
            return adapter.output(x, args, kwargs)
        x_sel = sel.gather(x)
        gate_logits = router.logits(x_sel) if ranked_only else sel.gather(logits)
        y_sel = adapter.run(upstream, x_sel, sel, args, kwargs, self.layer_idx)
        new = gated_residual(x_sel, y_sel, gate_logits, cfg.gate, cfg.gate_alpha)
        if sel.valid is not None:
            new = torch.where(sel.valid.unsqueeze(-1), new, x_sel)
        out = sel.scatter(x, new)
        part.record(self.layer_idx, sel, scores, layout, self.attention_target(x, layout, args, kwargs))
        return adapter.output(out, args, kwargs)

    def attention_target(self, x: Tensor, layout: TokenLayout, args: tuple, kwargs: dict) -> Tensor | None:
        """The attention aux loss's target when training a learned router: [B, L] bool, the tokens
        the training-free attention router would run at this layer's capacity (query-aware where
        the router alone learns only through its gate); None where there is nothing to learn."""
        cfg = self.part.config
        if cfg.aux_loss != "attention" or cfg.router != "learned" or not torch.is_grad_enabled():
            return None
        if self.every_routable_runs(layout):
            return None
        keys = attention_keys(self.part.adapter, self.part.blocks[self.layer_idx], x, layout, args, kwargs)
        return select_tokens(keys, layout, self.capacity).processed_mask()

    def every_routable_runs(self, layout: TokenLayout) -> bool:
        """Whether this layer's capacity runs every routable token of the batch (nothing to rank)."""
        return self.capacity >= 1.0 or layout.budget(self.capacity).full

    def keys(self, x: Tensor, scores: Tensor, layout: TokenLayout, args: tuple, kwargs: dict) -> Tensor:
        """What top-k ranks at this layer under the part's current router kind."""
        part, kind = self.part, self.part.config.router
        if kind in ATTENTION_ROUTERS:
            if layout.threshold:
                # A decode token receives attention from no later token yet: it always runs.
                return torch.ones_like(scores)
            if self.every_routable_runs(layout):
                return scores  # nothing to rank
            if kind == "fastv" and part.first_keys is not None:
                return part.first_keys  # FastV: ranked once, so what an earlier layer dropped stays dropped
            keys = attention_keys(part.adapter, part.blocks[self.layer_idx], x, layout, args, kwargs)
            if kind == "fastv":
                part.first_keys = keys
            return keys
        generator = part.random_generator(self.layer_idx, x.device) if kind == "random" else None
        return selection_keys(kind, scores, layout, self.capacity, generator)


class MoDLayer:
    """Mixin put in front of an upstream block class by `mod_class`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, LAYER_ATTR).forward(super().forward, args, kwargs)


_MOD_CLASSES: dict[type, type] = {}


def mod_class(block_cls: type) -> type:
    """The MoD subclass of an upstream block class (one per class, created once)."""
    if issubclass(block_cls, MoDLayer):
        return block_cls
    if block_cls not in _MOD_CLASSES:
        _MOD_CLASSES[block_cls] = type(f"MoD{block_cls.__name__}", (MoDLayer, block_cls), {})
    return _MOD_CLASSES[block_cls]


def upstream_class(block_cls: type) -> type:
    """The upstream class a MoD subclass was made from."""
    return next(c for c in block_cls.__mro__[1:] if c is not MoDLayer and not issubclass(c, MoDLayer))
