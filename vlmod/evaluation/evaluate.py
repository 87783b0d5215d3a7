"""Accuracy against compute: evaluate a (converted) LLaVA model on LLaVA-format QA data.

Per sample: the greedy answer to the record's last question, scored by normalised exact match
(or, when the reference is an option letter such as "B" or "(B)", by the first option letter of
the answer: `vlmod.data.answers.is_correct`), and the answer loss (teacher-forced mean NLL of the reference answer tokens). Per
model: accuracy (overall and by the record's `meta.type`), the mean fraction of routable tokens
each MoD layer processed, prefill FLOPs per sample against the same model run dense, and
generation latency against the same weights run dense, the two interleaved and a contended figure
flagged (`vlmod.evaluation.latency`). `format_comparison` puts several models side by side.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.data import DataError, LlavaDataset, collate, load_records
from vlmod.data.answers import answer_mask, is_correct
from vlmod.errors import InputError
from vlmod.evaluation.evidence import chance_accuracy, verdict_evidence
from vlmod.evaluation.frontier import paired_gap
from vlmod.evaluation.latency import time_generation
from vlmod.evaluation.tower_reuse import reusing_tower
from vlmod.io.tables import format_table
from vlmod.routing.trace import find_parts, trace_routing
from vlmod.tools.cache import generate_cache
from vlmod.tools.flops import generation_flops


class EvalError(InputError):
    """Evaluation was asked for something that cannot run (missing model or data, not LLaVA)."""


@dataclass
class SampleResult:
    id: str
    prediction: str
    reference: str
    correct: bool
    answer_loss: float
    question_type: str | None = None


@dataclass
class EvalReport:
    """One model on one eval set (see the module doc for each number)."""

    name: str
    accuracy: float
    samples: list[SampleResult]
    answer_loss: float
    accuracy_by_type: dict[str, float] = field(default_factory=dict)
    processed_fraction: dict[str, float] = field(default_factory=dict)
    flops_per_sample: float = 0.0
    dense_flops_per_sample: float = 0.0
    flops_by_part: dict[str, float] = field(default_factory=dict)  # per sample: vision, language
    dense_flops_by_part: dict[str, float] = field(default_factory=dict)
    latency_s: float | None = None  # per sample, `latency` (None: not timed)
    skipped: int = 0
    latency: dict[str, Any] | None = None  # `Latency.to_dict()`: the dense twin, contention, spread

    @property
    def mean_processed_fraction(self) -> float:
        """Mean over MoD layers (1.0 for a dense model)."""
        values = list(self.processed_fraction.values())
        return sum(values) / len(values) if values else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_samples"] = len(self.samples)
        d["mean_processed_fraction"] = self.mean_processed_fraction
        return d


def answer_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token NLL over each row's answer tokens (`answer_mask`) -> [B]."""
    target = labels[:, 1:]
    mask = answer_mask(labels)
    # Only answer positions are upcast: float32 logits of a whole batch are B * L * vocab * 4 bytes
    # (tens of GB for anyres images and a 152k vocabulary).
    nll = F.cross_entropy(logits[:, :-1][mask].float(), target[mask], reduction="none")
    total = torch.zeros(labels.shape[0], dtype=nll.dtype, device=nll.device)
    total.index_add_(0, mask.nonzero()[:, 0], nll)
    return total / mask.sum(1).clamp_min(1)


def routable_counts(trace: Any, parts: Sequence[Any]) -> dict[str, Tensor]:
    """{"part.layer": [routable tokens processed, routable tokens]} of a traced forward, as tensors
    on the model's device: callers sum them over batches and read them once (no host sync here)."""
    out: dict[str, Tensor] = {}
    for part in parts:
        types = trace.part_token_types(part.name)
        routable = torch.tensor([int(t) for t in part.config.routable_types], device=types.device)
        mask = torch.isin(types, routable)
        total = mask.sum()
        for (name, layer), processed in trace.processed.items():
            if name == part.name:
                out[f"{name}.{layer}"] = torch.stack([(processed & mask).sum(), total])
    return out


Generate = Callable[[nn.Module, dict[str, Tensor], int], Tensor]
Flops = Callable[[nn.Module, dict[str, Tensor], Any], dict[str, float]]


def greedy_generate(model: nn.Module, inputs: dict[str, Tensor], max_new_tokens: int) -> Tensor:
    """The new tokens of a greedy `generate` [B, T]."""
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **generate_cache(model, max_new_tokens))
    return out[:, inputs["input_ids"].shape[1]:]


