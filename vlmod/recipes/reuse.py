"""What a recipe rerun may keep from an earlier run in the same folder (`--reuse-dense`,
`--reuse-trained`): a stage's model is kept only if its record says it was trained with the
settings asked for now, so a reused stage always gives the numbers a fresh run would.

And which folder a recipe may write at all (`recipe_folder`): a new or empty one, or one a recipe
made (its marker, `vlmod.io.owned`) when `--reuse-dense` continues that run or `--overwrite` trains
it again there; a folder holding files the recipe did not make is refused. One recipe writes a
folder at a time: a second one on the same `--out` stops in one line (the lock `convert` takes)."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

from vlmod.errors import InputError
from vlmod.io.files import sole_writer
from vlmod.io.owned import MARKER, Ledger, entries, made_by

CONTROL_STAGES = ("train dense control", "eval dense control")  # opt-in: left out of the recipe's own time
# The settings the first dense model depends on, and (`refine_steps` > 0) the refined one too.
DENSE_SETTINGS = (
    "task", "num_train", "image_size", "frames", "video_pool", "distractors", "captions", "width", "layers", "heads", "kv_heads",
    "vision_width", "vision_layers", "patch_size", "tower_steps", "tower_solid", "dense_steps", "dense_lr", "dense_tower", "weight_decay",
    "batch_size", "seed",
    "image_steps", "num_train_images", "image_batch_size", "image_model", "glyph_scale", "types", "question_first",
    "layout", "faint", "unaligned",
)
REFINE_SETTINGS = ("refine_steps",)
DENSE_RUN, REFINED_RUN = "dense", "dense-refined"
# Each training stage of a recipe and the run folder it trains into.
TRAINING_RUNS = {"train on images": "image", "train dense": DENSE_RUN, "refine dense": REFINED_RUN,
                 "train MoD": "mod", "train stacked": "stack", CONTROL_STAGES[0]: "dense-control"}
_RUN_PATHS = ("model", "data", "output_dir", "distill_from", "reduce_scorer", "overwrite", "resume")  # follow from --out
# The fine-tunes `--reuse-trained` keeps (all, or those it names), in the order the recipe trains them.
FINE_TUNES = ("mod", "stack", "dense-control")


RECIPE = "vlmod recipe"  # the command a recipe folder's marker names
T = TypeVar("T")


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
    if not (reuse_dense or overwrite) and not dense_finished(out):
        raise InputError(f"--out {out} holds an earlier recipe run that stopped before its dense model was finished "
                         "(nothing to keep with --reuse-dense); pass --overwrite to train everything again there, or "
                         "choose another --out")
    if not (reuse_dense or overwrite):
        raise InputError(f"--out {out} holds an earlier recipe run; pass --reuse-dense to keep its dense model (same "
                         "settings), --overwrite to train everything again there, or choose another --out")


def dense_finished(out: Path) -> bool:
    """Whether `out` holds a finished dense stage (its model and record), what --reuse-dense keeps."""
    return (out / DENSE_RUN / "model" / "model.safetensors").is_file() and (out / DENSE_RUN / "recipe.json").is_file()


def run_again(out: Path) -> str:
    """How to go on in `out` after a run stopped (Ctrl-C, a full disk): with --reuse-dense when its
    dense stage finished, so the rerun keeps that model instead of training it again."""
    if dense_finished(out):
        return "run again with --reuse-dense to keep its finished dense model (or --overwrite to train it again)"
    return "run again with --overwrite (its dense stage had not finished)" if entries(out) else "run again"


@contextmanager
def owned_folder(folder: Path, command: str, check: Callable[[], T]) -> Iterator[T]:
    """Run `check` (it refuses what may not be written), then hold `folder` against a second run
    (`sole_writer`), `check` again (another run may have changed it in between), create the folder
    and mark it as `command`'s while the body runs, given what the second `check` returned. A run
    that stops (a refusal, Ctrl-C) before anything else was written there leaves no folder (nor
    marker) behind."""
    check()
    new = [p for p in (folder, *folder.parents) if not p.exists()]  # what this run creates, innermost first
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot write to {folder.parent}: {err.strerror or err}") from None
    locked = False
    try:
        with sole_writer(folder, InputError, "--out"):
            locked = True
            checked = check()
            folder.mkdir(exist_ok=True)
            marked = made_by(folder) != command
            if marked:
                Ledger(folder, command).save()
            try:
                yield checked
            except BaseException:
                if marked and not entries(folder):  # nothing written but the marker: take it back
                    (folder / MARKER).unlink(missing_ok=True)
                raise
    except BaseException:
        for made in new if locked else ():  # the folders this run created, if still empty (rmdir refuses others)
            with suppress(OSError):
                made.rmdir()
        raise


@contextmanager
def recipe_folder(out: str | Path, reuse_dense: bool = False, overwrite: bool = False) -> Iterator[Path]:
    """`out`, checked (`check_recipe_out`) before anything is created, then held against a second
    recipe on it, created and marked as a recipe's while the body runs (`owned_folder`)."""
    from vlmod.io.paths import check_output_dir

    folder = check_output_dir(out, "--out")
    with owned_folder(folder, RECIPE, lambda: check_recipe_out(folder, reuse_dense, overwrite)), full_disk(folder):
        yield folder


