"""One small adapter per model family: where the blocks are, which tokens are prefix, how the
blocks are called. No routing math lives here.

`PLUGINS` is the one list of families: conversion, `vlmod convert` and the tests' family matrix
all read it. A new family is a module here (see `vlmod.plugins.base`) and one entry below.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vlmod.plugins import gemma3, hf_vision, internvl, llava, open_clip, qwen_vl, siglip2, timm
from vlmod.plugins.base import ModelPlugin, PartSpec, Plugin

# Whole vision-language models, then image encoders: the order `find_plugin` tries them in and
# its error lists them in.
MODEL_PLUGINS: tuple[ModelPlugin, ...] = (llava, qwen_vl, internvl, gemma3)
ENCODER_PLUGINS: tuple[Plugin, ...] = (timm, open_clip, hf_vision, siglip2)
PLUGINS: tuple[Plugin, ...] = MODEL_PLUGINS + ENCODER_PLUGINS


def plugins() -> list[Plugin]:
    return list(PLUGINS)


def supported_families() -> list[str]:
    return [f for p in PLUGINS for f in p.FAMILIES]


def find_plugin(model: nn.Module) -> Plugin:
    for plugin in PLUGINS:
        if plugin.matches(model):
            return plugin
    raise TypeError(
        f"vlmod cannot convert a {type(model).__module__}.{type(model).__name__}; supported "
        f"families: {', '.join(supported_families())}"
    )


# -- whole vision-language models: what the commands (convert, rank, eval, demo) ask of a family --


def vlm_plugins() -> list[ModelPlugin]:
    """The plugins of whole vision-language models (a language part, maybe a vision part)."""
    return list(MODEL_PLUGINS)


def vlm_classes() -> tuple[type, ...]:
    """Every top-level model class `vlmod convert` accepts."""
    return tuple(cls for plugin in MODEL_PLUGINS for cls in plugin._classes())


def vlm_families() -> list[str]:
    return [f for plugin in MODEL_PLUGINS for f in plugin.FAMILIES]


def vlm_variants() -> list[str]:
    """Every variant of every whole-model plugin (`ModelPlugin.VARIANTS`), in registry order."""
    return [v for plugin in MODEL_PLUGINS for v in plugin.VARIANTS]


def vlm_plugin(model: nn.Module) -> ModelPlugin | None:
    """The plugin module of a whole vision-language model, or None (an encoder, another model)."""
    return next((p for p in MODEL_PLUGINS if p.matches(model)), None)


def own_positions(model: nn.Module) -> bool:
    """True when the model numbers its positions itself from the processor's outputs (Qwen's
    multimodal RoPE): a caller must not pass `position_ids` then, not even for left padding."""
    return bool(getattr(vlm_plugin(model), "OWN_POSITIONS", False))


def tower_patches(model: nn.Module, inputs: dict[str, Any]) -> list[int] | None:
    """Patches of every picture a packed vision tower encodes for `inputs` (Qwen: from the
    processor's grids), or None where every picture is the tower's fixed patch grid."""
    count = getattr(vlm_plugin(model), "tower_patches", None)
    return None if count is None else count(model, inputs)


__all__ = [
    "ENCODER_PLUGINS",
    "MODEL_PLUGINS",
    "PLUGINS",
    "ModelPlugin",
    "PartSpec",
    "Plugin",
    "find_plugin",
    "own_positions",
    "plugins",
    "supported_families",
    "tower_patches",
    "vlm_classes",
    "vlm_families",
    "vlm_plugin",
    "vlm_plugins",
    "vlm_variants",
]
