#!/usr/bin/env python
"""Generate the synthetic image-text set (coloured shapes on a textured background, questions
about colour, shape, count and position; optionally moving-object videos): `vlmod data
synthetic` as a script. The same seed writes the same bytes.

    python scripts/make_synthetic_data.py --out data/synthetic --train 2000 --val 200
    python scripts/make_synthetic_data.py --out data/synthetic --train 2000 --val 200 \\
        --image-size 64 --seed 0 --video --videos 400

The question types and answer vocabularies are described in `vlmod/data/synthetic.py`.
All flags: `python scripts/make_synthetic_data.py --help`.
"""

import sys

from vlmod.cli import main as vlmod_main


def main(argv: list[str] | None = None) -> int:
    return vlmod_main(['data', 'synthetic', *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
