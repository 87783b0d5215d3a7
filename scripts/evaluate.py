#!/usr/bin/env python
"""Evaluate a (MoD-converted) LLaVA model on LLaVA-format QA data: `vlmod eval` as a script.

    python scripts/evaluate.py --model runs/synthetic/mod/model --data runs/synthetic/data/val.json \\
        --compare runs/synthetic/dense/model --json report.json

All flags: `python scripts/evaluate.py --help`.
"""
import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(['eval', *sys.argv[1:]]))
