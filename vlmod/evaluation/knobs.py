"""Each method's knob at a compute point: what a user turns to reach a target reduction of
language-model prefill FLOPs (dense / method, e.g. 3x), solved from the analytic counts of
`vlmod.tools.flops` on an eval set's mean token counts (`vlmod.evaluation.frontier` reports the
points):

- MoD (`learned`, and the `random` / `stride` routers on the same weights, and the training-free
  `attention` router on the dense weights): the mean capacity of the converted layers
  (`solve_capacity`);
- pre-LLM reduction (`reduce`, VisionZip-like, `vlmod.tools.reduction`): the fraction of vision tokens
  kept (`solve_keep`);
- frame subsampling (`frames`, video): the number of frames, the nearest whole number (`solve_frames`);
- MoD stacked on pre-LLM reduction (`stacked`): the kept fraction that reaches `share` of the
  reduction (in log terms: `reduction ** share`), then the MoD capacity on the kept tokens that
  reaches the rest (`solve_stacked`; on a reduction whose kept fraction is fixed, `solve_stacked_at`).

Every knob has a floor (one token per MoD layer, one kept token, one frame), so each method has
a largest reduction it can reach (`max_reduction`); a point past it is out of that method's reach
(`reaches`, within `REACH_TOLERANCE`) and is reported as such, not evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlmod.routing.schedule import capacity_to_k, layer_capacities
from vlmod.tools.flops import DecoderDims, attention_router_flops, language_prefill_flops

# A point is within a method's reach if its largest reduction is at least (1 - this) x the target.
REACH_TOLERANCE = 0.03
MIN_FRACTION = 1e-4  # the least capacity / kept fraction tried: one slot (k = ceil(c * n) >= 1)


@dataclass(frozen=True)
class TokenCounts:
    """Mean tokens per sample of an eval set's prompts: text (always run) and vision."""

    text: float
    vision: float
    frames: int = 1  # pictures per sample (video frames)

    @property
    def total(self) -> float:
        return self.text + self.vision


def _bisect(f: Any, lo: float, hi: float, target: float, steps: int = 60, at_most: bool = False) -> float:
    """x in [lo, hi] with f(x) = target for f increasing in x (clamped to the ends); `at_most`:
    the x just under a step of f that jumps over the target (f(x) <= target)."""
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return lo if at_most else hi


def _routed(capacity: float, vision: float) -> float:
    """Vision tokens a MoD layer runs at `capacity`: whole slots (k = ceil(capacity * n), as the
    engine counts them) when every sample has the same `vision` tokens, else the mean's share."""
    return capacity_to_k(capacity, int(vision)) if float(vision).is_integer() else capacity * vision


def _whole_slots(fraction: float, vision: float) -> float:
    """`fraction` as exactly k / n where slots are whole: reads better, and no float noise at the
    edge of a step can round k up."""
    return _routed(fraction, vision) / vision if vision else fraction


def mod_language_flops(dims: DecoderDims, counts: TokenCounts, capacity: float, layers: Sequence[int],
                       schedule: str | None, overhead_per_layer: float = 0.0) -> float:
    """Language prefill FLOPs of MoD at mean `capacity` on `layers`, plus a per-MoD-layer overhead
    (the attention router's scoring)."""
    caps = layer_capacities(capacity, layers, dims.layers, schedule)
    processed = {i: counts.text + _routed(c, counts.vision) for i, c in caps.items()}
    return language_prefill_flops(dims, counts.total, processed) + overhead_per_layer * len(caps)


def solve_capacity(dims: DecoderDims, counts: TokenCounts, reduction: float, layers: Sequence[int],
                   schedule: str | None, overhead_per_layer: float = 0.0) -> float:
    """Mean MoD capacity whose language prefill FLOPs (with its overhead) are at most dense /
    `reduction`: with whole slots, the most slots under the target (so a point never lands above
    its FLOPs because k was rounded up); the smallest capacity tried (1e-4) where the target is out
    of reach."""
    target = language_prefill_flops(dims, counts.total) / reduction
    return _capacity_for(dims, counts, target, layers, schedule, overhead_per_layer)


