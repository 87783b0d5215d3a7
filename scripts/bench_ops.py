"""Ops, host syncs and graph breaks a routed layer adds, dense vs MoD per family:
`python scripts/bench_ops.py [--graph-breaks]` (the same code as `vlmod bench ops`)."""

import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ops", *sys.argv[1:]]))
