"""The isoFLOP check (`vlmod recipe --task image --isoflop`): does a MoD model trained from the
start match the dense model at the same training FLOPs, as the MoD paper found for language models?

The recipe's dense stage trains as usual (or is reused, `--reuse-dense`); then each MoD model
starts from the same initial weights, converted at step 0 (`TrainConfig.mod`, no dense stage
before it), and trains exactly as the dense stage (everything, tower included, same learning
rate, batch and data order) for as many steps as the dense stage's training FLOPs buy at its own
per-step FLOPs (so more steps: each is cheaper), rounded to the nearest step. Two settings:

- `paper`: the MoD paper's best, capacity 0.125 on every other layer (1, 3, 5, ...);
- `goal`: the recipe's compute point (3x fewer language-model prefill FLOPs by default) on the
  recipe's layers (every layer but 0), its capacity solved as the frontier solves it.

Each is evaluated at its training capacity on every validation question and compared with the
dense model (paired gap); `isoflop.json` and `isoflop.md` report accuracy, training FLOPs, steps,
step time and wall time of each. Training FLOPs of both sides are counted at the dense run's
measured tokens per sample for the plan (`vlmod.recipes.cost`), and each run's own afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmod.errors import InputError
from vlmod.evaluation import frontier, knobs
from vlmod.evaluation.evidence import chance_accuracy, verdict_evidence
from vlmod.io.files import write_json, write_text
from vlmod.io.hf import load_pretrained
from vlmod.recipes.cost import Routing, run_cost, sample_flops, sample_shape
from vlmod.recipes.recipe import _Recipe, token_counts
from vlmod.recipes.reuse import DENSE_RUN, recipe_folder
from vlmod.recipes.settings import RecipeSettings, format_machine, machine

PAPER_CAPACITY = 0.125  # the MoD paper's best isoFLOP setting: 12.5% capacity, every other block


def isoflop_models(recipe: Any) -> list[dict[str, Any]]:
    """The MoD models to train: name, converted language layers, capacity (the goal point's solved
    on the eval set's token counts, as the frontier solves it)."""
    s, dims = recipe.s, recipe.dims
    every_other = list(range(1, s.layers, 2))
    recipe_layers = list(range(1, s.layers))
    counts = token_counts(recipe.val_set(s.frames), s)
    goal = knobs.solve_capacity(dims, counts, s.goal, recipe_layers, s.schedule)
    return [
        {"name": "paper", "layers": every_other, "capacity": PAPER_CAPACITY, "schedule": None,
         "setting": f"the MoD paper's: capacity {PAPER_CAPACITY:g}, every other layer"},
        {"name": "goal", "layers": recipe_layers, "capacity": goal, "schedule": s.schedule,
         "setting": f"the recipe's {s.goal:g}x point: capacity {goal:.3f}, layers 1-{s.layers - 1}"},
    ]


def plan_steps(dense_flops: float, flops_per_step: float) -> int:
    """Steps whose training FLOPs come nearest the dense run's (within half a step)."""
    return max(1, round(dense_flops / flops_per_step))


def run_isoflop(out: str | Path, settings: RecipeSettings | None = None, progress: bool = True,
                log: Callable[[str], None] = print, reuse_dense: bool = False,
                overwrite: bool = False) -> dict[str, Any]:
    """Train the dense model (or reuse it), then each MoD model from scratch for the same training
    FLOPs; evaluate all and write isoflop.json / isoflop.md into `out` (see the module doc). `out`
    must be new, empty or a recipe's, as `run_recipe`'s (`overwrite` as there)."""
    s = settings or RecipeSettings()
    if s.task != "image":
        raise InputError("--isoflop is for --task image (the video recipe's dense model has four stages)")
    if s.mod_layers != "all":
        raise InputError("--isoflop converts at step 0, before there is a model to rank: use --mod-layers all")
    with recipe_folder(out, reuse_dense, overwrite) as folder:
        return _run_isoflop(_Recipe(folder, s, progress, log, reuse_trained=()), reuse_dense)


def _run_isoflop(recipe: _Recipe, reuse_dense: bool) -> dict[str, Any]:
    s = recipe.s
    if reuse_dense:
        recipe.reuse_dense()
    else:
        recipe.train_dense()
    recipe.evaluate_dense()
    dense_row = recipe.result.rows[0]
    dense_cost = run_cost(recipe.out / DENSE_RUN, recipe.train_json)
    if dense_cost is None:
        raise InputError(f"--isoflop: the dense run in {recipe.out / DENSE_RUN} predates step costs in train_log.json "
                         "(its training FLOPs are unknown); train it again without --reuse-dense")
    start = recipe.out / "tower" / "model" if s.tower_steps else recipe.out / "init"
    if not (start / "config.json").is_file():
        recipe.stages.run("init", recipe.init)  # the same seed gives the dense stage's initial weights
    shape = sample_shape(recipe.dense_model, recipe.processor, recipe.train_json, s.frames, dense_cost["tokens_per_sample"],
                         dense_cost.get("head_tokens_per_sample"))
    dense_step = sample_flops(shape, trainable="full", train_vision_tower=True) * s.batch_size
    rows = [{"name": "dense", "setting": f"dense, {s.dense_steps} steps", "layers": [], "capacity": 1.0,
             "planned_flops": dense_step * s.dense_steps, **_measured(dense_cost, recipe.result.stages["train dense"]),
             **_evaluated(dense_row, dense_row)}]
    for m in isoflop_models(recipe):
        per_step = sample_flops(shape, Routing(tuple(m["layers"]), m["capacity"], m["schedule"]), trainable="full",
                                train_vision_tower=True) * s.batch_size
        steps = plan_steps(rows[0]["planned_flops"], per_step)
        run = f"isoflop-{m['name']}"
        recipe.log(f"   {run}: {steps} steps of {per_step / 1e9:.2f} GFLOPs (dense: {dense_cost['steps']} of "
                   f"{dense_step / 1e9:.2f})")
        started = time.perf_counter()
        mod = {"capacity": m["capacity"], "layers": m["layers"], "routable": ["image"], "capacity_schedule": m["schedule"]}
        model_dir = recipe.stages.run(f"train {run}", lambda mod=mod, run=run, steps=steps: recipe.finetune(
            start, run, trainable="full", train_vision_tower=True, lr=s.dense_lr, max_steps=steps,
            weight_decay=s.weight_decay, router_lr=s.router_lr, mod=mod))
        seconds = time.perf_counter() - started
        report = recipe.stages.run(f"eval {run}", lambda d=model_dir, n=run: recipe.evaluated(
            load_pretrained(d).eval(), n))
        row = frontier.row(run, None, m["setting"], report)
        cost = run_cost(recipe.out / run, recipe.train_json)
        rows.append({**{k: m[k] for k in ("name", "setting", "layers", "capacity")}, "planned_flops": per_step * steps,
                     "planned_step_flops": per_step, **_measured(cost, seconds), **_evaluated(row, dense_row)})
    result = {"settings": s.to_dict(), "rows": rows, "stage_seconds": recipe.result.stages,
              "machine": machine()}
    write_json(recipe.out / "isoflop.json", result, strict=True)
    table = format_isoflop(result)
    write_text(recipe.out / "isoflop.md", table + "\n")
    recipe.log(table)
    return result


def _measured(cost: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    """What a run measured: steps, step time, tokens a second, its training FLOPs, wall time."""
    keep = ("steps", "step_ms_median", "step_ms_spread", "tokens_per_second", "tokens_per_sample", "training_flops")
    return {**{k: (cost or {}).get(k) for k in keep}, "wall_seconds": seconds}


def _evaluated(row: dict[str, Any], dense: dict[str, Any]) -> dict[str, Any]:
    """Accuracy, the paired gap to dense with its interval, inference FLOPs and per-question marks."""
    gap = frontier.paired_gap(row, dense) if row is not dense else None
    return {"accuracy": row["accuracy"], "accuracy_by_type": row["accuracy_by_type"], "answer_loss": row["answer_loss"],
            "gap_points": None if gap is None else list(gap), "language_reduction": row["language_reduction"],
            "gflops": row["gflops"], "samples": row["samples"], "correct": row["correct"]}


def format_isoflop(result: dict[str, Any]) -> str:
    """isoflop.md: a row a model, then what the comparison says."""
    rows = result["rows"]
    lines = ["| model | setting | training steps | training TFLOPs (vs dense) | step ms (median) | training wall s "
             "| tokens/s | LM prefill reduction | accuracy | vs dense (95% interval) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    dense = rows[0]
    for r in rows:
        ratio = r["training_flops"] / dense["training_flops"] if r["training_flops"] and dense["training_flops"] else None
        gap = "-" if r["gap_points"] is None else "{:+.1f} ({:+.1f} to {:+.1f})".format(*r["gap_points"])
        lines.append(
            f"| {r['name']} | {r['setting']} | {r['steps']} | {r['training_flops'] / 1e12:.4g} "
            f"({'-' if ratio is None else f'{ratio:.3f}x'}) | {r['step_ms_median']:.1f} | {r['wall_seconds']:.0f} | "
            f"{r['tokens_per_second']:,.0f} | {r['language_reduction']:.2f}x | {100 * r['accuracy']:.1f}% | {gap} |")
    lines += ["", f"- every model trained from the same initial weights, everything (tower included) at lr "
                  f"{result['settings']['dense_lr']:g}, batch {result['settings']['batch_size']}; the MoD models "
                  "converted at step 0 and run for the dense run's training FLOPs (planned at its tokens per sample, "
                  "within half a step; the TFLOPs column counts each run's own trained tokens)",
              "- step and wall times on the host clock: a busy machine slows every run, so compare them within one "
              "run only", format_machine(result.get("machine") or {})]
    evidence = verdict_evidence(dense["accuracy"], int(dense["samples"]), chance_accuracy(dense["accuracy_by_type"]))
    if not evidence.enough:  # a toy run: the table, no "beats dense" (vlmod.evaluation.evidence)
        lines.append(f"- {evidence.line()}")
    for r in rows[1:] if evidence.enough else ():
        gap = r["gap_points"]
        verdict = ("no paired gap (too few questions)" if gap is None else "matches dense within its interval"
                   if gap[1] <= 0 <= gap[2] else "beats dense" if gap[1] > 0 else "falls short of dense")
        lines.append(f"- {r['name']}: {r['steps']} steps against dense's {dense['steps']}, "
                     f"{100 * r['accuracy']:.1f}% against {100 * dense['accuracy']:.1f}%: {verdict} at equal training FLOPs")
    return "\n".join(lines)


__all__ = ["PAPER_CAPACITY", "format_isoflop", "isoflop_models", "plan_steps", "run_isoflop"]
