"""How many tokens a MoD layer processes: k per sequence and per-layer capacities."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Absorbs float noise such as 0.1 * 30 = 3.0000000000000004, which would otherwise round up.
_CEIL_EPS = 1e-9


def capacity_to_k(capacity: float, n_routable: int) -> int:
    """k = ceil(capacity * n_routable): at least one slot whenever something is routable."""
    return math.ceil(capacity * n_routable - _CEIL_EPS) if n_routable > 0 else 0


def capacity_to_k_tensor(capacity: float, n_routable: torch.Tensor) -> torch.Tensor:
    """`capacity_to_k` for a batch of routable counts, in exact float64 arithmetic."""
    return torch.ceil(n_routable.to(torch.float64) * capacity - _CEIL_EPS).clamp_min(0).long()


def layer_capacities(
    capacity: float, layers: Sequence[int], num_layers: int, schedule: str | None
) -> dict[int, float]:
    """Capacity of each converted layer.

    With `schedule=None` every layer gets `capacity`. With `"cosine"` (p-MoD's progressive decay
    along a shifted cosine) layer l gets

        w_l   = (1 + cos(pi * (l + 1) / (N + 1))) / 2        # N = layers in the part, 0 < w_l < 1
        c_l   = c_end + (1 - c_end) * w_l                     # if capacity >= mean(w)
        c_l   = capacity * w_l / mean(w)                      # otherwise
        c_end = (capacity - mean(w)) / (1 - mean(w))

    where mean(w) is taken over the converted layers. Deeper layers keep fewer tokens, the
    mean capacity over the converted layers equals `capacity`, and every c_l lies in (0, 1].
    """
    layers = list(layers)
    if schedule is None or len(layers) == 1:
        return {i: capacity for i in layers}
    if schedule != "cosine":
        raise ValueError(f"unknown capacity schedule {schedule!r}; use None or 'cosine'")
    w = {i: (1.0 + math.cos(math.pi * (i + 1) / (num_layers + 1))) / 2.0 for i in layers}
    mean_w = sum(w.values()) / len(w)
    if capacity >= mean_w:
        c_end = (capacity - mean_w) / (1.0 - mean_w)
        caps = {i: c_end + (1.0 - c_end) * w[i] for i in layers}
    else:
        caps = {i: capacity * w[i] / mean_w for i in layers}
    return {i: min(1.0, max(c, 1e-6)) for i, c in caps.items()}
