"""`vlmod eval` / `scripts/evaluate.py`: accuracy against compute of a (converted) LLaVA model on
LLaVA-format QA data, optionally side by side with a second model (`vlmod.evaluation.evaluate`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vlmod.api import set_capacity, set_router
from vlmod.cli.argtypes import add_dtype_argument, device, fraction, non_negative_int, option, positive_int
from vlmod.cli.common import SubParsers, check_json_output, write_json_result
from vlmod.config import ROUTERS
from vlmod.data import DataError, load_records
from vlmod.evaluation import evaluate as ev  # looked up at call time: a test may replace a function
from vlmod.evaluation.latency import TIMING_RUNS
from vlmod.io.paths import check_not_among, not_found
from vlmod.tools.compile import maybe_compile


def add_eval_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod eval`: accuracy against compute, optionally side by side with a dense model."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate accuracy, answer loss, processed fraction, FLOPs and latency on LLaVA-format QA data",
        description="Evaluate a (converted) LLaVA model; --compare puts a second model (the dense original) "
        "side by side in one table.",
    )
    add_evaluate_arguments(p)
    p.set_defaults(model_flags=(("model", "--model"), ("compare", "--compare")))
    return p


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `scripts/evaluate.py` and `vlmod eval`."""
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id (dense or converted)")
    parser.add_argument("--capacity", type=fraction, default=None,
                        help="run --model's MoD layers at this mean capacity: another compute point of the same "
                             "converted weights (default: the capacity it was saved with)")
    parser.add_argument("--router", choices=ROUTERS, default=None,
                        help="select --model's MoD tokens with this router instead (the weights and gate as "
                             "trained): e.g. attention, training-free, or random as a control (default: the "
                             "router it was saved with)")
    parser.add_argument("--data", required=True, help="LLaVA-format JSON with the reference answers")
    parser.add_argument("--image-root", help="folder image/video paths are relative to (default: the JSON's folder)")
    parser.add_argument("--compare", help="a second model (e.g. the dense original) evaluated side by side")
    parser.add_argument("--name", help="label of --model in the table (default: its folder name)")
    parser.add_argument("--compare-name", help="label of --compare (default: its folder name)")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=16)
    option(parser, "--num-samples", aliases=("--limit",), dest="limit", type=positive_int, default=None,
           help="evaluate the first N records only (default: all)")
    parser.add_argument(
        "--device", type=device, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    add_dtype_argument(parser)
    parser.add_argument("--strict", action="store_true", help="a missing or corrupt image is an error, not a skip")
    parser.add_argument("--timing-runs", type=non_negative_int, default=TIMING_RUNS,
                        help="timed generate runs of each model on the first batch, a MoD model and the same "
                             f"weights dense interleaved, median shown; 0 = no latency (default: {TIMING_RUNS})")
    parser.add_argument("--compile", action="store_true",
                        help="decode compiled (vlmod.compile; the first batch of each shape compiles), the same "
                             "answers as eager (default: off)")
    parser.add_argument("--json", help="write the reports (every sample included) to this JSON file")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=run_evaluate)
    return parser


def run_evaluate(args: argparse.Namespace) -> int:
    """Evaluate --model (and --compare), print the table, write --json."""
    if not Path(args.data).expanduser().is_file():
        raise ev.EvalError(f"data file {args.data} {not_found(args.data)}")
    if args.json:
        check_json_output(args.json, inputs=[args.model, args.compare, args.data], error=ev.EvalError)
        try:
            records = load_records(args.data, args.image_root)
        except DataError as e:
            raise ev.EvalError(str(e)) from None
        media = [p for r in records for p in (*r.images, *([r.video_path] if r.video_path is not None else []))]
        check_not_among(args.json, "--json", media, ev.EvalError)
    for path in (args.model, args.compare):
        if path is not None:
            needs = [f for f, v in (("--capacity", args.capacity), ("--router", args.router)) if v is not None]
            ev.check_checkpoint(path, converted=needs[0] if needs and path == args.model else None)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    reports = []
    runs = [(path, label) for path, label in ((args.model, args.name), (args.compare, args.compare_name)) if path]
    for (path, label), default in zip(runs, ev.folder_labels([path for path, _ in runs]), strict=True):
        model, processor = ev.load_model(path, args.device, args.dtype)
        if args.router is not None and path == args.model:
            try:
                set_router(model, args.router)
            except ValueError as e:  # a family the attention router cannot score
                raise ev.EvalError(f"--router {args.router}: {e}") from None
        if args.capacity is not None and path == args.model:
            set_capacity(model, args.capacity)
        maybe_compile(model, args.compile, warn=lambda line: print(line, file=sys.stderr))
        reports.append(ev.evaluate(
            model, processor, args.data, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
            limit=args.limit, progress=not args.no_progress, name=label or default,
            image_root=args.image_root, strict=args.strict, timing_runs=args.timing_runs,
        ))
        del model
    print(ev.format_comparison(reports))
    if len(reports) == 2:
        print(ev.paired_gap_line(*reports))
    write_json_result(args.json, {"data": str(args.data), "reports": [r.to_dict() for r in reports]})
    return 0


__all__ = ["add_eval_parser", "add_evaluate_arguments", "run_evaluate"]