def _capacity_for(dims: DecoderDims, counts: TokenCounts, target: float, layers: Sequence[int],
                  schedule: str | None, overhead_per_layer: float = 0.0) -> float:
    capacity = _bisect(lambda c: mod_language_flops(dims, counts, c, layers, schedule, overhead_per_layer),
                       MIN_FRACTION, 1.0, target, at_most=True)
    return _whole_slots(capacity, counts.vision) if schedule is None else capacity


def _kept(counts: TokenCounts, keep: float) -> TokenCounts:
    """The token counts after a pre-LLM reduction keeps `keep` of the vision tokens (whole slots)."""
    return TokenCounts(text=counts.text, vision=_routed(keep, counts.vision), frames=counts.frames)


def attention_scoring_flops(dims: DecoderDims, counts: TokenCounts, keep: float = 1.0) -> float:
    """The attention router's scoring FLOPs at one MoD layer (`attention_router_flops`), on the
    tokens a pre-LLM reduction keeping `keep` of the vision tokens leaves."""
    return attention_router_flops(dims, _kept(counts, keep).total, counts.text)


def stacked_language_flops(dims: DecoderDims, counts: TokenCounts, keep: float, capacity: float,
                           layers: Sequence[int], schedule: str | None, attention: bool = False) -> float:
    """Language prefill FLOPs of MoD at mean `capacity` on what a pre-LLM reduction keeping `keep`
    of the vision tokens leaves (the capacity is a share of the kept tokens); `attention`: its
    layers rank by the attention router, whose scoring on the kept tokens counts too (below
    capacity 1.0: at 1.0 every token runs and the router scores nothing, `LayerRouting.keys`)."""
    overhead = attention_scoring_flops(dims, counts, keep) if attention and capacity < 1.0 else 0.0
    return mod_language_flops(dims, _kept(counts, keep), capacity, layers, schedule, overhead)


def solve_stacked(dims: DecoderDims, counts: TokenCounts, reduction: float, layers: Sequence[int],
                  schedule: str | None, share: float = 0.5, attention: bool = False) -> tuple[float, float] | None:
    """(kept fraction, MoD capacity on the kept tokens) of MoD stacked on pre-LLM reduction at
    dense / `reduction` LM FLOPs, or None out of reach. The reduction takes `share` of the
    reduction in log terms (keep for `reduction ** share`, so 0.5 splits it evenly), MoD the rest;
    where MoD cannot reach the rest on what that keeps (its floor: one token per MoD layer, and
    the dense layers on every kept token), the reduction keeps less: the most tokens at which MoD
    at its floor still reaches the point. `attention`: MoD ranks by the attention router, whose
    scoring counts (`stacked_language_flops`)."""
    target = language_prefill_flops(dims, counts.total) / reduction
    keep = solve_keep(dims, counts, reduction ** share)

    def floor(k: float) -> float:
        return stacked_language_flops(dims, counts, k, MIN_FRACTION, layers, schedule, attention)

    if floor(keep) > target:
        keep = _whole_slots(_bisect(floor, MIN_FRACTION, keep, target, at_most=True), counts.vision)
        if not reaches(target * reduction / floor(keep), reduction):
            return None
    return keep, _stacked_capacity(dims, counts, keep, target, layers, schedule, attention)


def solve_stacked_at(dims: DecoderDims, counts: TokenCounts, reduction: float, layers: Sequence[int],
                     schedule: str | None, keep: float, attention: bool = False) -> tuple[float, float] | None:
    """(keep, MoD capacity on the kept tokens) of MoD stacked on a reduction whose kept fraction
    is fixed (pooling keeps every window) at dense / `reduction` LM FLOPs: capacity 1.0 where that
    reduction alone passes the point (it runs past it, at fewer FLOPs), None where MoD at its floor
    cannot reach it. `attention`: as `solve_stacked`."""
    target = language_prefill_flops(dims, counts.total) / reduction
    if reduce_language_flops(dims, counts, keep) <= target:
        return keep, 1.0
    floor = stacked_language_flops(dims, counts, keep, MIN_FRACTION, layers, schedule, attention)
    if not reaches(target * reduction / floor, reduction):
        return None
    return keep, _stacked_capacity(dims, counts, keep, target, layers, schedule, attention)