# What a write raises when the disk (or the user's quota) is full, or the file system went read-only.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


@contextmanager
def full_disk(folder: Path) -> Iterator[None]:
    """A recipe's stages write with atomic writers (`vlmod.io.files`; `train` and `convert` through
    temp folders renamed into place, and they say a full disk in one line themselves): what a
    full disk raises in any other writer (the safetensors layout's OSError, the Rust writer's
    SafetensorError) becomes one InputError line too, and what was written is complete."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        if isinstance(e, OSError) and e.errno not in FULL_DISK:
            raise  # not a write that ran out of room: a bug, with its traceback
        reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        raise InputError(f"could not write under --out {folder}: {reason}; nothing was left half-written: free space "
                         f"or choose another --out, then {run_again(folder)}") from None


def _as_json(value: Any) -> Any:
    """`value` as a record read back holds it (a tuple as a list, a float key as a string)."""
    return json.loads(json.dumps(value))


def changed_settings(saved: dict[str, Any], now: Any, keys: Any) -> list[str]:
    """The `keys` of dataclass `now` whose value differs from the `saved` record's, compared as
    JSON holds them (a key the record lacks, added since that run, counts as its default)."""
    defaults = {f.name: f.default for f in fields(now) if f.default is not MISSING}
    return [k for k in keys if _as_json(saved.get(k, defaults.get(k))) != _as_json(getattr(now, k))]


# What to do about a damaged record of an earlier run, which --reuse-dense / --reuse-trained cannot keep.
REUSE_DENSE = ("--reuse-dense", "pass --overwrite instead of --reuse-dense to train every stage again, or choose "
                                "another --out")
REUSE_TRAINED = ("--reuse-trained", "drop --reuse-trained to train the fine-tunes again")


def read_record(path: Path, reuse: tuple[str, str], keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object an earlier run wrote at `path` (a stage's recipe.json or train_log.json,
    results.json), holding a mapping at each of `keys`; InputError naming the flag that reads it,
    the file, and what to do (`reuse`: flag, fix) when it cannot be read, is not JSON (a disk that
    filled up, an edit), or lacks one."""
    flag, fix = reuse
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as e:
        reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0][:120]
    else:
        missing = [k for k in keys if not isinstance(data, dict) or not isinstance(data.get(k), dict)]
        if not missing:
            return data
        reason = f"no {' or '.join(missing)} in it" if isinstance(data, dict) else "not a JSON object"
    raise InputError(f"{flag}: {path} is damaged ({reason}); {fix}")


def _finished(out: Path, run: str) -> dict[str, Any] | None:
    """The record of `run`'s stage in `out` if it finished (its model and recipe.json written), its
    training log checked too (what the results' cost section reads); None if it did not finish."""
    record = out / run / "recipe.json"
    if not (out / run / "model" / "model.safetensors").is_file() or not record.is_file():
        return None
    if (out / run / "train_log.json").is_file():
        read_record(out / run / "train_log.json", REUSE_DENSE, ("config",))
    return read_record(record, REUSE_DENSE, ("settings", "stage_seconds"))


def reusable_dense(out: Path, s: Any) -> dict[str, float]:
    """The stage times of an earlier run's (first) dense model in `out`, if trained with these
    settings; its record (and the image stage's log, which it started from) checked."""
    before = _finished(out, DENSE_RUN)
    if before is None:
        raise InputError(f"--reuse-dense: {out} holds no finished dense stage (dense/model and dense/recipe.json); "
                         "pass --overwrite instead to train it again there")
    changed = changed_settings(before["settings"], s, DENSE_SETTINGS)
    if changed:
        raise InputError(f"--reuse-dense: the dense model in {out} was trained with other {', '.join(changed)}")
    image_log = out / TRAINING_RUNS["train on images"] / "train_log.json"
    if image_log.is_file():
        read_record(image_log, REUSE_DENSE, ("config",))
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
    refined = results.is_file() and read_record(results, ("results", "run the recipe again"), ("settings",))[
        "settings"].get("refine_steps", 0)
    return out / (REFINED_RUN if refined else DENSE_RUN) / "model"


