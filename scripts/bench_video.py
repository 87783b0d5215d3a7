"""Dense vs MoD video LLaVA, end to end: `python scripts/bench_video.py [--model PATH | --preset
llava-next-video-7b] [--video FILE] [--frames 8] ...` (the same code as `vlmod bench video`)."""

import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "video", *sys.argv[1:]]))
