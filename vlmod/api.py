"""apply_mod / remove_mod / mod_layers / router_aux_loss / set_router / use_router."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from vlmod.config import ATTENTION_ROUTERS, ROUTERS, MoDConfig
from vlmod.plugins import find_plugin
from vlmod.routing.attention import check_attention_router
from vlmod.routing.layer import (
    LAYER_ATTR,
    PART_ATTR,
    ROUTER_ATTR,
    LayerRouting,
    MoDPart,
    mod_class,
    upstream_class,
)
from vlmod.routing.router import Router
from vlmod.routing.schedule import layer_capacities
from vlmod.routing.trace import find_parts


def _new_router(dim: int, like: nn.Module) -> Router:
    param = next(like.parameters(), None)
    return Router(dim, device=None if param is None else param.device, dtype=None if param is None else param.dtype)


def apply_mod(model: nn.Module, config: MoDConfig, part: str | None = None) -> nn.Module:
    """Convert the chosen layers of one model part to MoD, in place; returns `model`.

    `part` is "language" or "vision" for LLaVA models (default "language") and "vision" (the
    default) for image encoders.
    """
    if not isinstance(config, MoDConfig):
        raise TypeError(f"config must be a vlmod.MoDConfig, got {type(config).__name__}")
    spec = find_plugin(model).part_spec(model, part, config)
    if PART_ATTR in spec.root.__dict__:
        existing = spec.root.__dict__[PART_ATTR]
        raise ValueError(
            f"the {existing.name} part of this model is already converted "
            f"(layers {sorted(existing.capacities)}); call vlmod.remove_mod(model) first"
        )
    num_layers = len(spec.blocks)
    layers = config.resolve_layers(num_layers)
    if isinstance(config.layers, str):
        layers = [i for i in layers if i not in spec.dense_layers]
    elif forced := sorted(set(layers) & set(spec.dense_layers)):
        raise ValueError(
            f"{spec.family} {spec.name} layer(s) {forced} must stay dense: transformers sizes the "
            "causal mask and positions of every layer from layer 0's KV cache"
        )
    if not layers:
        raise ValueError(f"layers={config.layers!r} leaves no layer to convert in this {spec.name} part")
    if config.router in ATTENTION_ROUTERS or config.aux_loss == "attention":
        check_attention_router(spec.adapter, [spec.blocks[i] for i in layers], spec.family)
    capacities = layer_capacities(config.capacity, layers, num_layers, config.capacity_schedule)
    part_obj = MoDPart(
        name=spec.name,
        config=config,
        root=spec.root,
        blocks=spec.blocks,
        adapter=spec.adapter,
        capacities=capacities,
        family=spec.family,
    )
    if config.share_router:
        setattr(spec.root, ROUTER_ATTR, _new_router(spec.dim, spec.blocks[layers[0]]))
    for i in layers:
        block = spec.blocks[i]
        if not config.share_router:
            setattr(block, ROUTER_ATTR, _new_router(spec.dim, block))
        block.__class__ = mod_class(type(block))
        setattr(block, LAYER_ATTR, LayerRouting(part_obj, i, capacities[i]))
    spec.root.__dict__[PART_ATTR] = part_obj
    # Bound methods, not closures: a deepcopy of the model then gets hooks of its own part.
    part_obj.hooks.append(spec.entry.register_forward_pre_hook(part_obj.pre_hook, with_kwargs=True))
    part_obj.hooks.append(spec.entry.register_forward_hook(part_obj.post_hook))
    install = getattr(spec.adapter, "install", None)
    if install is not None:
        install()
    _store_settings(model)
    return model


def _store_settings(model: nn.Module) -> None:
    """Keep the MoD settings in a Hugging Face config (saved under `vlmod` in config.json)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return
    parts = {
        p.name: {**p.config.to_dict(), "layers": sorted(p.capacities)}
        for p in find_parts(model)
    }
    if parts:
        config.vlmod = parts
    elif hasattr(config, "vlmod"):
        del config.vlmod


