#!/usr/bin/env python
"""The synthetic recipe end to end (data, dense from scratch, ARank, convert, evaluate, MoD
fine-tune, router baselines) into one folder, with results.md / results.json: the README's Results.

    python scripts/synthetic_recipe.py --out runs/synthetic

All settings are flags (`--help`); the defaults are the README's run.
"""

import argparse
import sys

from vlmod.bench import InputError
from vlmod.recipe import add_recipe_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="synthetic_recipe.py", description=__doc__.split("\n\n")[0])
    add_recipe_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