def _run_of(path: str | None) -> str | None:
    """The recipe folder a path names: `dense` for OUT/dense/model, `converted` for OUT/converted."""
    if path is None:
        return None
    p = Path(path)
    return p.parent.name if p.name == "model" else p.name


def reusable_finetune(out: Path, cfg: Any, router: str | None = None) -> tuple[Path, float]:
    """(model, training seconds) of an earlier run's fine-tune into `cfg.output_dir`, if it was
    trained with these settings (`--reuse-trained`), and `router` the MoD router its model selects
    with (the converted model's: no training setting names it): the recipe then only evaluates again. A stage
    the earlier results do not time (trained by its config YAML, added to the recipe since, or a
    run stopped before it wrote results.json, during its evaluations) counts its steps' time from
    its log. Its model and log are written last, renamed into place, so both there means it finished."""
    run = Path(cfg.output_dir)
    log, results = run / "train_log.json", out / "results.json"
    missing = [str(p.relative_to(out)) for p in (run / "model" / "model.safetensors", log) if not p.is_file()]
    if missing:
        raise InputError(f"--reuse-trained: {out} holds no finished {run.name} stage (no {' or '.join(missing)}); "
                         "drop --reuse-trained to train it again")
    saved = read_record(log, REUSE_TRAINED, ("config",))["config"]
    changed = changed_settings(saved, cfg, [f.name for f in fields(cfg) if f.name not in _RUN_PATHS])
    # Paths follow --out (the folder may have moved), but which run they name must not change:
    # a fine-tune from the first dense model is no use once the recipe starts from the refined one.
    changed += [k for k in ("model", "distill_from") if _run_of(saved.get(k)) != _run_of(getattr(cfg, k))]
    if router is not None and _saved_router(run / "model") != router:
        changed.append("router (mod_router)")
    if changed:
        raise InputError(f"--reuse-trained: the {run.name} stage in {out} was trained with other {', '.join(changed)}")
    stage = {r: st for st, r in TRAINING_RUNS.items()}[run.name]
    seconds = (read_record(results, REUSE_TRAINED, ("stage_seconds",))["stage_seconds"].get(stage)
               if results.is_file() else None)
    if seconds is None:  # trained with these settings outside the recipe (its config YAML): its steps' time
        seconds = sum(read_record(log, REUSE_TRAINED, ("config",)).get("cost", {}).get("step_seconds", []))
    return run / "model", seconds


def kept_fine_tunes(reuse_trained: bool | str | Sequence[str], reuse_dense: bool | None = None) -> tuple[str, ...]:
    """The fine-tunes `--reuse-trained` keeps: every one (True), none (False), or those named (a
    comma list or a sequence), so that a change to a later stage's settings trains that stage alone
    again (`--reuse-trained mod` with another `--stack-train-from`). Given `reuse_dense`, keeping any
    without it is refused: the fine-tunes start from that dense model."""
    kept = _named_fine_tunes(reuse_trained)
    if kept and reuse_dense is False:
        raise InputError("--reuse-trained goes with --reuse-dense (the fine-tunes start from that dense model)")
    return kept


def _named_fine_tunes(reuse_trained: bool | str | Sequence[str]) -> tuple[str, ...]:
    if reuse_trained is True:
        return FINE_TUNES
    if reuse_trained is False:
        return ()
    names = [n.strip() for n in reuse_trained.split(",")] if isinstance(reuse_trained, str) else list(reuse_trained)
    unknown = [n for n in names if n not in FINE_TUNES]  # "" too: a string names at least one
    if unknown:
        raise InputError(f"--reuse-trained got {', '.join(map(repr, unknown))}: name fine-tunes among "
                         f"{', '.join(FINE_TUNES)} (a comma list), or give no value to keep them all")
    if "stack" in names and "mod" not in names:
        raise InputError("--reuse-trained stack: the stacked stage starts from the MoD stage's model, so keep mod too "
                         "(--reuse-trained mod,stack)")
    return tuple(n for n in FINE_TUNES if n in names)


def _saved_router(model: Path) -> str | None:
    """The router kind a fine-tuned model's language MoD layers were saved with (None: none)."""
    config = read_record(model / "config.json", REUSE_TRAINED, ())
    return ((config.get("vlmod") or {}).get("language") or {}).get("router")


__all__ = ["CONTROL_STAGES", "DENSE_RUN", "DENSE_SETTINGS", "FINE_TUNES", "FULL_DISK", "RECIPE", "REFINED_RUN",
           "REFINE_SETTINGS", "REUSE_DENSE", "REUSE_TRAINED", "TRAINING_RUNS", "changed_settings", "check_recipe_out",
           "dense_finished", "dense_model_dir", "full_disk", "kept_fine_tunes", "made_by_recipe", "read_record",
           "recipe_folder", "reusable_dense", "reusable_finetune", "reusable_refined", "run_again"]
