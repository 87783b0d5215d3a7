"""Convert a LLaVA checkpoint to MoD: `python scripts/convert_llava.py --model PATH --out DIR ...`
(the same code as `vlmod convert`)."""

import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