def _dataset(
    data: Any, processor: Any, image_root: str | Path | None, strict: bool, limit: int | None, num_frames: int | None,
    max_tokens: int | None = None,
) -> Any:
    """The dataset to evaluate. From a path with `limit`, only the first `limit` records are read
    and their images checked: a short run on a large set does not decode every image first."""
    if isinstance(data, LlavaDataset):
        return data
    path = Path(data).expanduser()
    if not path.is_file():
        from vlmod.io.paths import not_found

        raise EvalError(f"data file {data} {not_found(path)}")
    try:
        frames: dict[str, Any] = {"max_tokens": max_tokens}
        if num_frames is not None:
            frames["num_frames"] = num_frames
        if limit is None:
            return LlavaDataset(path, processor, image_root, strict=strict, **frames)
        records = load_records(path, image_root)[:limit]
        root = image_root if image_root is not None else path.parent
        return LlavaDataset(records, processor, root, strict=strict, **frames)
    except DataError as e:
        raise EvalError(str(e)) from None


def _encode(ds: Any, records: Sequence[Any], strict: bool) -> tuple[list[Any], list[Any], list[Any], list[str]]:
    """(records, training items, prompts, ids of records whose media failed now). The dataset
    checked the media when it was built; a file that breaks later is skipped the same way, or with
    `strict` is an error."""
    kept, items, prompts, failed = [], [], [], []
    for record in records:
        try:
            item, prompt = ds.eval_inputs(record)
        except DataError as e:  # its media, broken since the set was read
            if strict:
                raise EvalError(str(e)) from None
            failed.append(record.id)
            continue
        kept.append(record)
        items.append(item)
        prompts.append(prompt)
    return kept, items, prompts, failed


