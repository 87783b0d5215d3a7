"""The `vlmod` command. `scripts/*.py` are thin wrappers that call `main` with their subcommand.

Layout: one module per command group in `vlmod/cli/` (convert, rank, bench, finetune, eval, audit,
demo, recipe, data, tiny, pretrain_tower, scale_check). Each has `add_<name>_parser(subparsers)`,
which builds its parser and sets `run=<function(args) -> int>` (and `model_flags`, the flags that
name a checkpoint) as defaults; `COMMANDS` lists them. Adding a command is one module plus one
entry in `COMMANDS`. The flags' value types, shared by every command, are in `vlmod.cli.argtypes`.

Bad input (an unknown model, a capacity outside (0, 1], a malformed flag) ends with a single
`error: ...` line on stderr and exit status 2, never a traceback; Ctrl-C with one line and status
130, as a shell reports an interrupted command. Errors past input validation
are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from vlmod.cli.argtypes import HelpFormatter
from vlmod.cli.audit import add_audit_parser
from vlmod.cli.bench import add_bench_parser
from vlmod.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, MODEL_FLAG, SubParsers, UsageError
from vlmod.cli.convert import add_convert_parser
from vlmod.cli.data import add_data_parser
from vlmod.cli.demo import add_demo_parser
from vlmod.cli.eval import add_eval_parser
from vlmod.cli.finetune import add_finetune_parser
from vlmod.cli.pretrain_tower import add_pretrain_tower_parser
from vlmod.cli.rank import add_rank_parser
from vlmod.cli.recipe import add_recipe_parser
from vlmod.cli.scale_check import add_scale_check_parser
from vlmod.cli.tiny import add_tiny_parser
from vlmod.errors import InputError
from vlmod.io.paths import check_model_arg

# Top-level subcommands, in the order `vlmod --help` lists them.
COMMANDS: list[Callable[[SubParsers], argparse.ArgumentParser]] = [
    add_convert_parser, add_rank_parser, add_bench_parser, add_finetune_parser, add_eval_parser,
    add_audit_parser, add_demo_parser, add_recipe_parser, add_data_parser, add_tiny_parser,
    add_pretrain_tower_parser, add_scale_check_parser,
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a parse error is one `error: ...` line (argparse prints usage + message), and
    every `--help` shows the defaults and hides the old spellings (`vlmod.cli.argtypes.HelpFormatter`).
    Subcommand parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")

    def _parse_optional(self, arg_string: str) -> Any:
        # "-5GB", "-1e-3": a (bad) value of the flag before it, which that flag's type then refuses in its
        # own words; argparse took it for an unknown flag ("expected one argument").
        if re.fullmatch(r"-\.?\d[\w.+-]*", arg_string):
            return None
        return super()._parse_optional(arg_string)


def build_parser() -> argparse.ArgumentParser:
    """The `vlmod` parser with every subcommand of `COMMANDS`."""
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
        for dest, flag in getattr(args, "model_flags", ()):
            check_model_arg(getattr(args, dest, None), flag)
        return args.run(args)
    except (UsageError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Outputs are written to temp files and renamed into place, so an interrupted command
        # leaves nothing half-written (finetune says which checkpoint it kept itself).
        print("error: interrupted (Ctrl-C); nothing was left half-written", file=sys.stderr)
        return EXIT_INTERRUPTED


__all__ = ["COMMANDS", "EXIT_INTERRUPTED", "EXIT_USAGE", "MODEL_FLAG", "UsageError", "build_parser", "main"]


if __name__ == "__main__":
    sys.exit(main())
