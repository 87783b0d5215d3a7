"""`vlmod recipe` / `scripts/synthetic_recipe.py`: the flags of `vlmod.recipes.recipe` (each shows both
tasks' defaults) and the command that checks them and runs the recipe."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from vlmod.cli.argtypes import finite_float, int_at_least, non_negative_float, positive_int, share, threads
from vlmod.cli.common import EXIT_INTERRUPTED, SubParsers
from vlmod.data.detail import DETAIL_TYPES, FAINT_CONTRAST, LAYOUTS
from vlmod.data.synthetic import FAINT_CONTRAST as SHAPES_FAINT
from vlmod.errors import InputError
from vlmod.recipes.settings import (
    DEFAULT_STACK_SHARE,
    DETAIL_STACKS,
    ISOFLOP_DENSE_STEPS,
    MOD_ROUTERS,
    TASKS,
    RecipeSettings,
)

_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("num_train", positive_int, "training images (image task) or clips (video task)"),
    ("num_val", positive_int, "validation samples: dense, the control and MoD answer them all"),
    ("baseline_samples", positive_int, "the other methods answer the first N validation samples (None: all)"),
    ("frames", positive_int, "frames per clip (video task)"),
    ("video_pool", str, "pooling of each frame's 2x2 patches (video task): average, max, or conv (learned, "
                        "starts as average)"),
    ("distractors", int_at_least(0), "the image questions' scenes: up to N shapes besides the one a colour, shape or "
                                     "position question asks about (0-4; the video task's image stage learns on them)"),
    ("width", positive_int, "language model width"),
    ("layers", positive_int, "language model layers"),
    ("vision_width", positive_int, "vision tower width"),
    ("tower_steps", int_at_least(0), "steps of vision tower pretraining on what each training image's patches show "
                                     "(shape and colour of their object; 0: none)"),
    ("dense_steps", positive_int, "steps of dense training from scratch"),
    ("refine_steps", int_at_least(0), "steps of the second dense stage: tower frozen, distilled from the first "
                                      "dense model, which later stages then replace by the refined one (0: none)"),
    ("image_steps", int_at_least(0), "steps of the image stage before video training (0: none)"),
    ("dense_lr", finite_float, "learning rate of dense training"),
    ("batch_size", positive_int, "training batch size"),
    ("mod_steps", positive_int, "steps of MoD fine-tuning"),
    ("mod_lr", finite_float, "learning rate of MoD fine-tuning"),
    ("router_lr", finite_float, "learning rate of the routers"),
    ("router_aux", non_negative_float, "weight of the aux loss that teaches the learned router, in the MoD stages, the "
                                       "tokens the attention router would run (0: none)"),
    ("capacity_warmup", non_negative_float, "share of the MoD fine-tune over which capacity falls from 1.0 to "
                                            "each step's draw (or a step count if >= 1)"),
    ("mod_layers", str, "converted language layers: 'all' (every layer but 0) or 'arank:N'"),
    ("train_up_to", finite_float, "the MoD fine-tune trains at the capacities of the points up to this LM FLOPs "
                           "reduction (each step draws one); points past it are evaluated on that model"),
    ("stack_scoring", str, "MoD stacked on pre-LLM reduction: its ranking, cls, mean (every query's attention), "
                           "deviation (each feature's distance from its frame's mean) or novelty (deviation, but "
                           "past a clip's first frame at most the distance from the same spot a frame earlier) "
                           "or query (pictures: a scorer that reads the question, fitted to the MoD stage's "
                           "routing; the rest dropped, neither merged nor pooled)"),
    ("stack_pool", positive_int, "MoD stacked on pre-LLM reduction: average each picture's tokens in N x N windows "
                                 "first and keep every window (LLaVA-OneVision's 2 x 2 pooling), MoD reaching the rest "
                                 "of each point (1: the reduction drops tokens, --stack-share)"),
    ("reduce_contextual", non_negative_float, "the pre-LLM reduction baselines: the share of their kept tokens that "
                                              "are VisionZip's contextual tokens (the dropped ones merged)"),
    ("stack_steps", int_at_least(0), "MoD stacked on pre-LLM reduction: steps the MoD model trains on behind the "
                                     "reduction, each at one stacked point's keep and capacity (0: none)"),
    ("stack_lr", finite_float, "learning rate of that stage"),
    ("stack_train_from", finite_float, "that stage draws the stacked points past this LM FLOPs reduction (1: every one; None: "
                                "past --train-up-to)"),
    ("image_size", positive_int, "image / frame side in pixels (vision tokens: (side / patch)^2 an image, a "
                                 "quarter of that a frame)"),
    ("patch_size", positive_int, "vision tower patch side in pixels"),
    ("glyph_scale", positive_int, "detail task: glyphs and markers drawn over N x N patches (N times the size)"),
    ("faint", share, "image and detail tasks: the share of pictures drawn faint (every shape at a contrast uniform "
                     f"in {SHAPES_FAINT[0]:g}-{SHAPES_FAINT[1]:g}, every glyph and marker in "
                     f"{FAINT_CONTRAST[0]:g}-{FAINT_CONTRAST[1]:g})"),
    ("schedule", str, "per-layer capacity schedule: none or cosine"),
    ("seed", int, "seed of data, init, training and evaluation"),
)


def share_at_target(text: str) -> tuple[float | None, float]:
    """An argparse type for `--stack-share`: "0.7" (every point) or "8=0.85" (the point at 8x)."""
    target, _, share = text.rpartition("=")
    try:
        return (float(target) if target else None), float(share)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SHARE or TARGET=SHARE (e.g. 0.5 or 8=0.85), got {text!r}") from None


def _shares(share: float | dict[float, float] | None, named_only: bool = False) -> str:
    """A stack_share as `--stack-share` takes it (`named_only`: a stack_train_share, whose targets
    it does not name train where they run, as `--stack-train-share` takes it)."""
    if share is None:
        return "as --stack-share"
    if not isinstance(share, dict):
        return f"{share:g}"
    named = [f"{t:g}={s:g}" for t, s in sorted(share.items()) if named_only or s != DEFAULT_STACK_SHARE]
    return " ".join(named if named_only else [f"{DEFAULT_STACK_SHARE:g}", *named])


def seed_list(text: str) -> list[int]:
    """An argparse type for `--seeds`: a comma list of distinct integer seeds ("0,1,2")."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("is empty: give a comma list of seeds, e.g. --seeds 0,1,2")
    bad = [p for p in parts if not p.lstrip("-").isdigit()]
    if bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of integer seeds (e.g. 0,1,2), got {text!r}: "
                                         f"{bad[0]!r} is not an integer")
    negative = [p for p in parts if p.startswith("-")]
    if negative:  # numpy's generators, which draw the data, take no negative seed
        raise argparse.ArgumentTypeError(f"seeds are integers from 0, got {negative[0]} in {text!r}")
    seeds = [int(p) for p in parts]
    twice = sorted({n for n in seeds if seeds.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"gives seed {', '.join(map(str, twice))} more than once in {text!r}: "
                                         "give each seed once")
    return seeds


def question_types(text: str) -> tuple[str, ...]:
    """A comma list of question types, as given (the settings check them against the task's)."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def stack_shares(given: list[tuple[float | None, float]], task_default: RecipeSettings,
                 training: bool = False) -> float | dict[float, float]:
    """`--stack-share` (`training`: `--stack-train-share`) as a setting: one share (bare), or every
    target's (its own, else the bare one, else the task's default)."""
    flag = "--stack-train-share" if training else "--stack-share"
    named = {t: s for t, s in given if t is not None}
    twice = sorted({t for t, _ in given if t is not None and sum(u == t for u, _ in given) > 1})
    if twice:  # a dict would keep the last one silently
        raise InputError(f"{flag} gives {', '.join(f'{t:g}x' for t in twice)} more than once: give each target's "
                         "share once")
    bare = [s for t, s in given if t is None]
    if len(bare) > 1:
        raise InputError(f"{flag} takes one bare SHARE (for every point), got {len(bare)}: name the others' "
                         "targets as TARGET=SHARE")
    unknown = sorted(set(named) - set(task_default.targets))
    if unknown:
        raise InputError(f"{flag} names {', '.join(f'{t:g}x' for t in unknown)}, not among the targets "
                         f"({' '.join(f'{t:g}' for t in task_default.targets)}): name a target or give --targets")
    if not named:
        return bare[0]
    return {t: named.get(t, bare[0] if bare else task_default.share_at(t, training)) for t in task_default.targets}


def add_recipe_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod recipe`: the synthetic recipe end to end (the README's Results)."""
    p = subparsers.add_parser(
        "recipe",
        help="the synthetic recipe: data, dense from scratch, ARank, convert, fine-tune, evaluate, baselines",
        description="Run the offline synthetic recipe end to end into --out and write results.md / results.json.",
    )
    return add_recipe_arguments(p)


