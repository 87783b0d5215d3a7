"""`vlmod recipe --seeds 0,1,2`: the recipe once per seed, each a complete run into OUT/seed-N
(its own results.md / results.json, exactly as `--seed N --out OUT/seed-N` writes them), then the
table over the seeds in OUT/results.md and OUT/results.json (`vlmod.recipes.seeds`).

Each seed folder is owned, locked and checked as a one-seed run's (`vlmod.recipes.reuse`), and the
flags apply to each: none (every seed folder new or empty), `--overwrite` (every seed trained
again), `--reuse-dense` (each seed keeps its dense model). So that an interrupted run resumes in
one command, `--reuse-dense` trains a seed afresh where its folder is empty or its dense stage had
not finished, and `--reuse-trained` keeps a finished seed of the same settings as it is (not run
again) and a seed's fine-tunes where they all finished; `--reuse-trained mod` keeps each seed's MoD
stage (where it finished) and trains the stacked stage again, e.g. under another
`--stack-train-from`. OUT itself holds the seed folders and the combined files only, under its own
marker; every refusal comes before any seed starts.

`jobs` > 1 runs that many seeds at once, each in a process of its own with `threads` torch threads
(default: the cores over `jobs`): the tiny recipe models use a second thread poorly (the video
recipe's dense step 0.80 s on two threads, 1.18 on one, 1.10-1.17 with two one-thread seeds side by
side on an AMD EPYC of 2 cores), so two seeds at once finish sooner than one after the other. A
seed's models follow its thread count, not `jobs`: `--jobs 2 --threads 1` trains what `--threads 1`
does one seed at a time. A seed that fails leaves the others to finish; the first failure is raised
after them."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vlmod.bench.timing import available_cores
from vlmod.errors import InputError
from vlmod.io.owned import Ledger, entries
from vlmod.recipes.reuse import (
    FINE_TUNES,
    FULL_DISK,
    changed_settings,
    check_recipe_out,
    dense_finished,
    kept_fine_tunes,
    made_by_recipe,
    owned_folder,
    reusable_dense,
)
from vlmod.recipes.seeds import RESULTS, format_combined, write_combined
from vlmod.recipes.settings import RecipeSettings, check_image_model

SEEDS = "vlmod recipe --seeds"  # the command OUT's marker names


def seed_folder(out: Path, seed: int) -> Path:
    return out / f"seed-{seed}"


@dataclass(frozen=True)
class SeedPlan:
    """What one seed's folder gets: its finished results kept (`keep`) or a recipe run with these flags."""

    seed: int
    folder: Path
    keep: bool = False
    reuse_dense: bool = False
    reuse_trained: tuple[str, ...] = ()  # the fine-tunes kept (`kept_fine_tunes`)
    overwrite: bool = False
    note: str = ""


def _same_settings(folder: Path, s: RecipeSettings) -> bool:
    """Whether `folder` holds a finished run (results.json) of settings `s` (threads aside)."""
    try:
        saved = json.loads((folder / RESULTS).read_text(encoding="utf-8"))["settings"]
    except (OSError, UnicodeDecodeError, RecursionError, ValueError, KeyError, TypeError):
        return False
    return isinstance(saved, dict) and not changed_settings(saved, s, [f.name for f in fields(s) if f.name != "threads"])


def _fine_tunes_finished(folder: Path, s: RecipeSettings, kept: Sequence[str]) -> bool:
    """Whether every fine-tune the recipe trains and `kept` names finished there: the stacked stage
    only where a target lies past the points the MoD stage trains at (else the recipe skips it)."""
    train_from = s.train_up_to if s.stack_train_from is None else s.stack_train_from
    stacks = s.stacked and s.stack_steps and any(t > train_from for t in s.targets)
    runs = ["mod"] + ["stack"] * bool(stacks) + ["dense-control"] * s.dense_control
    return all((folder / r / "model" / "model.safetensors").is_file() and (folder / r / "train_log.json").is_file()
               for r in runs if r in kept)