def _to(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    processor: Any,
    data: Any,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 16,
    limit: int | None = None,
    progress: bool = True,
    name: str = "model",
    image_root: str | Path | None = None,
    strict: bool = False,
    generate: Generate = greedy_generate,
    num_frames: int | None = None,
    flops_fn: Flops = generation_flops,
    timing_runs: int = 0,
) -> EvalReport:
    """Evaluate `model` on `data` (a LlavaDataset or a LLaVA-format JSON path); see the module doc.

    `generate(model, inputs, max_new_tokens) -> new token ids` is the decoding step (greedy by
    default), replaceable for other decoding or for tests. `num_frames`: frames sampled from each
    video (None: the dataset's default, 8). `flops_fn(model, inputs, prefill trace or None)` counts
    prefill FLOPs per sequence by part; a method that changes the inputs (pre-LLM reduction)
    passes its own, so its overhead and its shorter sequences are what is counted. `timing_runs`:
    interleaved repeats of the latency timing on the first batch's prompts (0: not timed).

    A record whose text is longer than the model's positions is refused before any work."""
    from tqdm.auto import tqdm

    from vlmod.io.hf import max_positions

    ds = _dataset(data, processor, image_root, strict, limit, num_frames, max_positions(model))
    tokenizer = getattr(processor, "tokenizer", processor)
    model.eval()
    device = next(model.parameters()).device
    parts = find_parts(model)
    n = len(ds.records) if limit is None else min(limit, len(ds.records))
    samples: list[SampleResult] = []
    routed: dict[str, Tensor] = {}
    flops = dense_flops = 0.0
    timed: dict[str, Tensor] | None = None  # the first batch's prompts: the latency timing's inputs
    parts_flops: dict[str, float] = defaultdict(float)
    dense_parts_flops: dict[str, float] = defaultdict(float)
    failed: list[str] = []
    bar = tqdm(total=n, desc=f"eval {name}", unit="sample", disable=not progress)
    with reusing_tower(model):  # the teacher-forced pass and the prefill see the same media
        for start in range(0, n, batch_size):
            records, items, prompts, lost = _encode(ds, ds.records[start:min(start + batch_size, n)], strict)
            failed += lost
            bar.update(len(lost))
            if not records:
                continue
            # The answer loss and the routing statistics: one teacher-forced pass.
            batch = _to(ds.collate(items), device)
            if parts:
                with trace_routing(model) as trace:
                    out = model(**batch)
                for key, counts in routable_counts(trace, parts).items():
                    routed[key] = routed[key] + counts if key in routed else counts
            else:
                out = model(**batch)
            losses = answer_losses(out.logits, batch["labels"]).tolist()
            del out, batch
            # Generation from the prompt, timed, and its prefill FLOPs. Prompts are left-padded
            # whatever the tokenizer's padding side: right padding would put pad tokens between a
            # prompt and its answer.
            inputs = _to(collate([p.inputs for p in prompts], ds.pad_token_id, "left"), device)
            timed = inputs if timed is None else timed
            new_tokens, prefill = _generate_traced(model, inputs, max_new_tokens, generate, bool(parts))
            rows = len(records)
            counted, dense_counted = flops_fn(model, inputs, prefill), generation_flops(model, inputs, None)
            flops += counted["total"] * rows
            dense_flops += dense_counted["total"] * rows
            for part in ("vision", "language"):
                parts_flops[part] += counted[part] * rows
                dense_parts_flops[part] += dense_counted[part] * rows
            predictions = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            for record, prompt, prediction, loss in zip(records, prompts, predictions, losses, strict=True):
                meta = record.raw.get("meta") if isinstance(record.raw, dict) else None
                qtype = meta.get("type") if isinstance(meta, dict) else None
                prediction = prediction.strip()
                samples.append(SampleResult(
                    id=record.id, prediction=prediction, reference=prompt.answer,
                    correct=is_correct(prediction, prompt.answer), answer_loss=loss, question_type=qtype,
                ))
            bar.update(rows)
            bar.set_postfix(acc=f"{sum(s.correct for s in samples) / len(samples):.3f}")
    bar.close()
    if not samples:
        raise EvalError(f"no sample to evaluate in {data}")
    latency = time_generation(model, timed, max_new_tokens, timing_runs) if timing_runs > 0 and timed else None
    by_type: dict[str, list[bool]] = defaultdict(list)
    for s in samples:
        if s.question_type is not None:
            by_type[s.question_type].append(s.correct)
    return EvalReport(
        name=name,
        accuracy=sum(s.correct for s in samples) / len(samples),
        samples=samples,
        answer_loss=sum(s.answer_loss for s in samples) / len(samples),
        accuracy_by_type={t: sum(v) / len(v) for t, v in sorted(by_type.items())},
        processed_fraction={k: c[0].item() / c[1].item() for k, c in routed.items() if c[1]},
        flops_per_sample=flops / len(samples),
        dense_flops_per_sample=dense_flops / len(samples),
        flops_by_part={k: v / len(samples) for k, v in parts_flops.items()},
        dense_flops_by_part={k: v / len(samples) for k, v in dense_parts_flops.items()},
        latency_s=latency.seconds if latency else None,
        skipped=len(ds.skipped) + len(failed),
        latency=latency.to_dict() if latency else None,
    )


def _generate_traced(model: nn.Module, inputs: dict[str, Tensor], max_new_tokens: int, generate: Generate,
                     routed: bool) -> tuple[Tensor, Any]:
    """The new tokens and, for a MoD model (`routed`), what each MoD layer processed in the
    prefill, as `generation_flops` reads it: the generation's own first forward, traced, or (a
    `generate` that runs no traced forward) one prefill more."""
    if not routed:
        return generate(model, inputs, max_new_tokens), None
    with trace_routing(model) as trace:
        new_tokens = generate(model, inputs, max_new_tokens)
    if trace.steps:
        return new_tokens, trace.first_step()
    with trace_routing(model) as trace:
        model(**inputs, logits_to_keep=1)
    return new_tokens, trace


