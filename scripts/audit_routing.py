#!/usr/bin/env python
"""Audit the routing of a converted LLaVA model: `vlmod audit` as a script.

With the weights fixed, swap the router at inference (learned, inverted, random, stride,
attention) and report accuracy and answer loss for each, the cross-layer Jaccard agreement of
processed tokens, compute by token position and type, PNG plots and a written verdict.

    python scripts/audit_routing.py --model runs/mod-llava --data data/synthetic/val.json \\
        --json audit.json --plots audit/

All flags: `python scripts/audit_routing.py --help`.
"""

import argparse
import sys

from vlmod.audit import add_audit_arguments, run_audit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="audit_routing.py",
        description="Compare a converted model's learned router with counterfactual and training-free "
        "routers on one eval set, weights fixed.",
    )
    add_audit_arguments(parser)
    args = parser.parse_args(argv)
    return run_audit(args)


if __name__ == "__main__":
    sys.exit(main())
