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

import argparse
import sys

from vlmod.data.synthetic import add_make_data_arguments, run_make_data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make_synthetic_data.py",
        description="Write a deterministic synthetic LLaVA-format image-text set (train.json, val.json, "
        "images/; with --video also video_train.json, video_val.json, videos/) and meta.json.",
    )
    add_make_data_arguments(parser)
    args = parser.parse_args(argv)
    return run_make_data(args)


if __name__ == "__main__":
    sys.exit(main())
