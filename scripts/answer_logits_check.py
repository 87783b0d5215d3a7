#!/usr/bin/env python
"""What computing logits only at the answer positions saves in a fine-tuning step of a real
checkpoint: one LoRA step (as `vlmod bench train` prepares it) with `logits_to_keep` and one
with every position's logits, each after a warm-up step: FLOPs, peak memory above the weights,
and the step's time (one step each: a difference under this machine's noise is not resolved).

    python scripts/answer_logits_check.py --model runs/llava-1.5-7b-8/checkpoint
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from vlmod.cli.argtypes import HelpFormatter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True, help="a LLaVA checkpoint directory or hub id (no default)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--words", type=int, default=60, help="question words of the synthetic prompt (default: 60)")
    args = parser.parse_args()

    from transformers import AutoProcessor

    import vlmod.training.logits as logits
    from vlmod import load_pretrained
    from vlmod.bench import train
    from vlmod.bench.inputs import on_device
    from vlmod.bench.timing import peak_memory_bytes
    from vlmod.tools.training_flops import training_flops

    torch.set_num_threads(args.threads)
    model, processor = load_pretrained(args.model), AutoProcessor.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        size = model.config.vision_config.image_size
        batch = on_device(train.synthetic_batch(processor, size, 1, args.words, False, Path(tmp)), model)
    answers = int((batch["labels"] != -100).sum())
    print(f"{batch['input_ids'].shape[1]} positions, {answers} answer tokens", flush=True)
    model, optimizer, _ = train.prepare_training(model, "lora", True, False, seed=0)
    autocast = None if next(model.parameters()).dtype == torch.float32 else torch.bfloat16
    keep = logits.answer_logits_inputs
    for mode in ("answer positions", "every position"):
        logits.answer_logits_inputs = keep if mode == "answer positions" else (lambda model, batch: {})
        step = train.TrainingStep(model, batch, optimizer, autocast)
        flops = training_flops(model, step.batch, None, "lora")["total"]
        step()  # warm-up
        start = time.perf_counter()
        step()
        took = time.perf_counter() - start
        peak = peak_memory_bytes(step)
        print(f"logits at {mode}: step {took:.1f} s, peak {peak / 2**20:.0f} MiB above the weights, "
              f"{flops / 1e12:.3f} TFLOPs", flush=True)
    logits.answer_logits_inputs = keep


if __name__ == "__main__":
    main()
