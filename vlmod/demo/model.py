"""The checkpoint the demo serves: a converted model, its processor, and optionally its dense
counterpart; what /api/health says about it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

import vlmod
from vlmod.demo.layout import side_of
from vlmod.demo.pictures import setting
from vlmod.io.hf import load_vlm, loading_kwargs
from vlmod.tools.compile import maybe_compile


@dataclass
class LoadedModel:
    """A converted checkpoint, its processor, and optionally its dense counterpart."""

    model: nn.Module
    processor: Any
    path: Path | str
    dense: nn.Module | None = None
    dense_path: Path | str | None = None
    warm_up_s: float | None = None  # set by `vlmod.demo.inference.warm_up`: timing is fair only after it

    @property
    def supports_video(self) -> bool:
        return getattr(self.model.config, "video_token_id", None) is not None and hasattr(
            self.processor, "video_processor"
        )

    @property
    def mod_layers(self) -> dict[str, list[int]]:
        """{part: converted layer indices}."""
        layers: dict[str, list[int]] = {}
        for part, layer in vlmod.mod_layers(self.model):
            layers.setdefault(part, []).append(layer)
        return {p: sorted(ls) for p, ls in layers.items()}

    def describe(self) -> dict[str, Any]:
        """What /api/health reports about the model."""
        capacities = {f"{p}:{i}": c for (p, i), c in vlmod.mod_layers(self.model).items()}
        text, vision = self.model.config.text_config, self.model.config.vision_config
        return {
            "name": _name(self.path),
            "architecture": type(self.model).__name__,
            "video": self.supports_video,
            "language_layers": text.num_hidden_layers,
            "vision_layers": tower_depth(vision),
            "mod_layers": self.mod_layers,
            "capacities": capacities,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "dense": None if self.dense_path is None else _name(self.dense_path),
            "input_size": dict(zip(("width", "height"), self.input_size(), strict=True)),
            "patch_size": side_of(vision.patch_size),
            "warm": self.warm_up_s is not None,
        }

    def input_size(self) -> tuple[int, int]:
        """(width, height) in pixels of one picture as the vision tower takes it (a dynamic-resolution
        family, Qwen: the largest square its processor keeps)."""
        vision = self.model.config.vision_config
        side = getattr(vision, "image_size", None)
        if side is None:
            size = getattr(self.processor.image_processor, "size", None) or {}
            unit = side_of(vision.patch_size) * getattr(vision, "spatial_merge_size", 1)
            side = max(unit, math.isqrt(int(setting(size, "longest_edge") or 448 * 448)) // unit * unit)
        return (side_of(side), side_of(side))


def tower_depth(vision_config: Any) -> int:
    """Layers of the vision tower."""
    return getattr(vision_config, "depth", None) or vision_config.num_hidden_layers


def _name(path: Path | str) -> str:
    """A checkpoint's short name: a local folder's name, or a hub id as given."""
    return path.name if isinstance(path, Path) else path


def load_model(
    path: str | Path, dense_path: str | Path | None = None, device: str = "cpu", compile: bool = False  # noqa: A002
) -> LoadedModel:
    """Load a converted checkpoint (and a dense one to compare with: a local directory or a hub
    id, see `vlmod.demo.checkpoints`) for the demo; with `compile`, both decode compiled
    (`vlmod.compile`, or eager with one line saying why not)."""
    if Path(path).expanduser().exists():
        path = Path(path).expanduser()
    loading = loading_kwargs("auto", device)  # the checkpoint's own dtype, straight onto a GPU
    model, processor = load_vlm(path, ValueError, "the demo shows", **loading)
    model = model.to(device).eval()
    if not vlmod.mod_layers(model):
        raise ValueError(
            f"{path} has no MoD layers, so there is no routing to show; convert it first "
            "(vlmod convert --model DIR --out DIR)"
        )
    dense = None
    if dense_path is not None:
        dense = vlmod.load_pretrained(dense_path, **loading).to(device).eval()
        if vlmod.mod_layers(dense):
            vlmod.remove_mod(dense)
    for each in (model, dense):
        if each is not None:
            maybe_compile(each, compile, warn=lambda line: print(f"vlmod demo: {line}", flush=True))
    return LoadedModel(model=model, processor=processor, path=path, dense=dense, dense_path=dense_path)
