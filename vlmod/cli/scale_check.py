"""`vlmod scale-check`: every stage as its own command on a checkpoint of the real 7B shapes, wall
time and peak memory each (`vlmod.recipes.scale_check`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmod.cli.argtypes import int_at_least
from vlmod.cli.common import SubParsers
from vlmod.models.scale import SHAPES
from vlmod.recipes.scale_check import STAGES, format_table, scale_check
from vlmod.recipes.scale_needs import MIN_LAYERS


def add_scale_check_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod scale-check`: every stage on a checkpoint of the real 7B shapes, memory and time each."""
    p = subparsers.add_parser(
        "scale-check",
        help="run every stage on a checkpoint of the real 7B shapes: wall time and peak memory each",
        description="Build a LLaVA-1.5-7B- or LLaVA-NeXT-Video-7B-shaped checkpoint (the real configs and "
        "processor shapes, random bfloat16 weights: 13.5 GB for 32 layers) and run each stage as its command in "
        "a process of its own: convert, load, rank, eval, lmms-eval, the demo with one request, router and "
        "LoRA fine-tunes, bench. Prints and writes a table (stage, wall time, peak RSS, checkpoint bytes, ratio).",
    )
    p.add_argument("--shape", choices=SHAPES, default=SHAPES[0], help=f"model shape (default: {SHAPES[0]})")
    p.add_argument("--workdir", default="scale-check",
                   help="folder for the checkpoints, data, logs and table (default: scale-check)")
    p.add_argument("--layers", type=int_at_least(MIN_LAYERS), default=32,
                   help=f"language layers, at least {MIN_LAYERS}: convert makes every other layer MoD, so one layer "
                   "has none to convert (default: 32, the real model; fewer for a quicker look)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of stages (default: {','.join(STAGES)})")
    p.add_argument("--keep", action="store_true", help="keep the fine-tuned models (default: delete each once measured)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_scale_check)
    return p


def run_scale_check(args: argparse.Namespace) -> int:
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    rows = scale_check(args.shape, args.workdir, layers=args.layers, stages=stages, keep=args.keep,
                       progress=not args.no_progress)
    print(format_table(rows))
    print(f"wrote {Path(args.workdir) / f'{args.shape}-{args.layers}' / 'scale_check.md'}")
    return 0 if all(r.returncode == 0 for r in rows) else 1


__all__ = ["add_scale_check_parser", "run_scale_check"]
