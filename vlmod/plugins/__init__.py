"""One small adapter per model family: where the blocks are, which tokens are prefix, how the
blocks are called. No routing math lives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from vlmod.config import MoDConfig
from vlmod.routing.layer import BlockAdapter


@dataclass
class PartSpec:
    """A convertible model part as a plugin finds it."""

    name: str  # "vision" or "language"
    family: str
    root: nn.Module  # holds the shared router and the part's state
    entry: nn.Module  # the module whose forward starts a pass over the part
    blocks: nn.ModuleList
    dim: int
    adapter: BlockAdapter
    dense_layers: tuple[int, ...] = ()  # layers that must keep every token


class Plugin(Protocol):
    FAMILIES: tuple[str, ...]

    def matches(self, model: nn.Module) -> bool: ...

    def part_spec(self, model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec: ...


def plugins() -> list[Plugin]:
    from vlmod.plugins import gemma3, hf_vision, internvl, llava, open_clip, qwen_vl, siglip2, timm

    return [llava, qwen_vl, internvl, gemma3, timm, open_clip, hf_vision, siglip2]


def supported_families() -> list[str]:
    return [f for p in plugins() for f in p.FAMILIES]


def find_plugin(model: nn.Module) -> Plugin:
    for plugin in plugins():
        if plugin.matches(model):
            return plugin
    raise TypeError(
        f"vlmod cannot convert a {type(model).__module__}.{type(model).__name__}; supported "
        f"families: {', '.join(supported_families())}"
    )