def plan_seed(folder: Path, s: RecipeSettings, reuse_dense: bool, reuse_trained: bool | str | Sequence[str],
              overwrite: bool) -> SeedPlan:
    """What `folder` (seed `s.seed`) gets under the flags given (the module doc)."""
    kept = kept_fine_tunes(reuse_trained)
    if not entries(folder):
        return SeedPlan(s.seed, folder, note=" (nothing to keep there)" if reuse_dense else "")
    if overwrite or not reuse_dense:  # as a one-seed run: `check_recipe_out` refuses an earlier run without a flag
        return SeedPlan(s.seed, folder, overwrite=overwrite)
    if kept == FINE_TUNES and _same_settings(folder, s):
        return SeedPlan(s.seed, folder, keep=True, note=": finished with these settings, kept as it is")
    if not dense_finished(folder) and made_by_recipe(folder):
        return SeedPlan(s.seed, folder, overwrite=True, note=" (its dense stage had not finished: trained again)")
    trained = bool(kept) and _fine_tunes_finished(folder, s, kept)
    note = " (its fine-tunes had not all finished: trained again)" if kept and not trained else ""
    return SeedPlan(s.seed, folder, reuse_dense=True, reuse_trained=kept if trained else (), note=note)


def _foreign(out: Path, seeds: Sequence[int]) -> list[str]:
    """What `out` holds that this command did not make: not its combined files or a seed folder
    asked for now (each checked as a one-seed run's), nor a seed run's lock or temp file."""
    ledger = Ledger(out, SEEDS)
    ours = {seed_folder(out, s).name for s in seeds} | {RESULTS, "results.md"}
    return [e for e in ledger.foreign(entries(out)) if e not in ours
            and not (e.startswith(".") and e.endswith((".lock", ".tmp")))]


def check_seeds(seeds: Sequence[int]) -> list[int]:
    """The seeds, distinct and at least one."""
    if not seeds:
        raise InputError("--seeds is empty: give a comma list of seeds, e.g. --seeds 0,1,2")
    repeated = sorted({s for s in seeds if list(seeds).count(s) > 1})
    if repeated:
        raise InputError(f"--seeds gives seed {', '.join(map(str, repeated))} more than once: give each seed once")
    return list(seeds)


def seed_threads(settings: RecipeSettings, jobs: int) -> int | None:
    """The torch threads of each seed's run with `jobs` seeds at once (None: torch's own, one seed at
    a time); InputError (one line) where `jobs` or `jobs` x threads does not fit the cores."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InputError(f"--jobs takes the number of seeds to run at once, 1 or more; got {jobs!r}")
    if jobs == 1:
        return settings.threads
    cores = available_cores()
    threads = settings.threads or max(1, cores // jobs)
    if jobs > cores:
        raise InputError(f"--jobs {jobs} is more seeds at once than this machine's {cores} cores: give --jobs {cores} "
                         "or fewer")
    if jobs * threads > cores:
        raise InputError(f"--jobs {jobs} x --threads {threads} is {jobs * threads} threads on {cores} cores: they "
                         f"would contend for the same cores; give --threads {cores // jobs} or --jobs "
                         f"{max(1, cores // threads)}")
    return threads


def _say(prefix: str, text: str) -> None:
    """A seed's log line, each of its lines under the seed's prefix, written at once."""
    print(prefix + text.replace("\n", "\n" + prefix), flush=True)


def _seed_job(plan: SeedPlan, settings: RecipeSettings) -> float:
    """One seed's recipe in a process of its own (no progress bars: several would interleave); its
    seconds."""
    from vlmod.recipes.recipe import run_recipe

    start = time.perf_counter()
    run_recipe(plan.folder, settings, progress=False, log=functools.partial(_say, f"[seed {plan.seed}] "),
               reuse_dense=plan.reuse_dense, reuse_trained=plan.reuse_trained, overwrite=plan.overwrite)
    return time.perf_counter() - start


def _run_at_once(todo: Sequence[SeedPlan], settings: RecipeSettings, jobs: int, threads: int | None,
                 log: Callable[[str], None]) -> None:
    """The seeds of `todo` that are not kept, `jobs` at a time, each in a spawned process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    runs = [p for p in todo if not p.keep]
    failed: list[BaseException] = []
    with ProcessPoolExecutor(max_workers=min(jobs, max(1, len(runs))),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_seed_job, p, dataclasses.replace(settings, seed=p.seed, threads=threads)): p
                   for p in runs}
        for done, future in enumerate(as_completed(futures), 1):
            p = futures[future]
            try:
                seconds = future.result()
            except Exception as e:  # the others go on; the first failure is raised once they end
                failed.append(e)
                log(f"== seed {p.seed} failed ({done} of {len(runs)} ended): {e}")
                continue
            log(f"== seed {p.seed} finished in {seconds / 60:.1f} min ({done} of {len(runs)} ended)")
    if failed:
        raise failed[0]


