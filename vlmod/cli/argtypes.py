"""argparse value types shared by every command: one wording for the same mistake everywhere."""

from __future__ import annotations

import argparse
import copy
import math
import re
from collections.abc import Callable
from typing import Any


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for integers >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def fraction(text: str) -> float:
    """A number in (0, 1]: capacities, thresholds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def finite_float(text: str) -> float:
    """Any finite number (not nan, not inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0: sizes in MB, epochs, learning rates."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def share(text: str) -> float:
    """A number in [0, 1]: a share of items (`fraction` with 0 allowed)."""
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0: warm-ups, weights that may be switched off."""
    value = finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def threads(text: str) -> int:
    """torch threads, 1 to the machine's cores: more only contend for the same cores (512 on 2 cores
    ran, slower, with no word)."""
    from vlmod.bench.timing import available_cores  # torch: only once a --threads is read

    value, cores = positive_int(text), available_cores()
    if value > cores:
        raise argparse.ArgumentTypeError(f"expected at most {cores} (this machine's cores), got {value}")
    return value


def byte_size(text: str) -> int | str:
    """A size > 0 as save_pretrained reads it: bytes (5000000000) or a number with KB, MB, GB or TB
    (5GB, 500MB); returned as save_pretrained takes it (int bytes, or the text)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)?\s*", text, flags=re.IGNORECASE)
    if match is None or not float(match.group(1)) > 0 or not (match.group(2) or match.group(1).isdigit()):
        raise argparse.ArgumentTypeError(f"expected a size > 0 such as 5GB, 500MB or a number of bytes, got {text!r}")
    return text.strip() if match.group(2) else int(match.group(1))


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    value = int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in 1-65535, got {value}")
    return value


def sdpa_order(text: str) -> str:
    """A comma list of SDPA backends (vlmod.bench.timing.SDPA_BACKENDS), checked."""
    from vlmod.bench.timing import SDPA_BACKENDS

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown SDPA backend {', '.join(unknown) or '(none given)'}; use a comma list of {', '.join(SDPA_BACKENDS)}"
        )
    return ",".join(names)


def device(text: str) -> str:
    """A torch device that exists on this machine and vlmod runs on (cpu, cuda, mps): a name torch
    does not know, cuda / mps when torch sees none, and the devices torch knows but vlmod does not
    run on (meta, xpu, ...) are an error here rather than a traceback after the model loaded."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"--device {text}: not a torch device; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"--device {text}: this machine has no CUDA GPU torch can use; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s) (cuda:0..)"
            )
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise argparse.ArgumentTypeError(f"--device {text}: MPS is not available on this machine; use cpu")
    elif dev.type == "meta":  # torch knows it, and a model loads there, but nothing computes: a deep traceback later
        raise argparse.ArgumentTypeError(f"--device {text}: the meta device holds shapes, not values, so no model "
                                         "runs on it; use cpu, cuda or mps")
    elif dev.type not in ("cpu", "cuda", "mps"):  # xpu, hpu, ...: vlmod runs on none of them
        raise argparse.ArgumentTypeError(f"--device {text}: vlmod runs on cpu, cuda and mps, not {dev.type}; use one "
                                         "of those")
    return text


# ----------------------------------------------------------------------------- one vocabulary, defaults shown


class HelpFormatter(argparse.HelpFormatter):
    """The help of every vlmod command: each option shows its default (`(default: ...)` is added
    unless the help already says it; `not set` for None), and the old spellings kept as hidden
    aliases (`option(..., aliases=...)`) are not listed."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            text == argparse.SUPPRESS or "default" in text or not action.option_strings
            or action.default is argparse.SUPPRESS or action.nargs == 0 or action.required
        ):
            return text
        shown = "not set" if action.default is None else "%(default)s"
        if isinstance(action.default, (list, tuple)):
            shown = " ".join(map(str, action.default)) or "none"
        return f"{text} (default: {shown})".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings:  # argparse shows nothing for an option without help
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        hidden = getattr(action, "hidden_aliases", ())
        if not hidden:
            return super()._format_action_invocation(action)
        shown = argparse.Action(
            [s for s in action.option_strings if s not in hidden], action.dest, nargs=action.nargs,
            choices=action.choices, metavar=action.metavar,
        )
        return super()._format_action_invocation(shown)


def add_dtype_argument(parser: argparse.ArgumentParser | Any, default: str | None = "auto") -> argparse.Action:
    """`--dtype`, the same for every command that loads a model: "auto" keeps the checkpoint's
    own dtype (a bfloat16 7B stays 13.5 GB); the others cast while loading. default None lets a
    YAML config fill it (the command's own default is still auto)."""
    from vlmod.config import DTYPES

    return parser.add_argument(
        "--dtype", choices=DTYPES, default=default,
        help="weights dtype: auto keeps the checkpoint's own (default: auto)",
    )


def option(
    parser: argparse.ArgumentParser | Any, name: str, *, aliases: tuple[str, ...] = (), **kwargs: Any
) -> argparse.Action:
    """`parser.add_argument(name, *aliases, **kwargs)` with `aliases` (old spellings that still
    work) left out of `--help` by `HelpFormatter`. The destination is named after `name` unless
    `dest` is given."""
    if "dest" in kwargs and not {"action", "choices", "metavar"} & set(kwargs):
        kwargs["metavar"] = name.lstrip("-").upper().replace("-", "_")  # named after the flag shown, not dest
    action = parser.add_argument(name, *aliases, **kwargs)
    action.hidden_aliases = frozenset(aliases)  # type: ignore[attr-defined]
    return action
