"""The recipe's compute points: for each target reduction of language-model prefill FLOPs, each
method's knob (`vlmod.evaluation.knobs` solves them), and which methods cannot reach it.

Every knob has a floor (one token per MoD layer, one kept token, one frame), so each method has a
largest reduction (`ceilings`); a point past a method's (within `knobs.REACH_TOLERANCE`) gets
no knob for it, and the recipe reports it as out of reach instead of evaluating a point that
lands elsewhere. Layer 0 stays dense (the engine's rule: transformers sizes every layer's causal
mask and positions from layer 0's KV cache), and the text always runs, so MoD alone stops short:
with 8 layers at about 5x on the video recipe's prompts and 4x on the image recipe's; MoD stacked
on pre-LLM reduction goes further, since the reduction shrinks layer 0's tokens too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlmod.errors import InputError
from vlmod.evaluation import frontier, knobs
from vlmod.evaluation.knobs import TokenCounts
from vlmod.tools.flops import DecoderDims, language_prefill_flops

# The baseline row of each ranking of the pre-LLM reduction (`vlmod.tools.reduction.SCORINGS`):
# one knob (the kept fraction), so one reach.
REDUCTION_METHODS = {"cls": "reduce", "mean": "reduce-mean", "deviation": "reduce-deviation",
                     "novelty": "reduce-novelty"}


# The pooled baseline (`pool`): each image's tokens averaged 2 x 2 (LLaVA-OneVision's pooling), then
# ranked by the features' deviation where the point asks for fewer than a quarter.
POOL = 2


def pooled_baseline(s: Any) -> bool:
    """Whether a recipe of settings `s` runs the pooled baseline: on pictures (the video model
    pools its frames already), where the patch grid's side divides by `POOL`."""
    return s.task != "video" and (s.image_size // s.patch_size) % POOL == 0


def reduction_methods(video: bool) -> dict[str, str]:
    """The rankings a recipe runs as baselines: novelty only on clips (on images it is deviation)."""
    return {k: v for k, v in REDUCTION_METHODS.items() if video or k != "novelty"}


def ours(mod_router: str) -> tuple[str, str]:
    """The method keys of our two rows (MoD alone, stacked) when the MoD stages train `mod_router`."""
    return frontier.OURS_BY_ROUTER[mod_router]


def fastv_scoring(scoring: float, layers: Sequence[int]) -> float:
    """FastV's rule's scoring FLOPs as a share per MoD layer: it scores once a forward, at the first
    MoD layer, where the attention router scores `scoring` at each."""
    return scoring / len(layers)


def ceilings(dims: DecoderDims, counts: TokenCounts, layers: Sequence[int], schedule: str | None,
             scoring: float, video: bool, stacked: bool, others: TokenCounts | None = None,
             mod_router: str = "learned", pooled: bool = False, stack_pool: int = 1,
             fastv: bool = False) -> dict[str, float]:
    """Each method's largest LM prefill FLOPs reduction (`scoring`: the attention router's FLOPs
    per MoD layer): MoD's and the stack's on `counts`, the other methods' on `others` (the prompts
    they answer). The random and stride routers on the MoD weights reach as far as a learned router.
    `pooled`: the pooled baseline runs; `stack_pool` > 1: the stack keeps every pooled window;
    `fastv`: FastV's rule runs (its scoring once a forward, not once a layer)."""
    others = others or counts
    mod = knobs.max_reduction(dims, counts, "mod", layers, schedule)
    attention = mod_router == "attention"
    alone, stack = ours(mod_router)
    out = {"random": mod, "stride": mod,
           "attention": knobs.max_reduction(dims, others, "mod", layers, schedule, scoring)}
    if fastv:
        out["fastv"] = knobs.max_reduction(dims, others, "mod", layers, schedule, fastv_scoring(scoring, layers))
    out[alone] = knobs.max_reduction(dims, counts, "mod", layers, schedule, scoring if attention else 0.0)
    out.update(dict.fromkeys([*reduction_methods(video).values(), "merge"], knobs.max_reduction(dims, others, "reduce")))
    if pooled:  # pooled, then ranked: as far as the reduction's one kept token
        out["pool"] = out["reduce"]
    if stacked and stack_pool > 1:  # MoD at its floor on every window
        out[stack] = language_prefill_flops(dims, counts.total) / knobs.stacked_language_flops(
            dims, counts, 1.0 / stack_pool**2, knobs.MIN_FRACTION, layers, schedule, attention)
    elif stacked:
        out[stack] = knobs.max_reduction(dims, counts, "stacked", layers, schedule, attention=attention)
    if video:
        out["frames"] = knobs.max_reduction(dims, others, "frames")
    return out


def solve_points(dims: DecoderDims, counts: TokenCounts, s: Any, layers: Sequence[int], scoring: float,
                 others: TokenCounts | None = None) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """(compute points, ceilings): per target, each method's knob (None where out of reach) and
    the reduction the analytic count predicts for it (`predicted`). MoD's capacity and the stack's
    knobs are solved on `counts` (the prompts our methods answer: every one), the other methods'
    on `others` (the first `baseline_samples`). `capacity`: a learned router's (the random and
    stride routers share it); with `s.mod_router` attention, `mod_capacity` is ours (its scoring
    counted), else the same."""
    video, attention = s.task == "video", s.mod_router == "attention"
    alone, stack = ours(s.mod_router)
    pooled = pooled_baseline(s)
    fastv = "fastv" in s.routers
    reach = ceilings(dims, counts, layers, s.schedule, scoring, video, s.stacked, others, s.mod_router, pooled,
                     s.stack_pool, fastv)
    mod_counts, counts = counts, others or counts
    mod_dense, dense = language_prefill_flops(dims, mod_counts.total), language_prefill_flops(dims, counts.total)
    points = []
    for t in s.targets:
        ok = {m: knobs.reaches(c, t) for m, c in reach.items()}
        p: dict[str, Any] = {"target": t, "capacity": None, "mod_capacity": None, "attention_capacity": None,
                             "keep": None, "predicted": {}, "out_of_reach": sorted(m for m, yes in ok.items() if not yes)}
        if ok["random"]:
            p["capacity"] = knobs.solve_capacity(dims, mod_counts, t, layers, s.schedule)
        if ok[alone]:
            overhead = scoring if attention else 0.0
            p["mod_capacity"] = knobs.solve_capacity(dims, mod_counts, t, layers, s.schedule, overhead)
            p["predicted"][alone] = mod_dense / knobs.mod_language_flops(dims, mod_counts, p["mod_capacity"], layers,
                                                                             s.schedule, overhead)
        if ok["attention"]:
            p["attention_capacity"] = knobs.solve_capacity(dims, counts, t, layers, s.schedule, scoring)
            p["predicted"]["attention"] = dense / knobs.mod_language_flops(
                dims, counts, p["attention_capacity"], layers, s.schedule, scoring)
        if fastv:
            once = fastv_scoring(scoring, layers)
            p["fastv_capacity"] = knobs.solve_capacity(dims, counts, t, layers, s.schedule, once) if ok["fastv"] else None
            if ok["fastv"]:
                p["predicted"]["fastv"] = dense / knobs.mod_language_flops(
                    dims, counts, p["fastv_capacity"], layers, s.schedule, once)
        if ok["reduce"]:
            p["keep"] = knobs.solve_keep(dims, counts, t)
            p["predicted"]["reduce"] = dense / knobs.reduce_language_flops(dims, counts, p["keep"])
        if pooled and ok["pool"]:  # every window where the point asks for more: past the point, as pooling goes
            p["pool_keep"] = min(p["keep"], 1.0 / POOL**2)
            p["predicted"]["pool"] = dense / knobs.reduce_language_flops(dims, counts, p["pool_keep"])
        if s.stacked:
            solved = _solve_stack(dims, mod_counts, t, layers, s, s.share_at(t)) if ok[stack] else None
            p["stack_keep"], p["stack_capacity"] = solved or (None, None)
            if solved is None and stack not in p["out_of_reach"]:
                p["out_of_reach"].append(stack)
            if solved is not None:
                p["predicted"][stack] = mod_dense / knobs.stacked_language_flops(dims, mod_counts, *solved,
                                                                                   layers, s.schedule, attention)
        if video:
            p["frames"] = knobs.solve_frames(dims, counts, t) if ok["frames"] else None
            if p["frames"] is not None:
                p["predicted"]["frames"] = dense / language_prefill_flops(
                    dims, counts.text + p["frames"] * counts.vision / counts.frames)
        points.append(p)
    return points, reach


def _solve_stack(dims: DecoderDims, counts: TokenCounts, target: float, layers: Sequence[int], s: Any,
                 share: float) -> tuple[float, float] | None:
    """The stack's (keep, capacity) at `target`: on every pooled window (`s.stack_pool` > 1), else
    the reduction taking `share` of the point."""
    attention = s.mod_router == "attention"
    if s.stack_pool > 1:
        return knobs.solve_stacked_at(dims, counts, target, layers, s.schedule, 1.0 / s.stack_pool**2, attention)
    return knobs.solve_stacked(dims, counts, target, layers, s.schedule, share, attention)


def stack_training_points(dims: DecoderDims, counts: TokenCounts, s: Any, layers: Sequence[int],
                          points: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(keep, capacity) the stacked stage trains at, each once, for `points`: their own, or solved
    at the training split where `stack_train_share` differs from the split they run at (a pooled
    stack has no split: its own). Points the pooling alone passes share one draw (capacity 1.0)."""
    draws = []
    for p in points:
        t, share = p["target"], s.share_at(p["target"], training=True)
        if share == s.share_at(t) or s.stack_pool > 1:
            draws.append((p["stack_keep"], p["stack_capacity"]))
            continue
        solved = _solve_stack(dims, counts, t, layers, s, share)
        if solved is None:
            raise InputError(f"stack_train_share {share:g} cannot reach the stacked point at {t:g}x: give a share "
                             "that reaches it, or none (train where it runs)")
        draws.append(solved)
    return list(dict.fromkeys(draws))


def reachable(point: dict[str, Any], method: str) -> bool:
    return method not in point["out_of_reach"]


def describe_points(points: Sequence[dict[str, Any]]) -> list[str]:
    """One readable line per compute point, each method's knob (what the recipe's log shows; the
    whole record is in results.json): "/3: MoD capacity 0.242, attention router 0.180, ..."."""
    def knob(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = []
    for p in points:
        parts = [f"MoD capacity {knob(p['capacity'])}", f"attention router {knob(p['attention_capacity'])}",
                 f"reduction keeps {knob(p['keep'])}"]
        if p.get("mod_capacity", p["capacity"]) != p["capacity"]:  # ours attention-routed (`mod_router`): its own capacity
            parts.insert(1, f"ours (attention-routed MoD) {knob(p.get('mod_capacity'))}")
        if "fastv_capacity" in p:
            parts.insert(2, f"FastV's rule {knob(p['fastv_capacity'])}")
        if p.get("pool_keep") is not None:
            parts.append(f"pooled keeps {knob(p['pool_keep'])}")
        if p.get("stack_keep") is not None:
            parts.append(f"stacked keeps {knob(p['stack_keep'])} then capacity {knob(p.get('stack_capacity'))}")
        if "frames" in p:
            parts.append(f"frames {'-' if p['frames'] is None else p['frames']}")
        line = f"/{p['target']:g}: " + ", ".join(parts)
        if p["out_of_reach"]:
            line += f"; out of reach: {', '.join(p['out_of_reach'])}"
        lines.append(line)
    return lines


__all__ = ["POOL", "REDUCTION_METHODS", "ceilings", "describe_points", "fastv_scoring", "ours", "pooled_baseline", "reachable",
           "reduction_methods", "solve_points", "stack_training_points"]
