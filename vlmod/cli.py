"""The `vlmod` command. `scripts/*.py` are thin wrappers that call `main` with their subcommand.

Layout: every subcommand has a function that builds its parser (`add_<name>_parser(subparsers)`)
and sets `run=<function(args) -> int>` as its default; `COMMANDS` lists the top-level builders.
Adding a command (convert, rank, finetune, evaluate, demo, audit) or a benchmark (bench llava,
bench video) is one builder plus one run function, registered in `COMMANDS` or `BENCHMARKS`.

Bad input (an unknown model, a capacity outside (0, 1], a malformed flag) ends with a single
`error: ...` line on stderr and exit status 2, never a traceback. Errors past input validation
are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from vlmod.bench import InputError, bench_vit, format_vit_result, parse_layers, write_json

EXIT_USAGE = 2

SubParsers = Any  # argparse._SubParsersAction, which argparse does not export


class UsageError(Exception):
    """Bad input from the command line: reported as `error: <message>`, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a parse error is one `error: ...` line (argparse prints usage + message)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _capacity(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"capacity must be in (0, 1] (the fraction of routable tokens a MoD layer processes), got {text}"
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _layers(text: str) -> str | list[int]:
    try:
        return parse_layers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------- bench


def add_bench_vit_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench vit`: dense vs MoD images/s of a ViT image encoder against the FLOPs prediction."""
    p = subparsers.add_parser(
        "vit",
        help="dense vs MoD throughput of a timm / open_clip ViT",
        description="Measure images/s of a randomly initialised ViT and of its MoD conversion on one "
        "random batch (dense and MoD runs interleaved), and compare the measured speedup with "
        "the FLOPs prediction.",
    )
    p.add_argument(
        "--model", required=True, help="timm model name (vit_base_patch16_224) or open_clip name (ViT-B-16)"
    )
    p.add_argument(
        "--source", choices=("timm", "open_clip"), default="timm", help="model library (default: timm)"
    )
    p.add_argument("--batch", type=_positive_int, default=8, help="images per forward (default: 8)")
    p.add_argument(
        "--capacity",
        type=_capacity,
        default=0.125,
        help="fraction of patch tokens a MoD layer processes (default: 0.125)",
    )
    p.add_argument(
        "--layers",
        type=_layers,
        default="every_other",
        help="every_other | all | comma list of block indices (default: every_other)",
    )
    p.add_argument(
        "--image-size", type=_positive_int, default=None, help="input resolution (default: the model's)"
    )
    p.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=3,
        help="untimed forwards of each model first (default: 3)",
    )
    p.add_argument(
        "--repeats", type=_positive_int, default=10, help="timed forwards of each model (default: 10)"
    )
    p.add_argument(
        "--threads", type=_positive_int, default=None, help="torch intra-op threads (default: torch's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch (default: 0)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_bench_vit)
    return p


def run_bench_vit(args: argparse.Namespace) -> int:
    result = bench_vit(
        args.model,
        source=args.source,
        batch=args.batch,
        capacity=args.capacity,
        layers=args.layers,
        image_size=args.image_size,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(format_vit_result(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


# Benchmarks under `vlmod bench`; bench llava / bench video add their builders here.
BENCHMARKS: list[Callable[[SubParsers], argparse.ArgumentParser]] = [add_bench_vit_parser]


def add_bench_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench <benchmark>`."""
    p = subparsers.add_parser("bench", help="benchmarks: measured vs predicted MoD speedup")
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for add in BENCHMARKS:
        add(sub)
    return p


# ----------------------------------------------------------------------------- main

# Top-level subcommands; convert, rank, finetune, evaluate, demo and audit add their builders here.
COMMANDS: list[Callable[[SubParsers], argparse.ArgumentParser]] = [add_bench_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vlmod", description="Mixture-of-Depths routing for vision-language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `vlmod` command; returns the exit status (0, or 2 for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except (UsageError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