def add_recipe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `vlmod recipe` / `scripts/synthetic_recipe.py`: a task, its defaults, overrides."""
    parser.add_argument("--task", default="image", choices=TASKS,
                        help="image (shapes), video (clips) or detail (small digits and markers among large shapes, "
                             "the answer in at most 5%% of the vision tokens) recipe (default: image)")
    parser.add_argument("--out", default=None,
                        help="output folder: new or empty, or an earlier recipe run's with --reuse-dense or --overwrite "
                             "(default: runs/synthetic-TASK; runs/synthetic-image-isoflop with --isoflop; "
                             "runs/synthetic-TASK-seeds with --seeds)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the whole pipeline in under 2 minutes")
    image, vid, detail = (RecipeSettings.for_task(t) for t in ("image", "video", "detail"))
    merged, pooled = DETAIL_STACKS[True], DETAIL_STACKS[False]
    for name, kind, text in _FLAGS:
        a, b, d = getattr(image, name), getattr(vid, name), getattr(detail, name)
        shown = f"{a}" if a == b else f"image {a}, video {b}"
        if d != a:
            shown += f", detail {d}"
        if name == "dense_steps":
            shown += f"; --isoflop {ISOFLOP_DENSE_STEPS}"
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                            help=f"{text} (default: {shown})")
    parser.add_argument("--seeds", type=seed_list, default=None, metavar="N,N,...",
                        help="run the recipe once per seed into OUT/seed-N (each as --seed N writes it), then one "
                             "table in OUT/results.md / results.json: each seed's score, the mean and the worst seed "
                             "(default: none: one seed, --seed)")
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="with --seeds: how many seeds run at once, each in a process of its own with --threads "
                             "threads (then defaulting to the cores over --jobs); a seed's models follow its threads, "
                             "not --jobs (default: 1)")
    parser.add_argument("--targets", type=finite_float, nargs="+", default=None,
                        help=f"LM prefill FLOPs reductions to reach (default: {' '.join(map(str, image.targets))})")
    parser.add_argument("--stack-share", nargs="+", type=share_at_target, default=None, metavar="[TARGET=]SHARE",
                        help="MoD stacked on pre-LLM reduction: the reduction's share of each point's LM FLOPs "
                             "reduction, in log terms (0.5: each does the square root), MoD the rest; a bare SHARE "
                             "for every point, TARGET=SHARE for one (default: image "
                             f"{_shares(image.stack_share)}, video {_shares(vid.stack_share)}, detail "
                             f"{_shares(detail.stack_share)} with --stack-pool 1)")
    parser.add_argument("--stack-train-share", nargs="+", type=share_at_target, default=None, metavar="[TARGET=]SHARE",
                        help="the split the stacked stage trains at, as --stack-share; a target it does not name "
                             "trains where it runs (default: image "
                             f"{_shares(image.stack_train_share)}, video {_shares(vid.stack_train_share, named_only=True)}, "
                             f"detail {_shares(detail.stack_train_share)}; "
                             "with --stack-share given: as --stack-share)")
    parser.add_argument("--types", type=question_types, default=None, metavar="TYPE,TYPE,...",
                        help="detail task: its question types, a comma list out of "
                             f"{','.join(DETAIL_TYPES)} (default: {','.join(detail.types or DETAIL_TYPES)})")
    parser.add_argument("--question-first", action=argparse.BooleanOptionalAction, default=None,
                        help="detail task: each prompt puts the question before the picture (default: "
                             f"{'on' if detail.question_first else 'off'})")
    parser.add_argument("--tower-solid", action=argparse.BooleanOptionalAction, default=None,
                        help="tower pretraining on the solid pictures only, none of the faint ones' labels "
                             f"(default: {'on' if image.tower_solid else 'off'})")
    parser.add_argument("--unaligned", action=argparse.BooleanOptionalAction, default=None,
                        help="detail task: each picture's glyph cells start 0 to glyph-scale - 1 patches in (drawn), "
                             "so glyphs straddle 2 x 2 pooling windows as text does on real pictures (default: "
                             f"{'on' if detail.unaligned else 'off'})")
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default=None,
                        help="detail task: scene (a few glyphs among large shapes), page (glyphs filling the "
                             "picture like text) or crowded (a page of more glyphs than a 3x reduction keeps "
                             f"tokens) (default: {detail.layout})")
    parser.add_argument("--mod-router", choices=MOD_ROUTERS, default=None,
                        help="the router the MoD and stacked stages train and run with: learned (the shared linear "
                             "router) or attention (each layer ranks by the attention text pays; no parameters, its "
                             f"scoring counted in the FLOPs) (default: image {image.mod_router}, video "
                             f"{vid.mod_router}, detail {detail.mod_router})")
    parser.add_argument("--routers", nargs="*", default=None,
                        help=f"baselines at every point (default: {' '.join(image.routers)})")
    parser.add_argument("--image-model", default=None, metavar="DIR",
                        help="video task: start from this image LLaVA of the same sizes (e.g. the image recipe's "
                             "runs/synthetic-image/dense/model) instead of training the image stage (default: train it)")
    parser.add_argument("--stack-merge", action=argparse.BooleanOptionalAction, default=None,
                        help="MoD stacked on pre-LLM reduction: the reduction merges each picture's (frame's) most "
                             "alike tokens until its keep is left (ToMe-like) instead of dropping the worst ranked; on "
                             "the detail task it pools nothing and splits as --stack-share "
                             f"{_shares(merged['stack_share'])} (trained at {_shares(merged['stack_train_share'])}) "
                             "unless --stack-pool or --stack-share say otherwise, and --no-stack-merge stacks on "
                             f"{pooled['stack_pool']} x {pooled['stack_pool']} pooling, split "
                             f"{_shares(pooled['stack_share'])} (default: image {'on' if image.stack_merge else 'off'}, video "
                             f"{'on' if vid.stack_merge else 'off'}, detail {'on' if detail.stack_merge else 'off'})")
    parser.add_argument("--stacked", action=argparse.BooleanOptionalAction, default=None,
                        help="evaluate MoD stacked on pre-LLM reduction at every point (default: on)")
    parser.add_argument("--captions", action=argparse.BooleanOptionalAction, default=None,
                        help="a caption record (every object in words) beside each training sample "
                             "(default: image and detail off, video on)")
    parser.add_argument("--dense-tower", action=argparse.BooleanOptionalAction, default=None,
                        help="the dense stage trains the vision tower too (off: frozen as its pretraining left it) "
                             "(default: image and video on, detail off)")
    parser.add_argument("--no-distill", action="store_true",
                        help="MoD fine-tuning without distillation from the dense model (default: distill)")
    parser.add_argument("--dense-control", action="store_true",
                        help="also fine-tune the dense model exactly as the MoD stage (steps, lr, distillation), "
                             "unconverted: what the extra training alone gives (default: off; costs about the "
                             "MoD stage's time again)")
    parser.add_argument("--threads", type=threads, default=None,
                        help="torch threads, at most the machine's cores (default: torch's)")
    parser.add_argument("--reuse-dense", action="store_true",
                        help="keep the dense model of an earlier run in --out (same settings); rerun the MoD stages "
                             "(default: train it)")
    parser.add_argument("--reuse-trained", nargs="?", const=True, default=False, metavar="RUN,...",
                        help="with --reuse-dense: keep the fine-tunes of that run too (same settings) and only "
                             "evaluate again, e.g. after a baseline changed; or keep only those named among mod, "
                             "stack, dense-control (--reuse-trained mod trains the stacked stage again, e.g. with "
                             "another --stack-train-from) (default: train them)")
    parser.add_argument("--overwrite", action="store_true",
                        help="train everything again in an earlier recipe run's --out, replacing its models and "
                             "results (default: refuse a non-empty --out; one holding files the recipe did not make "
                             "is refused even so)")
    parser.add_argument("--isoflop", action="store_true",
                        help="image task: instead of the frontier, train MoD models from scratch (converted at step "
                             "0) for the dense stage's training FLOPs, at the MoD paper's setting (capacity 0.125, "
                             "every other layer) and at the recipe's 3x point (every layer but 0); writes isoflop.md / "
                             "isoflop.json (default: off)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=run_recipe_command)
    return parser


def default_out(task: str, isoflop: bool = False) -> str:
    """Where a recipe writes without --out: the isoFLOP check has a folder of its own, so it never
    trains over the frontier run's models."""
    return f"runs/synthetic-{task}" + ("-isoflop" if isoflop else "")