def remove_mod(model: nn.Module) -> nn.Module:
    """Give every converted block its original class back and drop the routers; in place."""
    for part in find_parts(model):
        for i in part.capacities:
            block = part.blocks[i]
            block.__class__ = upstream_class(type(block))
            block.__dict__.pop(LAYER_ATTR, None)
            if ROUTER_ATTR in block._modules:
                delattr(block, ROUTER_ATTR)
        if ROUTER_ATTR in part.root._modules:
            delattr(part.root, ROUTER_ATTR)
        for hook in part.hooks:
            hook.remove()
        uninstall = getattr(part.adapter, "uninstall", None)
        if uninstall is not None:
            uninstall()
        del part.root.__dict__[PART_ATTR]
    _store_settings(model)
    return model


def mod_layers(model: nn.Module) -> dict[tuple[str, int], float]:
    """{(part, layer_idx): capacity} of the converted layers."""
    return {(p.name, i): c for p in find_parts(model) for i, c in sorted(p.capacities.items())}


def router_aux_loss(model: nn.Module) -> Tensor | None:
    """The router aux loss of the last forward (mean over MoD layers), or None if not configured."""
    losses = [loss for p in find_parts(model) if p.config.aux_loss for loss in p.aux_losses.values()]
    return torch.stack(losses).mean() if losses else None


def _parts_named(model: nn.Module, part: str | None) -> list[MoDPart]:
    parts = find_parts(model)
    if not parts:
        raise ValueError("this model has no MoD layers; convert it with vlmod.apply_mod first")
    if part is None:
        return parts
    chosen = [p for p in parts if p.name == part]
    if not chosen:
        raise ValueError(f"no converted {part!r} part; converted parts: {sorted(p.name for p in parts)}")
    return chosen


def set_router(model: nn.Module, kind: str, part: str | None = None) -> nn.Module:
    """Rank tokens with router `kind` from the next forward on, in every converted part (or in
    `part`); in place, returns `model`.

    Only the selection changes: weights, the learned router and its gate stay as they are, which
    is what counterfactual audits (learned vs random / stride / inverted / attention on the same
    weights) and training-free use need. The kind is saved with the model's MoD settings.
    """
    if kind not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {kind!r}")
    parts = _parts_named(model, part)
    if kind in ATTENTION_ROUTERS:
        for p in parts:
            p.check_attention_router()
    for p in parts:
        # A new config object: the caller's MoDConfig (maybe shared with other models) is untouched.
        p.config = dataclasses.replace(p.config, router=kind)
    _store_settings(model)
    return model


def set_capacity(model: nn.Module, capacity: float, part: str | None = None) -> nn.Module:
    """Run every converted part (or `part`) at mean capacity `capacity` from the next forward on;
    in place, returns `model`.

    The per-layer capacities follow the part's own schedule (`capacity_schedule`), exactly as
    `apply_mod` would have set them; weights and routers are untouched. One set of weights then
    serves several compute points (evaluate a frontier, or train with a capacity drawn per step).
    The new capacity is saved with the model's MoD settings.
    """
    parts = _parts_named(model, part)
    checked = MoDConfig(capacity=capacity).capacity  # the config's own validation and message
    for p in parts:
        num_layers = len(p.blocks)
        caps = layer_capacities(checked, sorted(p.capacities), num_layers, p.config.capacity_schedule)
        for i, c in caps.items():
            getattr(p.blocks[i], LAYER_ATTR).capacity = c
        p.capacities = caps
        p.config = dataclasses.replace(p.config, capacity=checked)
    _store_settings(model)
    return model


@contextmanager
def use_router(model: nn.Module, kind: str, part: str | None = None) -> Iterator[nn.Module]:
    """`set_router` for the duration of a `with` block; the previous kinds come back after it."""
    previous = {id(p): p.config.router for p in _parts_named(model, part)}
    set_router(model, kind, part)
    try:
        yield model
    finally:
        for p in _parts_named(model, part):
            if id(p) in previous:
                p.config = dataclasses.replace(p.config, router=previous[id(p)])
        _store_settings(model)
