"""What a recipe rerun may keep from an earlier run in the same folder (`--reuse-dense`,
`--reuse-trained`): a stage's model is kept only if its record says it was trained with the
settings asked for now, so a reused stage always gives the numbers a fresh run would."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from vlmod.errors import InputError

CONTROL_STAGES = ("train dense control", "eval dense control")  # opt-in: left out of the recipe's own time
# The settings the first dense model depends on, and (`refine_steps` > 0) the refined one too.
DENSE_SETTINGS = (
    "task", "num_train", "image_size", "frames", "video_pool", "distractors", "captions", "width", "layers", "heads", "kv_heads",
    "vision_width", "vision_layers", "patch_size", "tower_steps", "dense_steps", "dense_lr", "weight_decay", "batch_size", "seed",
    "image_steps", "num_train_images", "image_batch_size", "image_model",
)
REFINE_SETTINGS = ("refine_steps",)
DENSE_RUN, REFINED_RUN = "dense", "dense-refined"
# Each training stage of a recipe and the run folder it trains into.
TRAINING_RUNS = {"train on images": "image", "train dense": DENSE_RUN, "refine dense": REFINED_RUN,
                 "train MoD": "mod", "train stacked": "stack", CONTROL_STAGES[0]: "dense-control"}
_RUN_PATHS = ("model", "data", "output_dir", "distill_from", "overwrite", "resume")  # follow from --out


def changed_settings(saved: dict[str, Any], now: Any, keys: Any) -> list[str]:
    """The `keys` of dataclass `now` whose value differs from the `saved` record's (a key the
    record lacks, added since that run, counts as its default)."""
    defaults = {f.name: f.default for f in fields(now)}
    return [k for k in keys if saved.get(k, defaults.get(k)) != getattr(now, k)]


def _finished(out: Path, run: str) -> dict[str, Any] | None:
    record = out / run / "recipe.json"
    if not (out / run / "model" / "model.safetensors").is_file() or not record.is_file():
        return None
    return json.loads(record.read_text())


def reusable_dense(out: Path, s: Any) -> dict[str, float]:
    """The stage times of an earlier run's (first) dense model in `out`, if trained with these settings."""
    before = _finished(out, DENSE_RUN)
    if before is None:
        raise InputError(f"--reuse-dense: {out} holds no finished dense stage (dense/model and dense/recipe.json)")
    changed = changed_settings(before["settings"], s, DENSE_SETTINGS)
    if changed:
        raise InputError(f"--reuse-dense: the dense model in {out} was trained with other {', '.join(changed)}")
    return before["stage_seconds"]


def reusable_refined(out: Path, s: Any) -> dict[str, float] | None:
    """The stage times of an earlier run's refined dense model in `out` if it was refined with
    these settings, else None (it is refined again from the kept first model)."""
    before = _finished(out, REFINED_RUN)
    if before is None or changed_settings(before["settings"], s, DENSE_SETTINGS + REFINE_SETTINGS):
        return None
    return before["stage_seconds"]


def dense_model_dir(out: Path) -> Path:
    """The dense model that a finished run in `out` ranked, converted and compared against: the
    refined one where its settings refined it (`refine_steps`), else the first."""
    results = out / "results.json"
    refined = results.is_file() and json.loads(results.read_text())["settings"].get("refine_steps", 0)
    return out / (REFINED_RUN if refined else DENSE_RUN) / "model"


def _run_of(path: str | None) -> str | None:
    """The recipe folder a path names: `dense` for OUT/dense/model, `converted` for OUT/converted."""
    if path is None:
        return None
    p = Path(path)
    return p.parent.name if p.name == "model" else p.name


def reusable_finetune(out: Path, cfg: Any) -> tuple[Path, float]:
    """(model, training seconds) of an earlier run's fine-tune into `cfg.output_dir`, if it was
    trained with these settings (`--reuse-trained`): the recipe then only evaluates again. A stage
    the earlier results do not time (trained by its config YAML, or added to the recipe since)
    counts its steps' time from its log."""
    run = Path(cfg.output_dir)
    log, results = run / "train_log.json", out / "results.json"
    if not (run / "model" / "model.safetensors").is_file() or not log.is_file() or not results.is_file():
        raise InputError(f"--reuse-trained: {out} holds no finished {run.name} stage and results.json; "
                         "run the recipe without it once")
    saved = json.loads(log.read_text())["config"]
    changed = changed_settings(saved, cfg, [f.name for f in fields(cfg) if f.name not in _RUN_PATHS])
    # Paths follow --out (the folder may have moved), but which run they name must not change:
    # a fine-tune from the first dense model is no use once the recipe starts from the refined one.
    changed += [k for k in ("model", "distill_from") if _run_of(saved.get(k)) != _run_of(getattr(cfg, k))]
    if changed:
        raise InputError(f"--reuse-trained: the {run.name} stage in {out} was trained with other {', '.join(changed)}")
    stage = {r: st for st, r in TRAINING_RUNS.items()}[run.name]
    seconds = json.loads(results.read_text())["stage_seconds"].get(stage)
    if seconds is None:  # trained with these settings outside the recipe (its config YAML): its steps' time
        seconds = sum(json.loads(log.read_text()).get("cost", {}).get("step_seconds", []))
    return run / "model", seconds


__all__ = ["CONTROL_STAGES", "DENSE_RUN", "DENSE_SETTINGS", "REFINED_RUN", "REFINE_SETTINGS", "TRAINING_RUNS",
           "changed_settings",
           "dense_model_dir", "reusable_dense",
           "reusable_finetune", "reusable_refined"]
