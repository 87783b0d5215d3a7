"""What a plugin is: a family module that finds a convertible part of a model (`PartSpec`).

Family modules import this, never the package: `vlmod.plugins` imports every family to list
them, so an import of the package from a family would be a circle.
"""

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
    """A family module: listed once in `vlmod.plugins.PLUGINS`."""

    FAMILIES: tuple[str, ...]  # what the error for an unsupported model lists

    def matches(self, model: nn.Module) -> bool: ...

    def part_spec(self, model: nn.Module, part: str | None, config: MoDConfig) -> PartSpec: ...


class ModelPlugin(Plugin, Protocol):
    """A plugin of whole vision-language models (a language part, maybe a vision part), listed in
    `vlmod.plugins.MODEL_PLUGINS`.

    Optional: `OWN_POSITIONS = True` when the model numbers its positions itself from the
    processor's outputs (callers then pass no `position_ids`), and `tower_patches(model, inputs)`
    when its vision tower encodes a variable number of patches per picture."""

    # One name per upstream class or text backbone the plugin converts: the names `vlmod tiny`
    # builds, so the tests run one tiny model of each.
    VARIANTS: tuple[str, ...]

    def _classes(self) -> tuple[type, ...]: ...

