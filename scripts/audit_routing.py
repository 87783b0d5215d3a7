#!/usr/bin/env python
"""Audit the routing of a converted LLaVA model: `vlmod audit` as a script.

With the weights fixed, swap the router at inference (learned, inverted, random, stride,
attention) and report accuracy and answer loss for each, the cross-layer Jaccard agreement of
processed tokens, compute by token position and type, PNG plots and a written verdict.

    python scripts/audit_routing.py --model runs/mod-llava --data data/synthetic/val.json \\
        --json audit.json --plots audit/

All flags: `python scripts/audit_routing.py --help`.
"""
import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(['audit', *sys.argv[1:]]))
