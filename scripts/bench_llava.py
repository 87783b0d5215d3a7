"""Dense vs MoD LLaVA generation: `python scripts/bench_llava.py [--model PATH | --preset llava-1.5]`
(the same code as `vlmod bench llava`)."""

import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "llava", *sys.argv[1:]]))
