#!/usr/bin/env python
"""Fine-tune a (MoD-converted) LLaVA model: `vlmod finetune` as a script, so Accelerate can launch it.

    accelerate launch --config_file configs/accelerate/single_gpu.yaml scripts/finetune.py \\
        --config configs/finetune/llava-1.5-7b-mod.yaml
    python scripts/finetune.py --config configs/finetune/synthetic-mod.yaml   # after `vlmod recipe`

Resume an interrupted run at the same step, optimizer state and data position:
    accelerate launch ... scripts/finetune.py --config ... --resume latest

All flags: `python scripts/finetune.py --help`.
"""
import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(['finetune', *sys.argv[1:]]))
