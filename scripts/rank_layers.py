#!/usr/bin/env python
"""Rank the layers of a LLaVA model by the rank of their attention maps (ARank), and suggest
which layers to convert to MoD: `vlmod rank` as a script.

    python scripts/rank_layers.py --model llava-hf/llava-1.5-7b-hf --data llava_v1_5_mix665k.json \\
        --image-root data/ --num-samples 64 --batch-size 4 --json ranks.json --plots ranks.png

    python scripts/rank_layers.py --model ./tiny-llava --data images/ --prompt "Describe the image." \\
        --num-samples 16 --json ranks.json

All flags: `python scripts/rank_layers.py --help`.
"""

import sys

from vlmod.cli import main as vlmod_main


def main(argv: list[str] | None = None) -> int:
    return vlmod_main(['rank', *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
