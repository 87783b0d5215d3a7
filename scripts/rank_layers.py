#!/usr/bin/env python
"""Rank the layers of a LLaVA model by the rank of their attention maps (ARank), and suggest
which layers to convert to MoD: `vlmod rank` as a script.

    python scripts/rank_layers.py --model llava-hf/llava-1.5-7b-hf --data llava_v1_5_mix665k.json \\
        --image-root data/ --num-samples 64 --batch-size 4 --out ranks.json --plot ranks.png

    python scripts/rank_layers.py --model ./tiny-llava --data images/ --prompt "Describe the image." \\
        --num-samples 16 --out ranks.json

All flags: `python scripts/rank_layers.py --help`.
"""

import argparse
import sys

from vlmod.arank import add_rank_arguments, run_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rank_layers.py",
        description="Calibrate attention ranks per layer (ARank) on image-text data, write them as JSON "
        "(and a PNG bar chart) with the suggested MoD layers.",
    )
    add_rank_arguments(parser)
    args = parser.parse_args(argv)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
