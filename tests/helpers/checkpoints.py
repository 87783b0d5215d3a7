"""Converted checkpoints as several test files save them: a dense tiny checkpoint loaded, converted
and saved with its processor, as `vlmod convert` would leave it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import vlmod


def save_converted(
    dense: Path,
    out: Path,
    language: vlmod.MoDConfig,
    vision: vlmod.MoDConfig | None = None,
    routers: Callable[[torch.nn.Module], None] | None = None,
) -> Path:
    """`dense` converted (the language part, then the vision part when given), its routers set by
    `routers` (zero, as converted, when None), saved with the dense processor to `out`."""
    from transformers import AutoProcessor

    model = vlmod.load_pretrained(dense)
    vlmod.apply_mod(model, language)
    if vision is not None:
        vlmod.apply_mod(model, vision, part="vision")
    if routers is not None:
        routers(model)
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(dense).save_pretrained(out)
    return out


def spread_routers(model: torch.nn.Module) -> None:
    """Every router parameter drawn from N(0, 0.5) under seed 0: converted routers are zero, and
    a test of what routing picks needs routers that rank tokens by content."""
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "router" in name:
            torch.nn.init.normal_(p, std=0.5)
