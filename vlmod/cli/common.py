"""What every command module of `vlmod` shares: the usage error, the exit status of bad input, the
flags that name a checkpoint, and the value types of `--capacity` / `--layers`."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vlmod.bench import parse_layers
from vlmod.cli.argtypes import add_dtype_argument, device, non_negative_int, positive_int, sdpa_order, threads
from vlmod.errors import InputError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
# Arguments that name a checkpoint (a local directory or a hub id), as (dest, flag): a command sets
# `model_flags` and `main` checks them before any work, so that a hub id off the network is one
# line within seconds (vlmod.io.paths.check_model_arg), not transformers' retry loop.
MODEL_FLAG = (("model", "--model"),)

SubParsers = Any  # argparse._SubParsersAction, which argparse does not export


class UsageError(Exception):
    """Bad input from the command line: reported as `error: <message>`, exit status 2."""


def capacity(text: str) -> float:
    """`--capacity`: the fraction of routable tokens a MoD layer processes, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"capacity must be in (0, 1] (the fraction of routable tokens a MoD layer processes), got {text}"
        )
    return value


def layers(text: str) -> str | list[int]:
    """`--layers`: every_other | all | a comma list of block indices."""
    try:
        return parse_layers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def write_output(path: str | Path, flag: str, write: Callable[[Path], Any]) -> Path:
    """`write(path)`, the command's output file, with what a full disk (or a folder gone read-only)
    does turned into one line: the writers are atomic, so nothing half-written is left at `path`,
    and the output is written to the temp folder instead when it can be, so an hour of work is not
    lost for want of space. Returns the path written."""
    from safetensors import SafetensorError

    target = Path(path).expanduser()
    try:
        write(target)
        return target
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
    fallback = Path(tempfile.gettempdir()) / f"vlmod-{os.getpid()}-{target.name}"
    try:
        write(fallback)
        kept = f"it was written to {fallback} instead"
    except (OSError, SafetensorError):
        kept = "nothing was written"
    raise UsageError(f"could not write {flag} {path}: {reason}; {kept} (free space or choose another {flag})")


def check_json_output(path: str | None, inputs: Iterable[str | os.PathLike[str] | None] = (),
                      error: type[Exception] = InputError) -> None:
    """`--json PATH`, checked before any work by the rule every command's --json follows
    (`vlmod.io.paths.check_output_file`): a file, not a folder; creatable and writable; neither an
    input (a model folder, a data file, a video) nor inside one. Nothing without the flag."""
    if path:
        from vlmod.io.paths import check_output_file

        check_output_file(path, "--json", inputs=inputs, error=error)


def write_json_result(path: str | None, data: Any) -> None:
    """`--json PATH`: write the command's result there and say so (nothing without the flag)."""
    if path:
        from vlmod.io.files import write_json

        write_output(path, "--json", lambda target: write_json(target, data))
        print(f"wrote {path}")


__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "MODEL_FLAG", "SubParsers", "UsageError", "capacity", "check_json_output",
           "layers", "write_json_result", "write_output"]


def add_timing_arguments(p: argparse.ArgumentParser, warmup: int, repeats: int, warmup_help: str | None = None) -> None:
    """The flags every benchmark times with: warm-up, repeats, threads, --json, --no-progress."""
    p.add_argument("--warmup", type=non_negative_int, default=warmup,
                   help=f"{warmup_help or 'untimed runs first'} (default: {warmup})")
    p.add_argument("--repeats", type=positive_int, default=repeats, help=f"timed runs (default: {repeats})")
    p.add_argument("--threads", type=threads, default=None,
                   help="torch intra-op threads, at most the machine's cores (default: torch's)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_device_arguments(p: argparse.ArgumentParser, auto: str, what: str = "weights dtype") -> None:
    """`--device` and `--dtype` of a benchmark: where both models run, in what dtype."""
    p.add_argument(
        "--device", type=device, default="cpu",
        help="torch device both models run on; on a GPU every timing waits for its kernels (default: cpu)",
    )
    add_dtype_argument(p).help = f"{what}: auto is {auto} (default: auto)"
    p.add_argument(
        "--sdpa-priority", type=sdpa_order, default=None, metavar="LIST",
        help="order in which torch's scaled_dot_product_attention tries its GPU kernels, e.g. "
        "flash,efficient,cudnn,math (flash before cuDNN, whose kernel costs about 1.2 ms of host time a call on an "
        "H200) (default: torch's own order)",
    )


def under_sdpa_priority(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A benchmark's run function, with its `--sdpa-priority` (`add_device_arguments`) in force."""
    import functools

    from vlmod.bench.timing import sdpa_priority

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        with sdpa_priority(getattr(args, "sdpa_priority", None)):
            return run(args)

    return wrapped
