"""`python -m vlmod.demo.examples [--out DIR]`: regenerate the demo's bundled examples. Not a `vlmod`
subcommand: `vlmod.demo.examples` runs it with its own writer, so this module imports nothing of
the demo (the demo imports it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path


def examples_main(
    write_examples: Callable[[str], Iterable[Path]], default_out: Path, argv: Sequence[str] | None = None
) -> int:
    """Parse `--out` and write the examples there with `write_examples`, one line per file."""
    parser = argparse.ArgumentParser(description="Regenerate the demo's bundled example pictures and clip.")
    parser.add_argument("--out", default=str(default_out), help=f"output folder (default: {default_out})")
    args = parser.parse_args(argv)
    for path in write_examples(args.out):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


__all__ = ["examples_main"]
