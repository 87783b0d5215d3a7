#!/usr/bin/env python
"""Dense vs MoD throughput of a ViT image encoder: `vlmod bench vit` as a script.

    python scripts/bench_vit.py --model vit_base_patch16_224 --batch 8 --capacity 0.125 \\
        --layers every_other --json bench_vit.json

All flags: `python scripts/bench_vit.py --help` (the same as `vlmod bench vit --help`).
"""

import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "vit", *sys.argv[1:]]))
