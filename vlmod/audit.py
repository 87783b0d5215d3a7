"""Router audit: does the learned router know which tokens matter, or only where they are?

On one eval set and with the weights fixed, the routing of a converted model is swapped at
inference (`vlmod.use_router`) between the learned router and counterfactuals: `inverted` (the
k tokens the learned router likes least), `random` and `stride` (same k, no content), and the
training-free `attention` router. For each router the audit reports

- accuracy and answer loss (`vlmod.eval.evaluate`);
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
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.config import TokenType
from vlmod.errors import InputError
from vlmod.routing.api import set_router
from vlmod.routing.trace import find_parts, trace_routing

AUDIT_ROUTERS = ("learned", "inverted", "random", "stride", "attention")
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


def plot(routing: Mapping[str, Mapping[str, Any]], directory: str | Path) -> list[Path]:
    """PNG plots per part: the Jaccard matrix and compute by position, one panel per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    parts = dict.fromkeys(p for stats in routing.values() for p in stats)
    for part in parts:
        routers = [r for r in routing if part in routing[r]]
        fig, axes = plt.subplots(1, len(routers), figsize=(3.2 * len(routers), 3.2), squeeze=False)
        for ax, router in zip(axes[0], routers, strict=True):
            s = routing[router][part]
            im = ax.imshow(s["jaccard"]["matrix"], vmin=0.0, vmax=1.0, cmap="viridis")
            ticks = range(len(s["layers"]))
            ax.set_xticks(ticks, [str(i) for i in s["layers"]], fontsize=6)
            ax.set_yticks(ticks, [str(i) for i in s["layers"]], fontsize=6)
            ax.set_title(f"{router} (mean {s['jaccard']['mean_off_diagonal'] or 1.0:.2f})", fontsize=8)
            ax.set_xlabel("layer", fontsize=7)
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="Jaccard of processed routable tokens")
        fig.suptitle(f"{part}: cross-layer agreement of processed sets", fontsize=9)
        path = directory / f"jaccard_{part}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

        grid = all("by_grid" in routing[r][part] for r in routers)
        if grid:
            fig, axes = plt.subplots(1, len(routers), figsize=(3.2 * len(routers), 3.2), squeeze=False)
            for ax, router in zip(axes[0], routers, strict=True):
                im = ax.imshow(routing[router][part]["by_grid"]["mean"], vmin=0.0, vmax=1.0, cmap="magma")
                ax.set_title(router, fontsize=8)
                ax.set_xticks([])
                ax.set_yticks([])
            fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="processed fraction (mean over MoD layers)")
        else:
            fig, ax = plt.subplots(figsize=(5.5, 3.2))
            for router in routers:
                pos = routing[router][part].get("by_position")
                if pos is not None:
                    centers = [(b + 0.5) / pos["buckets"] for b in range(pos["buckets"])]
                    ax.plot(centers, pos["mean"], marker="o", markersize=3, label=router)
            ax.set_xlabel("relative position among routable tokens")
            ax.set_ylabel("processed fraction")
            ax.set_ylim(0.0, 1.05)
            ax.legend(fontsize=7)
        fig.suptitle(f"{part}: compute by token position", fontsize=9)
        path = directory / f"position_{part}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


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
    from vlmod.data import LlavaDataset

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
    from vlmod.eval import evaluate

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
            report = evaluate(
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


# ----------------------------------------------------------------------------- command line


class AuditInputError(InputError):
    """Bad input to `vlmod audit`: one `error:` line, exit status 2."""


def add_audit_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `vlmod audit` and `scripts/audit_routing.py`; sets `run=run_audit`."""
    from vlmod.argtypes import add_dtype_argument, device, option, positive_int

    parser.add_argument("--model", required=True, help="converted checkpoint directory (vlmod convert / finetune)")
    parser.add_argument("--data", required=True, help="LLaVA-format eval JSON (e.g. the synthetic set's val.json)")
    parser.add_argument(
        "--routers", default=",".join(AUDIT_ROUTERS),
        help=f"comma list of routers to compare (default: {','.join(AUDIT_ROUTERS)})",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per batch (default: 8)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16, help="answer length (default: 16)")
    option(parser, "--num-samples", aliases=("--limit",), dest="limit", type=positive_int, default=None,
           help="audit the first N samples only (default: all)")
    parser.add_argument(
        "--seed", type=int, default=0,
        help="torch.manual_seed before each router's evaluation and trace: seeds the random router unless "
        "the checkpoint's MoD config sets its own `seed`, which then wins (default: 0)",
    )
    parser.add_argument(
        "--device", type=device, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    add_dtype_argument(parser)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the full report as JSON")
    parser.add_argument("--plots", metavar="DIR", default=None, help="write PNG plots (Jaccard, compute by position)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=run_audit)
    return parser


def format_report(report: Mapping[str, Any]) -> str:
    """The audit as a table plus the verdict."""
    from vlmod.bench import format_table

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


def run_audit(args: argparse.Namespace) -> int:
    """Load, audit, print, write JSON and plots; bad input is one `error:` line and status 2."""
    try:
        return _run_audit(args)
    except InputError as e:  # AuditInputError, and EvalError from vlmod.eval
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_audit(args: argparse.Namespace) -> int:
    import vlmod
    from vlmod.data import DataError
    from vlmod.eval import check_checkpoint
    from vlmod.fileio import write_json
    from vlmod.paths import check_output_dir, check_output_file

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in AUDIT_ROUTERS]
    if unknown or not routers:
        raise AuditInputError(f"--routers: unknown {unknown or routers}; choose from {','.join(AUDIT_ROUTERS)}")
    if not Path(args.model).is_dir():
        raise AuditInputError(f"--model {args.model} is not a directory")
    if not Path(args.data).is_file():
        raise AuditInputError(f"--data {args.data} does not exist")
    for flag, path, check in (("--json", args.json, check_output_file), ("--plots", args.plots, check_output_dir)):
        if path:
            check(path, flag, inputs=[args.model, args.data], error=AuditInputError)
    check_checkpoint(str(args.model))  # EvalError (an InputError) unless a LLaVA checkpoint
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise AuditInputError(f"--device {args.device}: {str(e).splitlines()[0]}") from None
    from vlmod.hf import load_vlm, loading_kwargs

    try:  # one line for a damaged / foreign checkpoint, NaN weights, a malformed vlmod section
        model, processor = load_vlm(
            str(args.model), AuditInputError, "the audit supports", **loading_kwargs(args.dtype, device)
        )
    except (OSError, TypeError) as e:
        raise AuditInputError(f"cannot load {args.model}: {str(e).splitlines()[0]}") from None
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as e:  # no such device / torch built without it
        raise AuditInputError(f"--device {args.device}: {str(e).splitlines()[0]}") from None
    if not vlmod.mod_layers(model):
        raise AuditInputError(f"{args.model} has no MoD layers: convert it first (vlmod convert)")
    try:
        report = audit(
            model, processor, args.data, routers=routers, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, limit=args.limit, seed=args.seed, progress=not args.no_progress,
        )
    except DataError as e:
        raise AuditInputError(str(e)) from None
    report["model"] = str(args.model)
    if args.plots:
        report["plots"] = [str(p) for p in plot(report["routing"], args.plots)]
    print(format_report(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    for path in report.get("plots", []):
        print(f"wrote {path}")
    return 0
