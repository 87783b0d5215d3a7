"""`vlmod data synthetic` / `scripts/make_synthetic_data.py`: write the synthetic shapes set
(`vlmod.data.synthetic`), by default the sets the recipes train on."""

from __future__ import annotations

import argparse
import sys

from vlmod.cli.argtypes import non_negative_int, share
from vlmod.cli.common import SubParsers
from vlmod.data.scenes import IMAGE_QUESTION_TYPES, MAX_DISTRACTORS, MIN_IMAGE_SIZE
from vlmod.data.synthetic import FAINT_CONTRAST, generate
from vlmod.io.paths import check_new_dir
from vlmod.recipes.settings import RecipeSettings


def add_data_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod data synthetic`: write the synthetic image-text set."""
    p = subparsers.add_parser("data", help="make datasets (the synthetic shapes set)",
                              description="Write datasets vlmod can generate itself.")
    sets = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    synthetic = sets.add_parser(
        "synthetic",
        help="coloured shapes on textured backgrounds, with colour / shape / count / position questions",
        description="Write the deterministic synthetic LLaVA-format QA set (and its video variant).",
    )
    add_make_data_arguments(synthetic)
    return p


def add_make_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `scripts/make_synthetic_data.py` (and `vlmod data synthetic`); sets
    `run=run_make_data` as default. The defaults are the sets the recipes train on
    (`vlmod.recipes.recipe.RecipeSettings`: the image task's images, the video task's clips)."""
    image, video = RecipeSettings.for_task("image"), RecipeSettings.for_task("video")
    parser.add_argument("--out", default="data/synthetic", help="output folder (default: data/synthetic)")
    parser.add_argument("--train", type=non_negative_int, default=image.num_train,
                        help=f"train images (default: {image.num_train}, the image recipe's)")
    parser.add_argument("--val", type=non_negative_int, default=image.num_val,
                        help=f"validation images (default: {image.num_val}, the image recipe's)")
    parser.add_argument(
        "--image-size", type=int, default=image.image_size,
        help=f"image side in px, >= {MIN_IMAGE_SIZE} (default: {image.image_size}, the recipes')",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed; the same seed writes the same bytes (default: 0)")
    parser.add_argument(
        "--types",
        default=",".join(IMAGE_QUESTION_TYPES),
        help=f"comma-separated image question types (default: {','.join(IMAGE_QUESTION_TYPES)})",
    )
    parser.add_argument(
        "--distractors",
        type=non_negative_int,
        default=image.distractors,
        help=f"at most this many extra shapes in colour/shape/position images, 0..{MAX_DISTRACTORS} "
        f"(default: {image.distractors}, the image recipe's: one shape per image; 2 makes a harder set)",
    )
    parser.add_argument("--faint", type=share, default=image.faint,
                        help=f"the share of the colour, count and position pictures whose shapes are drawn faint (shape "
                             f"questions stay solid), at a contrast uniform in "
                             f"{FAINT_CONTRAST[0]:g}-{FAINT_CONTRAST[1]:g} (default: {image.faint:g}, the image "
                             "recipe's; the clips draw their own fifth)")
    parser.add_argument("--video", action="store_true", help="also write the video set (video_train/val.json)")
    parser.add_argument("--videos", type=non_negative_int, default=video.num_train,
                        help=f"train videos (default: {video.num_train}, the video recipe's)")
    parser.add_argument(
        "--val-videos", type=non_negative_int, default=None,
        help=f"validation videos (default: {video.num_val}, the video recipe's, with the default --videos; "
        "else a tenth of --videos)",
    )
    parser.add_argument("--frames", type=int, default=video.frames, help=f"frames per video (default: {video.frames})")
    parser.add_argument("--captions", action="store_true",
                        help="also a caption record per training sample, every object in words (the video recipe's "
                             "training sets have them; default: off)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out, replacing the set's files of the same names (the "
                             "*.json files, meta.json, images/ and videos/; anything else is left as it is) (default: "
                             "refuse a non-empty --out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_make_data)
    return parser


def run_make_data(args: argparse.Namespace) -> int:
    """Generate the set from parsed flags and print what was written; bad values are one
    `error:` line and exit status 2."""
    video = RecipeSettings.for_task("video")
    if args.val_videos is None and args.videos == video.num_train:
        args.val_videos = video.num_val  # the video recipe's set
    try:
        check_new_dir(args.out, "--out", overwrite=args.overwrite,
                      fix="pass --overwrite to write the set over what it holds, or choose a new --out")
        summary = generate(
            args.out,
            args.train,
            args.val,
            image_size=args.image_size,
            seed=args.seed,
            video=args.video,
            num_videos=args.videos,
            num_val_videos=args.val_videos,
            num_frames=args.frames,
            distractors=args.distractors,
            captions=args.captions,
            faint=args.faint,
            question_types=[t.strip() for t in args.types.split(",") if t.strip()],
            progress=not args.no_progress,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.describe())
    return 0


__all__ = ["add_data_parser", "add_make_data_arguments", "run_make_data"]
