"""`vlmod rank`: calibrate a checkpoint, suggest the layers to convert, write the ranks as JSON
(and a plot). The metric is `vlmod.tools.arank`, the measuring `vlmod.tools.calibrate`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vlmod.cli.argtypes import add_dtype_argument, fraction, non_negative_int, option, positive_int
from vlmod.cli.argtypes import device as device_type
from vlmod.cli.common import EXIT_USAGE, MODEL_FLAG, SubParsers, UsageError, check_json_output, write_output
from vlmod.config import MoDConfig
from vlmod.data.calibration import CalibrationSample, calibration_batches, calibration_samples
from vlmod.data.llava_format import DataError
from vlmod.io.hf import max_positions
from vlmod.tools.arank import check_selection, format_ranks, plot_ranks
from vlmod.tools.calibrate import RankInputError, load_model, rank_layers

# ----------------------------------------------------------------------------- plot


# ----------------------------------------------------------------------------- command line


def add_rank_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod rank`: ARank of each layer, and the layers it suggests converting."""
    p = subparsers.add_parser(
        "rank",
        help="rank layers by the rank of their attention maps (ARank)",
        description="Calibrate a model on real inputs and rank its layers by attention-map rank: low rank "
        "means redundant, a good layer to convert.",
    )
    add_rank_arguments(p)
    p.set_defaults(run=run_rank, model_flags=MODEL_FLAG)
    return p