def folder_labels(paths: list[str]) -> list[str]:
    """Table labels for checkpoint paths: each folder's name, or as many trailing path parts as
    tell them apart (two `.../model` folders become `dense/model` and `mod/model`)."""
    parts = [Path(p).parts or (p,) for p in paths]
    for depth in range(1, max(len(x) for x in parts) + 1):
        labels = ["/".join(x[-depth:]) for x in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(paths)


def format_comparison(reports: Sequence[EvalReport]) -> str:
    """Models side by side: accuracy (overall, by type), answer loss, compute, latency."""
    types = sorted({t for r in reports for t in r.accuracy_by_type})
    rows = [
        ["accuracy", *(f"{100 * r.accuracy:.1f}%" for r in reports)],
        *([f"  {t}", *(_pct(r.accuracy_by_type.get(t)) for r in reports)] for t in types),
        ["answer loss", *(f"{r.answer_loss:.4f}" for r in reports)],
        ["routable tokens processed", *(f"{100 * r.mean_processed_fraction:.1f}%" for r in reports)],
        ["GFLOPs / sample (prefill)", *(f"{r.flops_per_sample / 1e9:.4g}" for r in reports)],
        ["  vs dense", *(f"{r.flops_per_sample / r.dense_flops_per_sample:.3f}x" if r.dense_flops_per_sample else "-" for r in reports)],
        *_latency_rows(reports),
        ["samples (skipped)", *(f"{len(r.samples)} ({r.skipped})" for r in reports)],
    ]
    table = format_table(["", *(r.name for r in reports)], rows)
    notes = [f"{r.name}: latency contended ({r.latency['reason']}): the figures are unreliable, rerun on a quiet "
             "machine" for r in reports if r.latency and r.latency["contended"]]
    return "\n".join([table, *notes])


def _latency_rows(reports: Sequence[EvalReport]) -> list[list[str]]:
    """Latency per sample, and the same weights run dense, interleaved with it (`vlmod.evaluation.latency`);
    a contended figure is marked so."""
    timed = [r.latency for r in reports]
    if not any(timed):
        return [["latency / sample", *("-" for _ in reports)]]
    tokens = next(t["new_tokens"] for t in timed if t)

    def ms(t: dict[str, Any] | None, key: str) -> str:
        if not t or t[key] is None:
            return "-"
        return f"{1e3 * t[key]:.1f} ms" + (" (contended)" if t["contended"] else "")

    return [
        [f"latency / sample ({tokens} tokens)", *(ms(t, "seconds") for t in timed)],
        ["  same weights dense", *(ms(t, "dense_seconds") for t in timed)],
        ["  speedup over dense", *(f"{t['speedup']:.2f}x" if t and t["speedup"] else "-" for t in timed)],
    ]


def paired_gap_line(a: EvalReport, b: EvalReport) -> str:
    """`a`'s accuracy minus `b`'s with the 95% interval of the paired difference (the two models
    answered the same questions), the figure to read before calling two models equal."""
    marks = [{"correct": "".join("1" if x.correct else "0" for x in r.samples)} for r in (a, b)]
    same = [x.id for x in a.samples] == [x.id for x in b.samples]
    gap = paired_gap(*marks) if same else None
    if gap is None:
        return f"{a.name} minus {b.name}: {100 * (a.accuracy - b.accuracy):+.1f} points (not the same questions: no interval)"
    line = (f"{a.name} minus {b.name}: {gap[0]:+.1f} points, 95% interval {gap[1]:+.1f} to {gap[2]:+.1f} "
            f"(paired, {len(a.samples)} questions)")
    # b is the reference (the dense original): on a toy set the interval alone reads like a verdict.
    evidence = verdict_evidence(b.accuracy, len(b.samples), chance_accuracy(b.accuracy_by_type), who=b.name)
    return line if evidence.enough else f"{line}. {evidence.line()}"


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


# ----------------------------------------------------------------------------- loading


def check_checkpoint(path: str, converted: str | None = None) -> None:
    """`EvalError` unless `path` is a LLaVA checkpoint (and, where option `converted` needs them,
    one with MoD layers); reads only its config, so every model of a comparison is checked before
    the first one loads."""
    from vlmod.io.hf import load_config, vlm_class

    vlm_class(path, EvalError, "evaluation supports")
    if converted and not getattr(load_config(path), "vlmod", None):
        raise EvalError(f"{converted}: {path} has no MoD layers (a dense checkpoint); convert it first or drop {converted}")


def load_model(path: str, device: str = "cpu", dtype: str = "auto") -> tuple[nn.Module, Any]:
    """A LLaVA checkpoint (plain or converted) and its processor, with clear errors; in the
    checkpoint's own dtype unless `dtype` names another, straight onto a GPU `device`."""
    from vlmod.io.hf import load_vlm, loading_kwargs

    model, processor = load_vlm(path, EvalError, "evaluation supports", **loading_kwargs(dtype, device))
    return model.to(device).eval(), processor


__all__ = [
    "EvalError",
    "EvalReport",
    "SampleResult",
    "answer_losses",
    "check_checkpoint",
    "evaluate",
    "format_comparison",
    "greedy_generate",
    "is_correct",
    "load_model",
    "paired_gap_line",
    "routable_counts",
]