def run_seeds(out: str | Path, settings: RecipeSettings, seeds: Sequence[int], progress: bool = True,
              log: Callable[[str], None] = print, reuse_dense: bool = False,
              reuse_trained: bool | str | Sequence[str] = False, overwrite: bool = False,
              jobs: int = 1) -> dict[str, Any]:
    """Run the recipe of `settings` once per seed into `out`/seed-N (or keep a finished one,
    `plan_seed`), `jobs` seeds at once, and write the combined results.md / results.json there;
    returns the combined record."""
    from vlmod.io.paths import check_output_dir
    from vlmod.recipes.recipe import run_recipe  # the training stack loads when a recipe runs

    seeds = check_seeds(seeds)
    threads = seed_threads(settings, jobs)
    reuse_trained = kept_fine_tunes(reuse_trained, reuse_dense)
    if reuse_dense and overwrite:
        raise InputError("--reuse-dense and --overwrite contradict each other: keep the dense models of the runs in "
                         "--out, or train everything again")
    check_image_model(settings)
    out = check_output_dir(out, "--out")

    def plans() -> list[SeedPlan]:
        """Every refusal before any seed starts: OUT's files, then each seed folder's, as a one-seed run's."""
        foreign = _foreign(out, seeds)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise InputError(f"--out {out} holds files a --seeds run did not make ({shown}); choose a new or empty "
                             "folder for --out")
        made = [plan_seed(seed_folder(out, n), dataclasses.replace(settings, seed=n), reuse_dense, reuse_trained,
                          overwrite) for n in seeds]
        for p in made:
            if not p.keep:
                check_recipe_out(p.folder, p.reuse_dense, p.overwrite)
            if p.reuse_dense and not p.keep:  # a dense model trained otherwise: refused now, not after seed 0
                reusable_dense(p.folder, dataclasses.replace(settings, seed=p.seed))
        return made

    with owned_folder(out, SEEDS, plans) as todo:
        ledger = Ledger(out, SEEDS)
        for i, p in enumerate(todo, 1):
            log(f"== seed {i} of {len(todo)}: --seed {p.seed} into {p.folder}{p.note}")
            ledger.claim(p.folder.name)
            if not p.keep and jobs == 1:
                run_recipe(p.folder, dataclasses.replace(settings, seed=p.seed), progress=progress, log=log,
                           reuse_dense=p.reuse_dense, reuse_trained=p.reuse_trained, overwrite=p.overwrite)
        if jobs > 1:
            log(f"== {sum(not p.keep for p in todo)} seeds, {jobs} at once, {threads} thread{'s' * (threads != 1)} each")
            _run_at_once(todo, settings, jobs, threads, log)
        ledger.claim(RESULTS), ledger.claim("results.md")
        try:
            combined = write_combined(out, [p.folder for p in todo])
        except OSError as e:
            if e.errno not in FULL_DISK:
                raise
            raise InputError(f"could not write under --out {out}: {e.strerror}; nothing was left half-written: "
                             "free space, then run again with --reuse-dense --reuse-trained") from None
    log(format_combined(combined))
    return combined


def run_seeds_again(out: Path, seeds: Sequence[int]) -> str:
    """How to go on after a --seeds run stopped: keep what its seeds finished."""
    if any(entries(seed_folder(out, n)) for n in seeds):
        return ("run again with --reuse-dense --reuse-trained to keep what its seeds finished (or --overwrite to "
                "train every seed again)")
    return "run again"


__all__ = ["SEEDS", "SeedPlan", "check_seeds", "plan_seed", "run_seeds", "run_seeds_again", "seed_folder",
           "seed_threads"]
