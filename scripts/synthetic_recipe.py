#!/usr/bin/env python
"""The synthetic recipe end to end (data, dense from scratch, ARank, convert, evaluate, MoD
fine-tune, router baselines) into one folder, with results.md / results.json: the README's Results.

    python scripts/synthetic_recipe.py --out runs/synthetic

All settings are flags (`--help`); the defaults are the README's run.
"""
import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(['recipe', *sys.argv[1:]]))