def run_recipe_command(args: argparse.Namespace) -> int:
    from vlmod.config import ROUTERS
    from vlmod.recipes.reuse import kept_fine_tunes

    # a name it does not know, or no --reuse-dense: refused before anything
    args.reuse_trained = kept_fine_tunes(args.reuse_trained, args.reuse_dense)

    overrides = {name: getattr(args, name) for name, _, _ in _FLAGS if getattr(args, name) is not None}
    if overrides.get("schedule") == "none":
        overrides["schedule"] = None
    elif overrides.get("schedule") not in (None, "cosine"):
        raise InputError(f"--schedule must be none or cosine, got {overrides['schedule']!r}")
    if args.targets is not None:
        overrides["targets"] = tuple(args.targets)
    if args.types is not None:
        overrides["types"] = args.types
    if args.layout is not None:
        overrides["layout"] = args.layout
    if args.mod_router is not None:
        overrides["mod_router"] = args.mod_router
    if args.routers is not None:
        bad = [r for r in args.routers if r not in ROUTERS or r in ("learned", "inverted")]
        if bad:
            raise InputError(f"--routers: unknown baseline(s) {bad}; choose from random, stride, attention, fastv")
        overrides["routers"] = tuple(args.routers)
    if args.threads is not None:
        overrides["threads"] = args.threads
    for flag in ("captions", "stacked", "dense_tower", "tower_solid", "question_first", "unaligned", "stack_merge"):
        if getattr(args, flag) is not None:
            overrides[flag] = getattr(args, flag)
    if args.no_distill:
        overrides["distill"] = False
    if args.dense_control:
        overrides["dense_control"] = True
    if args.image_model is not None:
        if args.task != "video":
            raise InputError("--image-model is for --task video (the image stage of the video recipe)")
        if not (Path(args.image_model).expanduser() / "config.json").is_file():
            raise InputError(f"--image-model {args.image_model} is not a checkpoint folder (no config.json)")
        overrides["image_model"] = str(Path(args.image_model).expanduser().resolve())
    if args.isoflop and args.task != "image":
        raise InputError("--isoflop is for --task image (the video recipe's dense model has four stages)")
    if args.seeds is not None and (args.seed is not None or args.isoflop):
        clash = "--seed" if args.seed is not None else "--isoflop"
        raise InputError(f"--seeds runs the frontier recipe once per seed: drop {clash}")
    if args.jobs != 1 and args.seeds is None:
        raise InputError("--jobs runs several seeds at once: give --seeds too (e.g. --seeds 0,1,2 --jobs 2)")
    if args.isoflop and (args.reuse_trained or args.dense_control):
        raise InputError("--isoflop trains its MoD models from scratch: drop --reuse-trained and --dense-control")
    settings = RecipeSettings.for_task(args.task, quick=args.quick, isoflop=args.isoflop, **overrides)
    if args.stack_share is not None:  # per target: it needs the targets, so after them (replace checks it again)
        # A split given here is also the one the stacked stage trains at, unless --stack-train-share says otherwise.
        settings = dataclasses.replace(settings, stack_share=stack_shares(args.stack_share, settings),
                                       stack_train_share=None)
    if args.stack_train_share is not None:
        settings = dataclasses.replace(settings, stack_train_share=stack_shares(args.stack_train_share, settings, True))
    if settings.stack_pool > 1 and (args.stack_share is not None or args.stack_train_share is not None):
        raise InputError(f"--stack-share splits each point between a reduction that drops tokens and MoD; with "
                         f"--stack-pool {settings.stack_pool} the reduction keeps every pooled window: give "
                         "--stack-pool 1 with --stack-share")
    if args.seeds is not None:
        return _run_seeds(args, settings)
    from vlmod.io.paths import check_output_dir
    from vlmod.recipes.reuse import check_recipe_out

    out = check_output_dir(args.out or default_out(args.task, args.isoflop), "--out")
    check_recipe_out(out, args.reuse_dense, args.overwrite)  # before the training stack loads
    from vlmod.recipes.reuse import run_again

    try:
        return _run(args, out, settings)
    except KeyboardInterrupt:  # the rerun that keeps the finished dense model names --reuse-dense
        print(f"error: interrupted (Ctrl-C); nothing was left half-written; {run_again(out)}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace, out: Path, settings: RecipeSettings) -> int:
    if args.isoflop:
        from vlmod.recipes.isoflop import run_isoflop

        run_isoflop(out, settings, progress=not args.no_progress, reuse_dense=args.reuse_dense,
                    overwrite=args.overwrite)
        print(f"results written to {out / 'isoflop.md'} and isoflop.json")
        return 0
    from vlmod.recipes.recipe import run_recipe  # the training stack loads when a recipe runs, not for --help

    run_recipe(out, settings, progress=not args.no_progress, reuse_dense=args.reuse_dense,
               reuse_trained=args.reuse_trained, overwrite=args.overwrite)
    print(f"results written to {out / 'results.md'}, results.json and frontier.png")
    return 0


def _run_seeds(args: argparse.Namespace, settings: RecipeSettings) -> int:
    """`--seeds`: every seed's run, then the table over them (`vlmod.recipes.seed_runs`)."""
    from vlmod.recipes.seed_runs import run_seeds, run_seeds_again

    out = Path(args.out or default_out(args.task) + "-seeds").expanduser()
    try:
        run_seeds(out, settings, args.seeds, progress=not args.no_progress, reuse_dense=args.reuse_dense,
                  reuse_trained=args.reuse_trained, overwrite=args.overwrite, jobs=args.jobs)
    except KeyboardInterrupt:
        print(f"error: interrupted (Ctrl-C); nothing was left half-written; {run_seeds_again(out, args.seeds)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"results over seeds {','.join(map(str, args.seeds))} written to {out / 'results.md'} and results.json; "
          f"each seed's in {out}/seed-N")
    return 0


__all__ = ["add_recipe_arguments", "add_recipe_parser", "default_out", "run_recipe_command", "seed_list", "share_at_target",
           "stack_shares"]
