"""What a recipe rerun may keep from an earlier run in the same folder (`--reuse-dense`,
`--reuse-trained`): a stage's model is kept only if its record says it was trained with the
settings asked for now, so a reused stage always gives the numbers a fresh run would.

And which folder a recipe may write at all (`recipe_folder`): a new or empty one, or one a recipe
made (its marker, `vlmod.io.owned`) when `--reuse-dense` continues that run or `--overwrite` trains
it again there; a folder holding files the recipe did not make is refused. One recipe writes a
folder at a time: a second one on the same `--out` stops in one line (the lock `convert` takes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

from vlmod.errors import InputError
from vlmod.io.files import sole_writer
from vlmod.io.owned import Ledger, entries, made_by

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


RECIPE = "vlmod recipe"  # the command a recipe folder's marker names


def made_by_recipe(out: Path) -> bool:
    """Whether a recipe made `out`: its marker, or (a run from before the marker) a dense stage's record."""
    return made_by(out) == RECIPE or (out / DENSE_RUN / "recipe.json").is_file()


def check_recipe_out(out: Path, reuse_dense: bool = False, overwrite: bool = False) -> None:
    """Refuse an `--out` this recipe may not write (creates nothing): one holding files the recipe
    did not make; one holding an earlier recipe run, unless `reuse_dense` continues it or
    `overwrite` trains it again there; `reuse_dense` with no earlier run to continue."""
    if reuse_dense and overwrite:
        raise InputError("--reuse-dense and --overwrite contradict each other: keep the dense model of the run in "
                         "--out, or train everything again")
    held = entries(out)
    if not held:
        if reuse_dense:
            raise InputError(f"--reuse-dense: --out {out} holds no earlier recipe run to continue; drop --reuse-dense")
        return
    if not made_by_recipe(out):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise InputError(f"--out {out} holds files the recipe did not make ({shown}); choose a new or empty folder "
                         "for --out")
    if not (reuse_dense or overwrite):
        raise InputError(f"--out {out} holds an earlier recipe run; pass --reuse-dense to keep its dense model (same "
                         "settings), --overwrite to train everything again there, or choose another --out")


@contextmanager
def recipe_folder(out: str | Path, reuse_dense: bool = False, overwrite: bool = False) -> Iterator[Path]:
    """`out`, checked (`check_recipe_out`) before anything is created, then held against a second
    recipe on it (`sole_writer`), created and marked as a recipe's while the body runs."""
    from vlmod.io.paths import check_output_dir

    folder = check_output_dir(out, "--out")
    check_recipe_out(folder, reuse_dense, overwrite)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot write to {folder.parent}: {err.strerror or err}") from None
    with sole_writer(folder, InputError, "--out"):
        check_recipe_out(folder, reuse_dense, overwrite)  # again, locked: another run may have started in between
        folder.mkdir(exist_ok=True)
        if made_by(folder) != RECIPE:
            Ledger(folder, RECIPE).save()
        yield folder


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


__all__ = ["CONTROL_STAGES", "DENSE_RUN", "DENSE_SETTINGS", "RECIPE", "REFINED_RUN", "REFINE_SETTINGS", "TRAINING_RUNS",
           "changed_settings", "check_recipe_out", "dense_model_dir", "made_by_recipe", "recipe_folder", "reusable_dense",
           "reusable_finetune", "reusable_refined"]