def _stacked_capacity(dims: DecoderDims, counts: TokenCounts, keep: float, target: float, layers: Sequence[int],
                      schedule: str | None, attention: bool) -> float:
    """MoD's capacity on what a reduction keeping `keep` leaves, for at most `target` LM FLOPs."""
    overhead = attention_scoring_flops(dims, counts, keep) if attention else 0.0
    return _capacity_for(dims, _kept(counts, keep), target, layers, schedule, overhead)


def max_reduction(dims: DecoderDims, counts: TokenCounts, method: str, layers: Sequence[int] = (),
                  schedule: str | None = None, overhead_per_layer: float = 0.0, attention: bool = False) -> float:
    """The largest LM prefill FLOPs reduction `method` can reach, at its knob's floor: MoD one
    token per converted layer ("mod", with `overhead_per_layer` for the attention router), pre-LLM
    reduction one kept token ("reduce"), both ("stacked", `attention`: its MoD layers attention-
    routed), frame subsampling one frame ("frames")."""
    dense = language_prefill_flops(dims, counts.total)
    if method == "mod":
        return dense / mod_language_flops(dims, counts, MIN_FRACTION, layers, schedule, overhead_per_layer)
    if method == "reduce":
        return dense / reduce_language_flops(dims, counts, MIN_FRACTION)
    if method == "stacked":
        return dense / stacked_language_flops(dims, counts, MIN_FRACTION, MIN_FRACTION, layers, schedule, attention)
    if method == "frames":
        return dense / language_prefill_flops(dims, counts.text + counts.vision / counts.frames)
    raise ValueError(f"unknown method {method!r}: mod, reduce, stacked or frames")


def reaches(ceiling: float, reduction: float) -> bool:
    """Whether a method whose largest reduction is `ceiling` reaches the point (`REACH_TOLERANCE`)."""
    return ceiling >= reduction * (1 - REACH_TOLERANCE)


def reduce_language_flops(dims: DecoderDims, counts: TokenCounts, keep: float) -> float:
    """Language prefill FLOPs after a pre-LLM reduction keeps `keep` of the vision tokens."""
    return language_prefill_flops(dims, counts.text + _routed(keep, counts.vision))


def solve_keep(dims: DecoderDims, counts: TokenCounts, reduction: float) -> float:
    """Fraction of vision tokens a pre-LLM reduction keeps for at most dense / `reduction` LM FLOPs
    (it keeps ceil(keep * n) too)."""
    target = language_prefill_flops(dims, counts.total) / reduction
    keep = _bisect(lambda r: reduce_language_flops(dims, counts, r), MIN_FRACTION, 1.0, target, at_most=True)
    return _whole_slots(keep, counts.vision)


def solve_frames(dims: DecoderDims, counts: TokenCounts, reduction: float) -> int:
    """Whole number of frames (of `counts.frames`) nearest to dense / `reduction` LM FLOPs."""
    target = language_prefill_flops(dims, counts.total) / reduction
    per_frame = counts.vision / counts.frames

    def cost(f: int) -> float:
        return abs(language_prefill_flops(dims, counts.text + f * per_frame) - target)

    return min(range(1, counts.frames + 1), key=cost)


__all__ = [
    "MIN_FRACTION",
    "REACH_TOLERANCE",
    "TokenCounts",
    "attention_scoring_flops",
    "max_reduction",
    "mod_language_flops",
    "reaches",
    "reduce_language_flops",
    "solve_capacity",
    "solve_frames",
    "solve_keep",
    "solve_stacked",
    "solve_stacked_at",
    "stacked_language_flops",
]
