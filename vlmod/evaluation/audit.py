"""Router audit: does the learned router know which tokens matter, or only where they are?

On one eval set and with the weights fixed, the routing of a converted model is swapped at
inference (`vlmod.use_router`) between the learned router and counterfactuals: `inverted` (the
k tokens the learned router likes least), `random` and `stride` (same k, no content), and the
training-free `attention` router. For each router the audit reports

- accuracy and answer loss (`vlmod.evaluation.evaluate.evaluate`);
- the cross-layer agreement of processed sets: a layer x layer Jaccard matrix over routable
  tokens, averaged over samples. Values near 1 mean the same tokens run every MoD layer (MoD is
  then token pruning / an early exit in disguise); independent choices at capacity c give about
  c / (2 - c). Also the share of routable tokens that no MoD layer, or every MoD layer, ran;
- compute by token position (processed fraction per bucket of the position among the row's
  routable tokens, and per cell of the image grid when every image has the same square token
  count) and by token type;

plus PNG plots of the Jaccard matrices and of compute by position, and a short written verdict:
how much of the learned router's advantage over random and stride remains, and how much of it
the attention router recovers without training.

Routing statistics come from teacher-forced forwards (prompt + answer, the answer tokens typed
`response`), which route image tokens exactly as the prefill of `generate` does: the learned
router scores each token from its own causal state, and the attention router's queries are the
instruction tokens only.

The statistics live in `vlmod.evaluation.audit_stats`, the plots in `vlmod.evaluation.audit_plots`;
this module runs the audit and writes its verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.api import set_router
from vlmod.data import LlavaDataset
from vlmod.evaluation import evaluate as evaluation
from vlmod.evaluation.audit_plots import plot
from vlmod.evaluation.audit_stats import independent_jaccard, jaccard_matrix, routing_stats
from vlmod.evaluation.evidence import chance_accuracy, verdict_evidence
from vlmod.io.tables import format_table
from vlmod.routing.trace import find_parts

AUDIT_ROUTERS = ("learned", "inverted", "random", "stride", "attention")


def _accuracy_noise(a: float, b: float, n: int) -> float:
    """Two binomial standard errors of a difference of two accuracies on n samples."""
    if n <= 0:
        return float("nan")
    return 2.0 * math.sqrt(max(a * (1 - a) + b * (1 - b), 1e-12) / n)


def verdict(
    results: Mapping[str, Mapping[str, Any]], routing: Mapping[str, Mapping[str, Any]], untrained: bool = False
) -> dict[str, Any]:
    """Gaps of the learned router to its counterfactuals and a sentence that says what they mean.

    results: {router: {"accuracy", "answer_loss", "samples"}}; routing: {router: {part: stats}};
    untrained: the learned routers are still all zero (a fresh conversion).
    """
    out: dict[str, Any] = {"gaps": {}, "untrained_router": untrained}
    learned = results.get("learned")
    lines = []
    if untrained:
        lines.append(
            "the learned router is untrained (all-zero weights): its scores tie and it keeps the first k "
            "tokens, so 'learned' is a positional rule here"
        )
    if learned is not None:
        n = int(learned.get("num_samples") or 0)
        judged = len(lines)  # the comparisons below carry verdicts: only on a model that learned the task
        evidence = verdict_evidence(learned["accuracy"], n, chance_accuracy(learned.get("accuracy_by_type") or {}),
                                    who="the audited model")
        for other in ("random", "stride", "inverted", "attention"):
            if other not in results:
                continue
            r = results[other]
            gap = {
                "accuracy": learned["accuracy"] - r["accuracy"],
                "answer_loss": r["answer_loss"] - learned["answer_loss"],
                "noise_2se": _accuracy_noise(learned["accuracy"], r["accuracy"], n),
            }
            out["gaps"][other] = gap
        for other in ("random", "stride"):
            gap = out["gaps"].get(other)
            if gap is None:
                continue
            noisy = abs(gap["accuracy"]) <= gap["noise_2se"]
            if noisy:
                sign = f"not distinguishable from {other} routing by accuracy on {n} samples"
            else:
                sign = f"{'better' if gap['accuracy'] > 0 else 'worse'} than {other} routing"
            lines.append(
                f"learned vs {other}: {100 * gap['accuracy']:+.1f} accuracy points{' (within noise)' if noisy else ''}, "
                f"answer loss {-gap['answer_loss']:+.3f}; the learned router is {sign}"
            )
        base = out["gaps"].get("random")
        att = results.get("attention")
        if base is not None and att is not None:
            if base["accuracy"] > base["noise_2se"]:
                share = (att["accuracy"] - results["random"]["accuracy"]) / base["accuracy"]
                out["attention_recovers"] = share
                lines.append(
                    f"the training-free attention router recovers {100 * share:.0f}% of the learned router's "
                    "accuracy advantage over random"
                )
            else:
                lines.append(
                    f"the attention router scores {100 * att['accuracy']:.1f}% accuracy (learned "
                    f"{100 * learned['accuracy']:.1f}%); with no learned advantage over random beyond noise "
                    "there is no share to recover"
                )
        inv = out["gaps"].get("inverted")
        if inv is not None:
            hurts = inv["accuracy"] > inv["noise_2se"]
            lines.append(
                f"inverted routing is {100 * inv['accuracy']:+.1f} accuracy points and {-inv['answer_loss']:+.3f} "
                "answer loss away from learned: "
                + ("the learned ranking carries information" if hurts
                   else "the learned ranking is not shown to matter on this set")
            )
        if not evidence.enough:  # the gaps stay in the JSON; the words would mean nothing
            del lines[judged:]
            lines.append(evidence.line().rstrip("."))
            out["evidence"] = evidence.why_not
    lang = routing.get("learned", {}).get("language") or next(iter(routing.get("learned", {}).values()), None)
    if lang is not None and lang["jaccard"]["mean_off_diagonal"] is not None:
        j, j0 = lang["jaccard"]["mean_off_diagonal"], lang["jaccard"]["independent_baseline"]
        if j > 0.9:
            kind = "the same tokens run every MoD layer: MoD acts as token pruning (an early exit in disguise)"
        elif j > j0 + 0.5 * (1 - j0):
            kind = "processed sets overlap strongly across layers, closer to pruning than to per-layer routing"
        else:
            kind = "layers choose largely different tokens: routing is per layer, not an early exit"
        lines.append(f"cross-layer Jaccard of the learned router {j:.2f} (independent choices: {j0:.2f}): {kind}")
    out["text"] = "; ".join(lines) + ("." if lines else "")
    return out


def untrained_routers(model: nn.Module) -> bool:
    """Whether every learned router of the model is still all zero (converted, never trained)."""
    params = [p for name, p in model.named_parameters() if "mod_router" in name]
    return bool(params) and all(not p.detach().any() for p in params)


def _set_parts(model: nn.Module, kind: str, original: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """Parts switched to `kind`, and {part: why not} for those that cannot use it; those go back
    to their own router kind `original[part]`, not whatever an earlier audit router left there."""
    done, refused = [], {}
    for p in find_parts(model):
        try:
            set_router(model, kind, part=p.name)
            done.append(p.name)
        except ValueError as err:
            refused[p.name] = str(err)
            set_router(model, original[p.name], part=p.name)
    return done, refused


def trace_batches(processor: Any, data: str | Path, batch_size: int, limit: int | None) -> list[dict[str, Tensor]]:
    """Teacher-forced batches (prompt + answer, answer-only labels) of the first `limit` records."""
    dataset = LlavaDataset(data, processor)
    n = len(dataset) if limit is None else min(limit, len(dataset))
    return [dataset.collate([dataset[j] for j in range(i, min(i + batch_size, n))]) for i in range(0, n, batch_size)]


def audit(
    model: nn.Module,
    processor: Any,
    data: str | Path,
    routers: Sequence[str] = AUDIT_ROUTERS,
    batch_size: int = 8,
    max_new_tokens: int = 16,
    limit: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate and trace a converted model under each router kind, weights fixed (module doc).

    Returns a JSON-ready dict: `results` {router: EvalReport.to_dict()}, `routing` {router: {part:
    statistics}}, `skipped` {router: reason}, `verdict` {gaps, text}. The model's own router
    kinds are restored afterwards. A router a part cannot use (attention in a tower without a
    CLS token) is applied to the other parts only and says so in `partial`.
    """
    parts = find_parts(model)
    if not parts:
        raise ValueError("the model has no MoD layers: audit a converted model (vlmod convert / apply_mod)")
    unknown = [r for r in routers if r not in AUDIT_ROUTERS]
    if unknown:
        raise ValueError(f"unknown router(s) {unknown}; choose from {AUDIT_ROUTERS}")
    original = {p.name: p.config.router for p in parts}
    batches = trace_batches(processor, data, batch_size, limit)
    results: dict[str, Any] = {}
    routing: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    partial: dict[str, dict[str, str]] = {}
    try:
        for router in routers:
            done, refused = _set_parts(model, router, original)
            if not done:
                skipped[router] = "; ".join(refused.values())
                continue
            if refused:
                partial[router] = refused
            torch.manual_seed(seed)
            report = evaluation.evaluate(
                model, processor, data, batch_size=batch_size, max_new_tokens=max_new_tokens, limit=limit,
                progress=progress, name=router,
            )
            results[router] = report.to_dict()
            torch.manual_seed(seed)
            routing[router] = routing_stats(model, batches)
    finally:
        for name, kind in original.items():
            set_router(model, kind, part=name)
    return {
        "data": str(data),
        "routers": list(results),
        "parts": {p.name: {"layers": sorted(p.capacities), "capacities": {str(i): c for i, c in sorted(p.capacities.items())},
                           "router": original[p.name]} for p in parts},
        "results": results,
        "routing": routing,
        "skipped": skipped,
        "partial": partial,
        "verdict": verdict(results, routing, untrained=untrained_routers(model)),
    }


