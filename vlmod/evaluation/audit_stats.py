"""The routing statistics of the router audit (`vlmod.evaluation.audit`), per model part and router:
the cross-layer Jaccard agreement of processed routable tokens, the share no MoD layer (or every
one) ran, and compute by token position (relative position, and the image grid when every image
has the same square token count) and by token type, accumulated over traced forwards."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.config import TokenType
from vlmod.routing.trace import find_parts, trace_routing

POSITION_BUCKETS = 16
MAX_GRID = 32  # side of the largest position grid kept (a 24 x 24 LLaVA-1.5 image fits)


def jaccard_matrix(processed: Sequence[Tensor], routable: Tensor) -> tuple[Tensor, int]:
    """Mean Jaccard index of the processed routable sets of every pair of layers.

    processed: one BoolTensor [B, L] per layer; routable: BoolTensor [B, L]. Returns the [n, n]
    matrix (float64, averaged over the rows that have a routable token) and that row count.
    """
    if not processed:
        return torch.zeros(0, 0, dtype=torch.float64), 0
    rows = routable.any(1)
    p = torch.stack([m & routable for m in processed]).double()[:, rows]  # [n, B', L]
    inter = torch.einsum("ibl,jbl->ijb", p, p)
    size = p.sum(2)  # [n, B']
    union = size[:, None, :] + size[None, :, :] - inter
    jac = torch.where(union > 0, inter / union.clamp_min(1.0), torch.ones_like(inter))
    count = int(rows.sum())
    return (jac.mean(2) if count else torch.zeros_like(jac[..., 0])), count


def independent_jaccard(capacity: float) -> float:
    """Expected Jaccard index of two independent uniform choices of a fraction c: c / (2 - c)."""
    return capacity / (2.0 - capacity)


def routable_rank(routable: Tensor) -> tuple[Tensor, Tensor]:
    """(rank [B, L] of each routable token among its row's routable tokens, count [B])."""
    return routable.long().cumsum(1) - 1, routable.sum(1)


@dataclass
class PartStats:
    """Routing statistics of one model part under one router, accumulated over batches."""

    layers: list[int]
    capacities: dict[int, float]
    routable_types: tuple[str, ...]
    jaccard_sum: Tensor | None = None
    samples: int = 0
    never: float = 0.0  # routable tokens no MoD layer ran
    always: float = 0.0  # routable tokens every MoD layer ran
    routable_tokens: float = 0.0
    bucket_processed: Tensor | None = None  # [n_layers, buckets]
    bucket_count: Tensor | None = None  # [buckets]
    grid_side: int | None = None  # None: not yet known; 0: images differ, no grid
    grid_processed: Tensor | None = None  # [n_layers, side * side]
    grid_count: Tensor | None = None
    type_processed: dict[str, Tensor] = field(default_factory=dict)  # [n_layers] per type
    type_count: dict[str, float] = field(default_factory=dict)

    def add(self, processed: Mapping[int, Tensor], types: Tensor) -> None:
        """One traced forward: {layer: processed [B, L]} and the token types [B, L]."""
        masks = [processed[i].cpu() for i in self.layers]
        types = types.cpu()
        ids = torch.tensor([int(TokenType.parse(t)) for t in self.routable_types])
        routable = torch.isin(types, ids)
        jac, rows = jaccard_matrix(masks, routable)
        if rows:
            self.jaccard_sum = jac * rows if self.jaccard_sum is None else self.jaccard_sum + jac * rows
            self.samples += rows
        stack = torch.stack(masks)  # [n, B, L]
        runs = (stack & routable).sum(0)
        self.never += float(((runs == 0) & routable).sum())
        self.always += float(((runs == len(masks)) & routable).sum())
        self.routable_tokens += float(routable.sum())
        self._add_positions(stack, routable)
        for t in TokenType:
            is_t = types == int(t)
            if t is TokenType.PADDING or not is_t.any():
                continue
            name = t.name.lower()
            done = (stack & is_t).sum((1, 2)).double()
            self.type_processed[name] = self.type_processed.get(name, torch.zeros(len(masks), dtype=torch.float64)) + done
            self.type_count[name] = self.type_count.get(name, 0.0) + float(is_t.sum())

    def _add_positions(self, stack: Tensor, routable: Tensor) -> None:
        n_layers = stack.shape[0]
        rank, count = routable_rank(routable)
        rel = rank.double() / count.clamp_min(1)[:, None].double()
        bucket = (rel * POSITION_BUCKETS).long().clamp(0, POSITION_BUCKETS - 1)
        bucket = torch.where(routable, bucket, POSITION_BUCKETS)  # a discard bucket
        if self.bucket_processed is None:
            self.bucket_processed = torch.zeros(n_layers, POSITION_BUCKETS, dtype=torch.float64)
            self.bucket_count = torch.zeros(POSITION_BUCKETS, dtype=torch.float64)
        flat = bucket.flatten()
        self.bucket_count += torch.bincount(flat, minlength=POSITION_BUCKETS + 1)[:POSITION_BUCKETS].double()
        for i in range(n_layers):
            hit = torch.bincount(flat, weights=stack[i].flatten().double(), minlength=POSITION_BUCKETS + 1)
            self.bucket_processed[i] += hit[:POSITION_BUCKETS]
        counts = set(count[count > 0].tolist())
        side = math.isqrt(next(iter(counts))) if len(counts) == 1 else 0
        if side * side != (next(iter(counts)) if counts else -1) or side > MAX_GRID:
            side = 0
        if self.grid_side is None:
            self.grid_side = side
        if side != self.grid_side or side == 0:
            self.grid_side, self.grid_processed, self.grid_count = 0, None, None
            return
        cells = side * side
        cell = torch.where(routable, rank, cells).flatten()
        if self.grid_processed is None:
            self.grid_processed = torch.zeros(n_layers, cells, dtype=torch.float64)
            self.grid_count = torch.zeros(cells, dtype=torch.float64)
        self.grid_count += torch.bincount(cell, minlength=cells + 1)[:cells].double()
        for i in range(n_layers):
            self.grid_processed[i] += torch.bincount(cell, weights=stack[i].flatten().double(), minlength=cells + 1)[:cells]

    def to_dict(self) -> dict[str, Any]:
        n = len(self.layers)
        jac = self.jaccard_sum / max(self.samples, 1) if self.jaccard_sum is not None else torch.zeros(n, n)
        off = jac[~torch.eye(n, dtype=torch.bool)] if n > 1 else torch.zeros(0)
        mean_capacity = sum(self.capacities.values()) / max(len(self.capacities), 1)
        out: dict[str, Any] = {
            "layers": self.layers,
            "samples": self.samples,
            "jaccard": {
                "matrix": jac.tolist(),
                "mean_off_diagonal": float(off.mean()) if off.numel() else None,
                "adjacent": [float(jac[i, i + 1]) for i in range(n - 1)],
                "independent_baseline": independent_jaccard(mean_capacity),
            },
            "never_processed": self.never / max(self.routable_tokens, 1.0),
            "always_processed": self.always / max(self.routable_tokens, 1.0),
            "independent_never_processed": math.prod(1.0 - c for c in self.capacities.values()),
        }
        if self.bucket_processed is not None:
            per_layer = self.bucket_processed / self.bucket_count.clamp_min(1.0)
            out["by_position"] = {
                "buckets": POSITION_BUCKETS,
                "what": "processed fraction per bucket of the position among the row's routable tokens",
                "mean": per_layer.mean(0).tolist(),
                "per_layer": {str(i): row.tolist() for i, row in zip(self.layers, per_layer, strict=True)},
            }
        if self.grid_side and self.grid_processed is not None:
            per_layer = self.grid_processed / self.grid_count.clamp_min(1.0)
            side = self.grid_side
            out["by_grid"] = {
                "side": side,
                "what": "processed fraction per cell of the image token grid (row-major)",
                "mean": per_layer.mean(0).view(side, side).tolist(),
            }
        out["by_type"] = {
            name: {
                "tokens": int(self.type_count[name]),
                "mean": float((self.type_processed[name] / self.type_count[name]).mean()),
                "per_layer": {
                    str(i): float(v) for i, v in zip(self.layers, self.type_processed[name] / self.type_count[name], strict=True)
                },
            }
            for name in self.type_processed
        }
        return out


def _row_major_grid(model: nn.Module, part: str) -> bool:
    """Whether the routable tokens of a part are one image's patches in row-major order: a ViT
    tower (per image or tile), or plain LLaVA's language part (anyres models add tiles and newline
    tokens, video models frames and pooling, so only relative positions are reported there)."""
    return part == "vision" or type(model).__name__ == "LlavaForConditionalGeneration"


def routing_stats(model: nn.Module, batches: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{part: statistics} of the model's current routing over `batches` (model inputs)."""
    parts = {p.name: p for p in find_parts(model)}
    stats = {
        name: PartStats(
            layers=sorted(p.capacities), capacities=dict(p.capacities), routable_types=p.config.routable,
            grid_side=None if _row_major_grid(model, name) else 0,
        )
        for name, p in parts.items()
    }
    device = next(model.parameters()).device
    for batch in batches:
        inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        with torch.no_grad(), trace_routing(model) as trace:
            model(**inputs)
        by_part: dict[str, dict[int, Tensor]] = {}
        for (part, layer), mask in trace.processed.items():
            by_part.setdefault(part, {})[layer] = mask
        for part, masks in by_part.items():
            stats[part].add(masks, trace.part_token_types(part))
    return {name: s.to_dict() for name, s in stats.items() if s.samples}


__all__ = [
    "MAX_GRID", "POSITION_BUCKETS", "PartStats", "independent_jaccard", "jaccard_matrix", "routable_rank",
    "routing_stats",
]
