"""`vlmod pretrain-tower`: a tiny LLaVA's vision tower learns what each patch of the synthetic images
shows before any language training (`vlmod.training.tower_pretrain`)."""

from __future__ import annotations

import argparse

from vlmod.cli.argtypes import positive_float, positive_int
from vlmod.cli.common import MODEL_FLAG, SubParsers
from vlmod.io.paths import check_output_dir
from vlmod.training.tower_pretrain import pretrain_tower


def add_pretrain_tower_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod pretrain-tower`: a tiny LLaVA's tower learns the synthetic scenes' patches first."""
    p = subparsers.add_parser(
        "pretrain-tower",
        help="pretrain a tiny LLaVA's vision tower on what each patch of the synthetic images shows",
        description="Train the vision tower to tell each patch's object (shape and colour, or background) on "
        "`vlmod data synthetic` images, as LLaVA starts from a pretrained CLIP; saves the whole LLaVA.",
    )
    add_pretrain_tower_arguments(p)
    p.set_defaults(model_flags=MODEL_FLAG)
    return p


def add_pretrain_tower_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `vlmod pretrain-tower` (the video recipe's first training stage, by hand)."""
    parser.add_argument("--model", required=True, help="LLaVA checkpoint whose tower to pretrain (e.g. `vlmod tiny`'s; required)")
    parser.add_argument("--data", required=True, help="synthetic image set (`vlmod data synthetic`'s train.json; required)")
    parser.add_argument("--out", required=True, help="folder for model/ (the whole LLaVA) and log.json (required)")
    parser.add_argument("--steps", type=positive_int, default=1500, help="training steps (default: 1500)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="images per step (default: 64)")
    parser.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (default: 0.002)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the head and the batches (default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (default: show it)")
    parser.set_defaults(run=run_pretrain_tower)
    return parser


def run_pretrain_tower(args: argparse.Namespace) -> int:
    """Pretrain the tower of --model on --data into --out and say how well its patches are told apart."""
    out = check_output_dir(args.out, "--out", inputs=[args.model, args.data])
    log = pretrain_tower(args.model, args.data, out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         seed=args.seed, progress=not args.no_progress)
    print(f"wrote {out / 'model'}: held-out patches' shape {100 * log['val_patch_shape_accuracy']:.1f}%, "
          f"colour {100 * log['val_patch_color_accuracy']:.1f}% ({log['seconds']:.0f} s)")
    return 0


__all__ = ["add_pretrain_tower_arguments", "add_pretrain_tower_parser", "run_pretrain_tower"]
