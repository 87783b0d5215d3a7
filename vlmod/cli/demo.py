"""`vlmod demo`: the web demo (needs the `demo` extra)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from vlmod.cli.argtypes import device, int_at_least, non_negative_int, port, positive_float, positive_int
from vlmod.cli.common import SubParsers, UsageError

# The most one request may ask for: each is per-request work on the server (a million timing runs
# wedged it for hours), so a flag above these is refused at start, in one line.
MOST = {"--timing-runs": 50, "--max-new-tokens": 512, "--frames": 64, "--max-upload-mb": 1024}


def at_most(flag: str, minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer from `minimum` to MOST[flag]."""
    at_least, most = int_at_least(minimum), MOST[flag]

    def parse(text: str) -> int:
        try:
            value = at_least(text)
        except argparse.ArgumentTypeError:
            value = None
        if value is None or value > most:
            raise argparse.ArgumentTypeError(f"expected an integer from {minimum} to {most}, got {text!r}")
        return value

    return parse


def upload_mb(text: str) -> float:
    """An argparse type: megabytes above 0 and at most MOST["--max-upload-mb"]."""
    value = positive_float(text)
    if value > MOST["--max-upload-mb"]:
        raise argparse.ArgumentTypeError(f"expected a number of MB above 0 and at most {MOST['--max-upload-mb']}, "
                                         f"got {text!r}")
    return value


def add_demo_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod demo`: the web demo (needs the `demo` extra)."""
    p = subparsers.add_parser(
        "demo",
        help="web demo: which vision tokens each MoD layer runs, on your images and videos",
        description="Serve the vlmod web demo: upload an image or a video (or pick an example), ask a "
        "question, and see per patch how many MoD layers ran each vision token. Without --model it "
        "serves the embedded tiny model trained on the synthetic set.",
    )
    p.add_argument("--model", default=None, help="converted checkpoint directory or hub id (default: the embedded demo model)")
    p.add_argument("--dense", default=None, help="dense checkpoint (directory or hub id) to compare answers and "
                   "latency with (default: the embedded dense model when --model is not given)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default: 8000)")
    p.add_argument("--max-upload-mb", type=upload_mb, default=25.0,
                   help=f"largest upload in MB, at most {MOST['--max-upload-mb']} (default: 25)")
    p.add_argument(
        "--max-active", type=positive_int, default=2,
        help="requests decoding / running at once; bounds memory (default: 2)",
    )
    p.add_argument(
        "--max-waiting", type=non_negative_int, default=8,
        help="requests queued for a turn; more get 503 (default: 8)",
    )
    p.add_argument("--max-new-tokens", type=at_most("--max-new-tokens", 1), default=16,
                   help=f"answer length in tokens, at most {MOST['--max-new-tokens']} (default: 16)")
    p.add_argument("--frames", type=at_most("--frames", 1), default=8,
                   help=f"frames sampled from a video, at most {MOST['--frames']} (default: 8)")
    p.add_argument("--device", type=device, default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    # vlmod.demo.latency.TIMING_RUNS (not imported here: the demo's server stack loads on `vlmod demo` only)
    p.add_argument("--timing-runs", type=at_most("--timing-runs", 0), default=5, help="timed generates per model "
                   "per request, MoD and dense interleaved: time to first token and decode per token shown apart, "
                   f"medians with their interval; 0 = no latency, at most {MOST['--timing-runs']} (default: 5)")
    p.add_argument("--compile", action="store_true", help="both models decode compiled (vlmod.compile), compiled "
                   "before the first request; a family that cannot compile says why and runs eager (default: off)")
    p.set_defaults(run=run_demo, model_flags=(("model", "--model"), ("dense", "--dense")))
    return p


def run_demo(args: argparse.Namespace) -> int:
    try:
        from vlmod.demo.app import DemoSetupError
        from vlmod.demo.serve import serve
    except ImportError as e:
        raise UsageError(f"the demo needs its extra: pip install 'vlmod[demo]' ({e})") from None
    try:
        serve(
            args.model, args.dense, host=args.host, port=args.port, max_upload_mb=args.max_upload_mb,
            max_new_tokens=args.max_new_tokens, num_frames=args.frames, device=args.device,
            max_active=args.max_active, max_waiting=args.max_waiting, timing_runs=args.timing_runs,
            compile=args.compile,
        )
    except (DemoSetupError, FileNotFoundError, TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    return 0


__all__ = ["add_demo_parser", "run_demo"]
