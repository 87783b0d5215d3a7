"""`vlmod audit` / `scripts/audit_routing.py`: the router audit of a converted checkpoint
(`vlmod.evaluation.audit`), printed, as JSON and as PNG plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vlmod.api import mod_layers
from vlmod.cli.argtypes import add_dtype_argument, device, option, positive_int
from vlmod.cli.common import MODEL_FLAG, SubParsers, check_json_output, write_json_result
from vlmod.data import DataError
from vlmod.errors import InputError
from vlmod.evaluation.audit import AUDIT_ROUTERS, audit, format_report, plot
from vlmod.evaluation.evaluate import check_checkpoint
from vlmod.io.paths import check_output_dir, not_found


class AuditInputError(InputError):
    """Bad input to `vlmod audit`: one `error:` line, exit status 2."""


def add_audit_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod audit`: learned routing against counterfactual and training-free routers."""
    p = subparsers.add_parser(
        "audit",
        help="compare the learned router with inverted / random / stride / attention routing",
        description="With the weights fixed, swap the router of a converted model at inference and report "
        "accuracy and answer loss for each, the cross-layer Jaccard agreement of processed tokens, compute "
        "by token position and type, PNG plots and a written verdict.",
    )
    add_audit_arguments(p)
    p.set_defaults(model_flags=MODEL_FLAG)
    return p


def add_audit_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `vlmod audit` and `scripts/audit_routing.py`; sets `run=run_audit`."""
    parser.add_argument("--model", required=True, help="converted checkpoint directory (vlmod convert / finetune)")
    parser.add_argument("--data", required=True, help="LLaVA-format eval JSON (e.g. the synthetic set's val.json)")
    parser.add_argument(
        "--routers", default=",".join(AUDIT_ROUTERS),
        help=f"comma list of routers to compare (default: {','.join(AUDIT_ROUTERS)})",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per batch (default: 8)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16, help="answer length (default: 16)")
    option(parser, "--num-samples", aliases=("--limit",), dest="limit", type=positive_int, default=None,
           help="audit the first N samples only (default: all)")
    parser.add_argument(
        "--seed", type=int, default=0,
        help="torch.manual_seed before each router's evaluation and trace: seeds the random router unless "
        "the checkpoint's MoD config sets its own `seed`, which then wins (default: 0)",
    )
    parser.add_argument(
        "--device", type=device, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    add_dtype_argument(parser)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the full report as JSON")
    parser.add_argument("--plots", metavar="DIR", default=None, help="write PNG plots (Jaccard, compute by position)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=run_audit)
    return parser


def run_audit(args: argparse.Namespace) -> int:
    """Load, audit, print, write JSON and plots; bad input is one `error:` line and status 2."""
    try:
        return _run_audit(args)
    except InputError as e:  # AuditInputError, and EvalError from vlmod.evaluation.evaluate
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_audit(args: argparse.Namespace) -> int:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in AUDIT_ROUTERS]
    if unknown or not routers:
        raise AuditInputError(f"--routers: unknown {unknown or routers}; choose from {','.join(AUDIT_ROUTERS)}")
    if not Path(args.model).is_dir():
        raise AuditInputError(f"--model {args.model} is not a directory")
    if not Path(args.data).is_file():
        raise AuditInputError(f"--data {args.data} {not_found(args.data)}")
    check_json_output(args.json, inputs=[args.model, args.data], error=AuditInputError)
    if args.plots:
        check_output_dir(args.plots, "--plots", inputs=[args.model, args.data], error=AuditInputError)
    check_checkpoint(str(args.model))  # EvalError (an InputError) unless a LLaVA checkpoint
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise AuditInputError(f"--device {args.device}: {str(e).splitlines()[0]}") from None
    from vlmod.io.hf import load_vlm, loading_kwargs

    try:  # one line for a damaged / foreign checkpoint, NaN weights, a malformed vlmod section
        model, processor = load_vlm(
            str(args.model), AuditInputError, "the audit supports", **loading_kwargs(args.dtype, device)
        )
    except (OSError, TypeError) as e:
        raise AuditInputError(f"cannot load {args.model}: {str(e).splitlines()[0]}") from None
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as e:  # no such device / torch built without it
        raise AuditInputError(f"--device {args.device}: {str(e).splitlines()[0]}") from None
    if not mod_layers(model):
        raise AuditInputError(f"{args.model} has no MoD layers: convert it first (vlmod convert)")
    try:
        report = audit(
            model, processor, args.data, routers=routers, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, limit=args.limit, seed=args.seed, progress=not args.no_progress,
        )
    except DataError as e:
        raise AuditInputError(str(e)) from None
    report["model"] = str(args.model)
    if args.plots:
        report["plots"] = [str(p) for p in plot(report["routing"], args.plots)]
    print(format_report(report))
    write_json_result(args.json, report)
    for path in report.get("plots", []):
        print(f"wrote {path}")
    return 0


__all__ = ["AuditInputError", "add_audit_arguments", "add_audit_parser", "run_audit"]
