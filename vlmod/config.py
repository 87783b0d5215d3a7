"""MoD settings and token types: the public contract of DESIGN.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum
from typing import Any

from vlmod.errors import brief


class TokenType(IntEnum):
    """What a token is; decides whether it may be skipped at a MoD layer."""

    PADDING = 0
    PREFIX = 1
    INSTRUCTION = 2
    RESPONSE = 3
    IMAGE = 4
    VIDEO = 5

    @classmethod
    def parse(cls, name: str | int | TokenType) -> TokenType:
        if isinstance(name, TokenType):
            return name
        if isinstance(name, int):
            return cls(name)
        try:
            return cls[str(name).upper()]
        except KeyError:
            valid = ", ".join(t.name.lower() for t in cls)
            raise ValueError(f"unknown token type {brief(name)}; valid types: {valid}") from None


# The names `--dtype` (and `dtype:` of a config) accept: "auto" keeps the checkpoint's own dtype,
# as transformers 5 loads it; the others cast while loading.
DTYPES = ("auto", "float32", "bfloat16", "float16")
ROUTERS = ("learned", "random", "stride", "inverted", "attention", "fastv")
ATTENTION_ROUTERS = ("attention", "fastv")  # the kinds that rank by the layer's attention
GATES = ("tanh", "sigmoid", "none")
CAPACITY_SCHEDULES = (None, "cosine")
AUX_LOSSES = (None, "bce", "attention")
LAYER_PRESETS = ("all", "every_other")


@dataclass
class MoDConfig:
    """How a model part is converted to Mixture-of-Depths.

    capacity: fraction of routable tokens that run a MoD layer (0 < c <= 1); with a capacity
        schedule it is the mean over the converted layers.
    layers: "all", "every_other" (1, 3, 5, ...: the first layer stays dense) or layer indices.
    routable: token types that compete for the k slots; every other real token always runs.
    router: "learned" (a zero-initialised linear router); for audits and training-free use,
        "random" (same k, uniform), "stride" (an evenly spaced positional pattern of the same
        density), "inverted" (the k lowest learned scores) and "attention" (training-free: the
        routable tokens that receive the most attention from the instruction / prefix tokens at
        the layer about to run, see `vlmod.routing.attention`) and "fastv" (FastV's rule: the
        first MoD layer of each forward ranks by that attention once, every later one runs the
        top-k of the same ranking, so a token dropped there stays dropped). The gate always uses the learned
        router, which is g = 1 until trained, so "attention" needs no fine-tuning. Change the kind
        of a converted model with `vlmod.set_router` / `vlmod.use_router`.
    share_router: one router for all MoD layers of the part, instead of one per layer.
    gate: "tanh": g(r) = 1 + gate_alpha * tanh(r); "sigmoid": g(r) = 2 * sigmoid(r);
        "none": g = 1 (the router then learns only through the aux loss). The first two are 1
        for a zero router, so a fresh conversion at capacity 1.0 is the original model.
    capacity_schedule: None (every layer gets `capacity`) or "cosine" (see
        `vlmod.routing.schedule.layer_capacities`).
    aux_loss: None, "bce": binary cross-entropy of the router logit against top-k membership,
        which makes `sigmoid(r) > 0.5` a causal routing decision (MoD paper, sec. 3.5); or
        "attention": against the tokens the "attention" router would run at the layer, so a
        learned router (which sees one token at a time, and learns from its gate alone) is taught
        which tokens the text asks about, then routes without it (training only; needs a model
        whose blocks the attention router supports).
    aux_loss_weight: weight of the aux loss when a LLaVA model adds it to its language-model loss.
    seed: seed of the "random" router, reset at each forward (None: torch's global generator).
    """

    capacity: float = 0.5
    layers: str | Sequence[int] = "every_other"
    routable: tuple[str, ...] = ("image", "video")
    router: str = "learned"
    share_router: bool = True
    gate: str = "tanh"
    gate_alpha: float = 0.2
    capacity_schedule: str | None = None
    aux_loss: str | None = None
    aux_loss_weight: float = 0.01
    seed: int | None = field(default=None)

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, (int, float)):
            raise ValueError(f"capacity must be a number in (0, 1], got {brief(self.capacity)}")
        if not (0.0 < float(self.capacity) <= 1.0) or math.isnan(self.capacity):
            raise ValueError(
                f"capacity must be in (0, 1] (the fraction of routable tokens a MoD layer "
                f"processes), got {self.capacity}"
            )
        self.capacity = float(self.capacity)
        if isinstance(self.layers, str):
            if self.layers not in LAYER_PRESETS:
                raise ValueError(
                    f"layers must be one of {LAYER_PRESETS} or a list of layer indices, "
                    f"got {brief(self.layers)}"
                )
        else:
            layers = list(self.layers)
            if not layers:
                raise ValueError("layers is empty: name at least one layer to convert")
            if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
                raise ValueError(f"layer indices must be integers, got {brief(layers)}")
            if len(set(layers)) != len(layers):
                raise ValueError(f"layer indices repeat: {brief(layers)}")
            self.layers = sorted(layers)
        if isinstance(self.routable, str):
            self.routable = (self.routable,)
        parsed = tuple(TokenType.parse(t) for t in self.routable)
        if TokenType.PADDING in parsed:
            raise ValueError("padding cannot be routable: it never counts toward k")
        self.routable = tuple(t.name.lower() for t in parsed)
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {brief(self.router)}")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {brief(self.gate)}")
        if self.capacity_schedule not in CAPACITY_SCHEDULES:
            raise ValueError(
                f"capacity_schedule must be one of {CAPACITY_SCHEDULES}, got {brief(self.capacity_schedule)}"
            )
        if self.aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss must be one of {AUX_LOSSES}, got {brief(self.aux_loss)}")
        if not isinstance(self.share_router, bool):
            raise ValueError(f"share_router must be true or false, got {brief(self.share_router)}")
        for name in ("gate_alpha", "aux_loss_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {brief(value)}")
            setattr(self, name, float(value))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {brief(self.seed)}")

    @property
    def routable_types(self) -> tuple[TokenType, ...]:
        return tuple(TokenType.parse(t) for t in self.routable)

    def resolve_layers(self, num_layers: int) -> list[int]:
        """The converted layer indices of a part with `num_layers` layers (negatives count from the end)."""
        if self.layers == "all":
            return list(range(num_layers))
        if self.layers == "every_other":
            layers = list(range(1, num_layers, 2))
            if not layers:
                raise ValueError(
                    f"layers='every_other' converts nothing in a part with {num_layers} layer(s)"
                )
            return layers
        resolved = []
        for i in self.layers:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise ValueError(
                    f"layer index {i} is out of range: this part has {num_layers} layers "
                    f"(valid: 0..{num_layers - 1})"
                )
            resolved.append(j)
        if len(set(resolved)) != len(resolved):
            raise ValueError(f"layer indices name the same layer twice: {list(self.layers)!r}")
        return sorted(resolved)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["routable"] = list(self.routable)
        if not isinstance(self.layers, str):
            d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoDConfig:
        if not isinstance(d, dict):
            raise ValueError(f"MoD settings must be a mapping of MoDConfig fields, got {type(d).__name__} {d!r:.60}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown MoDConfig fields: {sorted(unknown)}")
        d = dict(d)
        if "routable" in d:
            d["routable"] = tuple(d["routable"])
        return cls(**d)