def format_report(report: Mapping[str, Any]) -> str:
    """The audit as a table plus the verdict."""
    rows = []
    for router, r in report["results"].items():
        stats = report["routing"].get(router, {})
        lang = stats.get("language") or next(iter(stats.values()), None)
        jac = lang["jaccard"]["mean_off_diagonal"] if lang else None
        rows.append([
            router,
            f"{100 * r['accuracy']:.1f}",
            f"{r['answer_loss']:.4f}",
            "-" if jac is None else f"{jac:.2f}",
            "-" if lang is None else f"{100 * lang['never_processed']:.1f}",
        ])
    lines = [format_table(["router", "accuracy %", "answer loss", "layer Jaccard", "never run %"], rows)]
    for router, why in report["skipped"].items():
        lines.append(f"skipped {router}: {why}")
    for router, parts in report["partial"].items():
        lines.append(f"{router}: kept the model's own router in part(s) {', '.join(parts)} ({next(iter(parts.values()))})")
    lines.append(f"verdict: {report['verdict']['text']}")
    return "\n".join(lines)


__all__ = [
    "AUDIT_ROUTERS", "audit", "format_report", "independent_jaccard", "jaccard_matrix", "plot", "routing_stats",
    "trace_batches", "untrained_routers", "verdict",
]