def add_rank_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `vlmod rank` / `scripts/rank_layers.py`; sets `run=run_rank` as default."""
    parser.add_argument("--model", required=True, help="LLaVA checkpoint directory (or hub id)")
    parser.add_argument(
        "--data",
        required=True,
        help="LLaVA-format JSON (list of records with image + conversations), or a folder of images "
        "(then --prompt is the question asked about each)",
    )
    parser.add_argument(
        "--image-root",
        default=None,
        help="folder the JSON's image paths are relative to (default: the JSON's folder)",
    )
    parser.add_argument(
        "--prompt",
        default=None,
        help="question for a folder of images; with a JSON it replaces each record's question",
    )
    parser.add_argument(
        "--num-samples", type=positive_int, default=64, help="calibration samples (default: 64)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=4, help="samples per forward (default: 4)"
    )
    option(parser, "--json", aliases=("--out",), dest="out", default="ranks.json", metavar="PATH",
           help="where to write the ranks (default: ranks.json)")
    option(parser, "--plots", aliases=("--plot",), dest="plot", default=None, metavar="PATH",
           help="also draw the ranks per layer: a folder (ranks.png goes there) or a .png file (needs matplotlib)")
    parser.add_argument(
        "--part",
        choices=("language", "vision"),
        default="language",
        help="model part to rank (default: language)",
    )
    parser.add_argument(
        "--select",
        type=positive_int,
        default=None,
        metavar="N",
        help="suggest the N lowest-rank layers (default: half the layers, as many as layers=every_other)",
    )
    parser.add_argument(
        "--threshold",
        type=fraction,
        default=None,
        help="suggest only layers with normalised rank (rank / tokens) <= this; --select then caps the count",
    )
    parser.add_argument(
        "--keep-first",
        type=non_negative_int,
        default=0,
        help="first K layers stay dense (LLaVA language: >= 1)",
    )
    parser.add_argument("--keep-last", type=non_negative_int, default=0, help="last K layers stay dense")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample order (default: 0)")
    parser.add_argument(
        "--device", type=device_type, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    add_dtype_argument(parser)  # the SVDs run in float32 whatever the model's dtype
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_rank)
    return parser


def run_rank(args: argparse.Namespace) -> int:
    """Calibrate, select, write JSON (and PNG); bad input is one `error:` line and status 2."""
    try:
        return _run_rank(args)
    except (DataError, RankInputError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _check_lengths(samples: list[CalibrationSample], processor: Any, positions: int | None) -> None:
    """RankInputError when a sample's question is more tokens than the model has positions, before
    any calibration; only a question of more UTF-8 bytes than that is tokenized (a token covers at
    least one byte)."""
    if positions is None:
        return
    tokenizer = getattr(processor, "tokenizer", processor)
    for sample in samples:
        if len(sample.text.encode("utf-8")) > positions:
            tokens = len(tokenizer(sample.text, add_special_tokens=False)["input_ids"])
            if tokens > positions:
                raise RankInputError(
                    f"sample {sample.id!r}: its question is {tokens:,} tokens, more than the model's {positions:,} "
                    "positions; shorten it or leave the record out"
                )


def _run_rank(args: argparse.Namespace) -> int:
    from vlmod.plugins import find_plugin

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RankInputError("--plots needs matplotlib: pip install matplotlib") from None
    model_path = Path(args.model).expanduser()
    if str(args.model).startswith((".", "/", "~")) and not model_path.exists():
        raise RankInputError(f"model path {args.model} does not exist")
    from vlmod.io.paths import check_not_among, check_output_file

    check_json_output(args.out, inputs=[args.model, args.data], error=RankInputError)
    if args.plot and not str(args.plot).lower().endswith(".png"):
        args.plot = str(Path(args.plot) / "ranks.png")  # --plots DIR, as audit's
    if args.plot:
        check_output_file(args.plot, "--plots", inputs=[args.model, args.data], error=RankInputError)
    samples = calibration_samples(args.data, image_root=args.image_root, prompt=args.prompt)
    media = [p for s in samples for p in (*s.images, *([s.video] if s.video is not None else []))]
    for path, flag in ((args.out, "--json"), (args.plot, "--plots")):
        if path:
            check_not_among(path, flag, media, RankInputError)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from transformers.utils import logging as hf_logging

    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    if args.no_progress:
        hf_logging.disable_progress_bar()
    try:
        model, processor = load_model(args.model, device, args.dtype)
    finally:
        if args.no_progress and not bars_were_off:
            hf_logging.enable_progress_bar()

    _check_lengths(samples, processor, max_positions(model))
    try:
        spec = find_plugin(model).part_spec(model, args.part, MoDConfig())
    except ValueError as e:  # a part this family cannot route (Qwen's packed vision tower)
        raise RankInputError(str(e)) from None
    num_layers = len(spec.blocks)
    try:
        check_selection(num_layers, args.select, args.threshold, args.keep_first, args.keep_last)
    except ValueError as e:
        raise RankInputError(str(e)) from None

    batches = calibration_batches(
        processor,
        samples,
        batch_size=args.batch_size,
        num_samples=args.num_samples,
        seed=args.seed,
    )
    start = time.perf_counter()
    ranks = rank_layers(model, batches, part=args.part, progress=not args.no_progress, total=batches.total)
    seconds = time.perf_counter() - start

    n = args.select
    try:
        if n is None and args.threshold is None:
            # Default: as many layers as layers="every_other" would convert.
            candidates = ranks.select(keep_first=args.keep_first, keep_last=args.keep_last)
            suggested = candidates[: max(num_layers // 2, 1)]
            n = len(suggested)
        else:
            suggested = ranks.select(
                n=n, threshold=args.threshold, keep_first=args.keep_first, keep_last=args.keep_last
            )
    except ValueError as e:
        raise RankInputError(str(e)) from None
    ranks.suggested = suggested
    ranks.meta = {
        "model": str(args.model),
        "data": str(args.data),
        "prompt": args.prompt,
        "num_samples_requested": args.num_samples,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "skipped_samples": len(batches.skipped),
        "selection": {
            "n": n,
            "threshold": args.threshold,
            "keep_first": args.keep_first,
            "keep_last": args.keep_last,
        },
        "device": str(device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "seconds": round(seconds, 3),
    }
    print(format_ranks(ranks))  # first: a failed write below still leaves the ranks on screen
    out = write_output(args.out, "--json", ranks.to_json)
    print(f"{ranks.num_samples} samples in {seconds:.1f} s ({len(batches.skipped)} skipped); wrote {out}")
    if args.plot:
        print(f"wrote {write_output(args.plot, '--plots', lambda path: plot_ranks(ranks, path))}")
    return 0


__all__ = ["add_rank_arguments", "add_rank_parser", "run_rank"]
