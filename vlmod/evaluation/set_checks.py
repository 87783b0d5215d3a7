"""Whether a recipe's question set can measure routing at all (issue 59): four checks, per seed.

A set whose questions a model answers without looking, or with one frame of a clip, rewards a
router for dropping what the question never needed; a set the dense model saturates, or one where
random routing loses nothing, cannot tell a good router from a lucky one. So the recipe checks:

- blind: no model given no vision tokens scores more than chance + 10 points on any type. The
  best such model answers each question text with the answer most frequent for that text in the
  training set (the per-question-text prior; a text the training set lacks gets its type's most
  frequent answer): the question text is all it sees, and no rule on the text alone does better
  on the distribution the training set estimates. Its validation accuracy is the blind ceiling,
  exact without training any model;
- one frame (video): the dense model on clips whose every frame is the middle one scores at most
  chance + 10 on every type that needs several frames (it sees one frame's content in every
  position, so the token count and the prompt are unchanged);
- answer tokens (fine-detail): the dense model with each picture's answer tokens blanked after
  the tower (`answer_blanked_report`) scores at most chance + 10 on every type: the answer rests
  on its own few tokens, so a method that drops them loses it. A tower that spreads each glyph
  over every token fails it (the glyph set over 2 x 2 patches: 82.2% with the answer's 4 tokens
  blanked, as dense, on the first 400; docs/data.md), and no choice of tokens could then
  discriminate;
- dense: at least 85% on every type and 88-97% overall (room above and below);
- discrimination: at 3x fewer language-model prefill FLOPs, random routing loses at least 10
  points against dense and the best training-free method (attention router, pre-LLM reduction,
  frame subsampling) at least 3, each on the questions it answered (the training-free loss is
  asked of one set of the benchmark: each set reports its own, and it alone fails no set).

Values and thresholds are in percent (losses in points). A run too small for a verdict
(`vlmod.evaluation.evidence`: `--quick`) measures them all and passes none.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.data import LlavaDataset, load_records
from vlmod.data.answers import is_correct
from vlmod.evaluation.evidence import answer_options
from vlmod.evaluation.frontier import accuracy_on

MARGIN = 10.0  # points over chance a model without the media (or with one frame) may score
DENSE_TYPE_FLOOR = 85.0
DENSE_OVERALL = (88.0, 97.0)
AT = 3.0  # the LM prefill FLOPs reduction the discrimination check reads
RANDOM_LOSS = 10.0
TRAINING_FREE_LOSS = 3.0
# The training-free methods a user could run instead (`vlmod.recipes.methods`): FastV-like
# attention routing on the dense weights (ranked at every layer; FastV's rule, ranked once, where
# `routers` asks for it), each ranking of pre-LLM reduction (VisionZip-like), token merging
# (ToMe-like), 2 x 2 pooling (images), frames.
TRAINING_FREE = ("attention", "fastv", "reduce", "reduce-mean", "reduce-deviation", "reduce-novelty", "merge", "pool", "frames")


def _qa(path: Path) -> list[tuple[str, str, str]]:
    """(type, question text, answer) of each typed record of a LLaVA-format file."""
    out = []
    for r in load_records(path):
        meta = r.raw.get("meta") if isinstance(r.raw, dict) else None
        if isinstance(meta, dict) and meta.get("type") and len(r.conversations) >= 2:
            out.append((str(meta["type"]), "\n".join(c["value"] for c in r.conversations[:-1]),
                        r.conversations[-1]["value"]))
    return out


def chance(train: Path) -> dict[str, float]:
    """Chance per type in percent: one of the type's answers (what `vlmod.evaluation.evidence`
    calls chance: the shapes, clip and fine-detail sets' answer lists; a type it lacks: the
    distinct training answers)."""
    answers: dict[str, set[str]] = defaultdict(set)
    for t, _, a in _qa(train):
        answers[t].add(a)
    return {t: 100.0 / len(answer_options(t) or a) for t, a in answers.items()}


def blind_ceiling(train: Path, val: Path) -> dict[str, float]:
    """Per type of `val`, in percent: the accuracy of the per-question-text prior of `train` (see
    the module doc), the most any model given no vision tokens can score."""
    by_text: dict[tuple[str, str], Counter] = defaultdict(Counter)
    by_type: dict[str, Counter] = defaultdict(Counter)
    for t, q, a in _qa(train):
        by_text[t, q][a] += 1
        by_type[t][a] += 1
    right: dict[str, list[bool]] = defaultdict(list)
    for t, q, a in _qa(val):
        prior = by_text.get((t, q)) or by_type.get(t)
        right[t].append(bool(prior) and is_correct(prior.most_common(1)[0][0], a))
    return {t: 100.0 * sum(v) / len(v) for t, v in sorted(right.items())}


class OneFrameDataset(LlavaDataset):
    """A `LlavaDataset` whose every clip shows its middle frame in every position: the same
    frame count, tokens and prompt as the clip, one frame's content."""

    def _clip(self, path: Path) -> Any:
        frames = super()._clip(path)
        return frames[[len(frames) // 2] * len(frames)]


def one_frame_report(model: Any, processor: Any, val: Path, frames: int, limit: int | None, batch_size: int,
                     progress: bool = False) -> Any:
    """The dense model's `EvalReport` on the first `limit` clips of `val` with every frame the
    middle one, scored as the recipe scores (its `evaluated`: greedy, 4 new tokens)."""
    from vlmod.evaluation.evaluate import evaluate
    from vlmod.io.hf import max_positions

    data = OneFrameDataset(load_records(val)[:limit], processor, val.parent, num_frames=frames, cache=True,
                           max_tokens=max_positions(model))
    return evaluate(model, processor, data, batch_size=batch_size, max_new_tokens=4, progress=progress,
                    name="dense, one frame", limit=limit)


def _digest(pixels: Tensor) -> bytes:
    return hashlib.blake2b(pixels.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=16).digest()


@contextlib.contextmanager
def blanking_answers(model: nn.Module, answers: Mapping[bytes, Sequence[int]]) -> Any:
    """While inside, each picture whose pixels `answers` knows (by `_digest`) reaches the language
    model with the projected features of its answer patches replaced by the mean of its other
    patches: the same tokens, none holding the answer. A picture it does not know is an error."""
    from vlmod.io.hf import vision_tower

    inner = model.model
    seen: list[Sequence[int]] = []

    def note(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        pixels = args[0] if args else kwargs["pixel_values"]
        digests = [_digest(p) for p in pixels.reshape(-1, *pixels.shape[-3:])]
        if any(d not in answers for d in digests):
            raise ValueError("answer blanking: a picture of the batch is not in the set whose answers were read")
        seen[:] = [answers[d] for d in digests]

    def blank(_module: nn.Module, _args: tuple, out: Tensor) -> Tensor:
        images, patches = out.shape[:2]
        if len(seen) != images:
            raise ValueError(f"answer blanking: {images} projected pictures for {len(seen)} seen by the tower")
        rows = torch.tensor([i for i, at in enumerate(seen) for _ in at], dtype=torch.long)
        cols = torch.tensor([p for at in seen for p in at], dtype=torch.long)
        keep = torch.ones(images, patches, dtype=torch.bool, device=out.device)
        keep[rows.to(out.device), cols.to(out.device)] = False
        weight = keep.unsqueeze(-1).to(out.dtype)
        mean = (out * weight).sum(1, keepdim=True) / weight.sum(1, keepdim=True).clamp_min(1)
        return torch.where(keep.unsqueeze(-1), out, mean.expand_as(out))

    hooks = [vision_tower(model).register_forward_pre_hook(note, with_kwargs=True),
             inner.multi_modal_projector.register_forward_hook(blank)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def answer_blanked_report(model: Any, processor: Any, val: Path, limit: int | None, batch_size: int,
                          progress: bool = False) -> Any:
    """The dense model's `EvalReport` on the first `limit` fine-detail questions of `val`, each
    picture's answer tokens (`meta.answer_patches`) blanked after the tower (`blanking_answers`),
    scored as the recipe scores (greedy, 4 new tokens)."""
    from vlmod.evaluation.evaluate import evaluate
    from vlmod.io.hf import max_positions

    records = load_records(val)[:limit]
    data = LlavaDataset(records, processor, val.parent, cache=True, max_tokens=max_positions(model))
    answers = {_digest(data[i]["pixel_values"].reshape(-1, *data[i]["pixel_values"].shape[-3:])[0]):
               r.raw["meta"]["answer_patches"] for i, r in enumerate(records)}
    with blanking_answers(model, answers):
        return evaluate(model, processor, data, batch_size=batch_size, max_new_tokens=4, progress=progress,
                        name="dense, answer tokens blanked", limit=limit)


def loss_at(rows: Sequence[Mapping[str, Any]], method: str, at: float = AT) -> float | None:
    """Points `method` loses against dense (on its questions) at `at`x fewer LM prefill FLOPs: its
    row at that target, else interpolated in log reduction between its measured points (dense at
    1x); None where it reaches no point that far."""
    dense = next(r for r in rows if r["method"] == "dense")
    mine = [r for r in rows if r["method"] == method and r["target"] is not None]
    if not mine:
        return None
    base = 100 * accuracy_on(dense, mine[0])
    exact = [r for r in mine if r["target"] == at]
    if exact:
        return base - 100 * exact[0]["accuracy"]
    points = sorted([(1.0, base)] + [(r["language_reduction"], 100 * r["accuracy"]) for r in mine])
    for (r0, a0), (r1, a1) in zip(points, points[1:], strict=False):
        if r0 <= at <= r1 and r1 > r0:
            w = (math.log(at) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return base - (a0 + w * (a1 - a0))
    return None


# Where faint pictures or clips (`faint_contrast`) lose their answers: dense by contrast, in these
# bands (the faint ranges: 0.03-0.3 the shapes', 0.05-0.5 the glyphs'), solid (1) on its own.
CONTRAST_BANDS = (0.15, 0.3, 0.5)


def contrast_of(record: Mapping[str, Any]) -> float:
    """A question's picture or clip contrast, from its meta (the fine-detail set's `contrast`, the
    shapes' per object; 1: solid)."""
    meta = record.get("meta") or {}
    if "contrast" in meta:
        return float(meta["contrast"])
    return min((float(o.get("contrast", 1.0)) for o in meta.get("objects") or ()), default=1.0)


def by_contrast(dense: Mapping[str, Any], val: Path) -> dict[str, dict[str, float]] | None:
    """Dense accuracy (percent) and questions per contrast band of `CONTRAST_BANDS` and solid, from
    its row's per-question `correct` (in the validation file's order); None for a set with no faint
    picture or a row that does not cover the file."""
    records = load_records(val)
    correct = dense.get("correct") or ""
    contrasts = [contrast_of(r.raw if isinstance(r.raw, dict) else {}) for r in records]
    if not contrasts or len(correct) != len(records) or min(contrasts) >= 1.0:
        return None
    edges = [0.0, *CONTRAST_BANDS]
    bands: dict[str, list[bool]] = defaultdict(list)
    for k, right in zip(contrasts, correct, strict=True):
        name = "solid" if k >= 1.0 else next((f"{a:g}-{b:g}" for a, b in zip(edges, edges[1:], strict=False) if k < b),
                                             f"{edges[-1]:g}-1")
        bands[name].append(right == "1")
    order = [*(f"{a:g}-{b:g}" for a, b in zip(edges, edges[1:], strict=False)), f"{edges[-1]:g}-1", "solid"]
    return {b: {"accuracy": 100 * sum(bands[b]) / len(bands[b]), "questions": len(bands[b])} for b in order if bands[b]}


def _check(name: str, label: str, value: Any, threshold: Any, rule: str, failed: list[str] | bool | None,
           verdict: bool, **extra: Any) -> dict[str, Any]:
    """One check's record; `failed`: the failing types (or True / False), None when not measured."""
    ok = None if failed is None or not verdict else not failed
    return {"name": name, "label": label, "value": value, "threshold": threshold, "rule": rule, "pass": ok,
            "failed": failed if isinstance(failed, list) else [], **extra}


def set_checks(rows: Sequence[Mapping[str, Any]], train: Path, val: Path, temporal: Sequence[str] = (),
               one_frame: Mapping[str, float] | None = None, one_frame_samples: int = 0, verdict: bool = True,
               at: float = AT, answer_blanked: Mapping[str, float] | None = None,
               answer_blanked_samples: int = 0) -> dict[str, Any]:
    """The checks of the module doc from the recipe's frontier `rows`, its data files, (video) the
    one-frame accuracy by type (fractions, on `one_frame_samples` questions) and (fine-detail) the
    accuracy by type with the answer tokens blanked (on `answer_blanked_samples`). `verdict`: False
    for a run too small to judge (every check measured, none passed)."""
    dense = next(r for r in rows if r["method"] == "dense")
    blind = blind_ceiling(train, val)
    floor = {t: v for t, v in chance(train).items() if t in blind}  # the asked types (not training's captions)
    ceiling = {t: v + MARGIN for t, v in floor.items()}
    checks = [
        _check("chance", "chance (one of the type's answers)", floor, None, "-", [], False),
        _check("blind", "blind ceiling: the best score with no vision tokens", blind, ceiling,
               f"at most chance + {MARGIN:g}", [t for t, v in blind.items() if v > ceiling.get(t, 100.0)], verdict),
    ]
    if one_frame is not None:
        values = {t: 100 * a for t, a in sorted(one_frame.items())}
        limits = {t: ceiling[t] for t in values if t in temporal and t in ceiling}
        checks.append(_check("one_frame", f"one frame: dense, the middle frame in every position (first "
                             f"{one_frame_samples} questions)", values, limits,
                             f"at most chance + {MARGIN:g} on each type marked *",
                             [t for t, lim in limits.items() if values[t] > lim], verdict))
    if answer_blanked is not None:
        values = {t: 100 * a for t, a in sorted(answer_blanked.items())}
        checks.append(_check("answer_tokens", f"answer tokens: dense, the answer's tokens blanked (first "
                             f"{answer_blanked_samples} questions)", values, {t: ceiling[t] for t in values if t in ceiling},
                             f"at most chance + {MARGIN:g}",
                             [t for t, v in values.items() if v > ceiling.get(t, 100.0)], verdict))
    by_type = {t: 100 * a for t, a in sorted(dense["accuracy_by_type"].items())}
    checks.append(_check("dense_types", "dense, each type", by_type, DENSE_TYPE_FLOOR, f"at least {DENSE_TYPE_FLOOR:g}%",
                         [t for t, v in by_type.items() if v < DENSE_TYPE_FLOOR], verdict))
    overall = 100 * dense["accuracy"]
    lo, hi = DENSE_OVERALL
    checks.append(_check("dense_overall", "dense, overall", overall, [lo, hi], f"{lo:g}-{hi:g}%",
                         not lo <= overall <= hi, verdict))
    rand = loss_at(rows, "random", at)
    checks.append(_check("random_loss", f"random routing's loss at {at:g}x fewer LM prefill FLOPs (points)", rand,
                         RANDOM_LOSS, f"at least {RANDOM_LOSS:g} points", None if rand is None else rand < RANDOM_LOSS,
                         verdict))
    losses = {m: v for m in TRAINING_FREE if (v := loss_at(rows, m, at)) is not None}
    best = min(losses, key=losses.__getitem__) if losses else None
    free = losses.get(best) if best else None
    checks.append(_check("training_free_loss", f"the best training-free method's loss at {at:g}x (points)"
                         + (f": {best}" if best else ""), free, TRAINING_FREE_LOSS,
                         f"at least {TRAINING_FREE_LOSS:g} points (on one set of the benchmark)",
                         None if free is None else free < TRAINING_FREE_LOSS, verdict, method=best, losses=losses,
                         scope="benchmark"))
    # The set passes on its own checks; the training-free loss is asked of one set of the benchmark.
    judged = [c["pass"] for c in checks if c["name"] not in ("chance", "training_free_loss")]
    # One failure fails the set; a check not measured (no point that far) leaves it open.
    ok = False if False in judged else None if not verdict or None in judged else True
    out = {"units": "percent (losses in points)", "verdict": verdict, "pass": ok, "checks": checks}
    if (bands := by_contrast(dense, val)) is not None:
        out["dense_by_contrast"] = bands  # not a check: where the dense model's errors are
    return out


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}%"


def format_set_checks(checks: Mapping[str, Any], temporal: Sequence[str] = ()) -> str:
    """results.md's "Set checks" table: a row per check, a column per type (* needs several frames),
    the overall value, the rule and pass / FAIL (failing types named; "-" without a verdict)."""
    rows = checks["checks"]
    types = sorted({t for c in rows if isinstance(c["value"], dict) for t in c["value"]},
                   key=lambda t: (t not in temporal, t))
    headers = ["check", *(f"{t}*" if t in temporal else t for t in types), "overall", "threshold", "pass"]
    lines = ["Set checks (does the set need the media, leave room, and discriminate; `vlmod.evaluation.set_checks`):",
             "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for c in rows:
        v = c["value"]
        if isinstance(v, dict):
            cells = [_pct(v.get(t)) for t in types] + ["-"]
        else:
            cells = ["-"] * len(types) + ["-" if v is None else f"{v:.1f}" + ("" if "loss" in c["name"] else "%")]
        verdict = "-" if c["pass"] is None else "pass" if c["pass"] else "FAIL" + (
            f" ({', '.join(c['failed'])})" if c["failed"] else "")
        if c["pass"] is None and c["name"] != "chance" and v is None:
            verdict = "not measured"
        lines.append("| " + " | ".join([c["label"], *cells, c["rule"], verdict]) + " |")
    if not checks["verdict"]:
        lines += ["", "(a run too small for a verdict: each check measured, none judged)"]
    if checks.get("dense_by_contrast"):
        lines += ["", "Dense by the pictures' contrast (faint ones drawn at under 1): " + ", ".join(
            f"{band} {v['accuracy']:.1f}% ({v['questions']:,})" for band, v in checks["dense_by_contrast"].items())]
    return "\n".join(lines)


def failures(checks: Mapping[str, Any]) -> list[str]:
    """One line per failed check, for the run's log."""
    out = []
    for c in checks["checks"]:
        if c["pass"] is False:
            v = c["value"]
            what = (", ".join(f"{t} {v[t]:.1f}%" for t in c["failed"]) if isinstance(v, dict)
                    else f"{v:.1f}")
            out.append(f"   set check failed: {c['label']}: {what} ({c['rule']})")
    return out


def check_recipe_sets(rows: Sequence[Mapping[str, Any]], train: Path, val: Path, temporal: Sequence[str],
                      one_frame: Callable[[], Any] | None, verdict: bool, log: Callable[[str], None],
                      answer_blanked: Callable[[], Any] | None = None) -> dict[str, Any]:
    """The recipe's hook: the checks (`one_frame()`: the one-frame `EvalReport`, video;
    `answer_blanked()`: the `answer_blanked_report`, fine-detail), each failure logged."""
    report = one_frame() if one_frame is not None else None
    if report is not None:
        log(f"   dense, one frame: accuracy {100 * report.accuracy:.1f}% on {len(report.samples)} questions")
    blanked = answer_blanked() if answer_blanked is not None else None
    if blanked is not None:
        log(f"   dense, answer tokens blanked: accuracy {100 * blanked.accuracy:.1f}% on {len(blanked.samples)} questions")
    checks = set_checks(rows, train, val, temporal, report.accuracy_by_type if report else None,
                        len(report.samples) if report else 0, verdict,
                        answer_blanked=blanked.accuracy_by_type if blanked else None,
                        answer_blanked_samples=len(blanked.samples) if blanked else 0)
    for line in failures(checks):
        log(line)
    return checks


__all__ = ["AT", "DENSE_OVERALL", "DENSE_TYPE_FLOOR", "MARGIN", "RANDOM_LOSS", "TRAINING_FREE", "TRAINING_FREE_LOSS",
           "CONTRAST_BANDS", "OneFrameDataset", "answer_blanked_report", "blanking_answers", "blind_ceiling", "by_contrast",
           "chance", "contrast_of", "check_recipe_sets", "failures", "format_set_checks",
           "loss_at", "one_frame_report", "set_checks"]
