"""`vlmod bench train`: dense vs MoD fine-tuning step (forward, backward, AdamW step) against the
training-FLOPs prediction. The benchmark itself lives in `vlmod.bench.train`."""

from __future__ import annotations

import argparse

from vlmod.bench.train import MIXED_PRECISION, TRAIN_PRESETS, TRAINABLE, bench_train, format_train_result
from vlmod.cli.argtypes import option, positive_int
from vlmod.cli.common import (
    MODEL_FLAG,
    SubParsers,
    add_device_arguments,
    add_timing_arguments,
    capacity,
    check_json_output,
    layers,
    under_sdpa_priority,
    write_json_result,
)


def add_bench_train_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench train`: step time, speedup against the FLOPs prediction, and peak memory."""
    p = subparsers.add_parser(
        "train",
        help="dense vs MoD fine-tuning step time and peak memory of a LLaVA model",
        description="Time fine-tuning steps (forward, backward, AdamW step) of a LLaVA checkpoint, or of a preset "
        "with LLaVA-1.5's or LLaVA-NeXT-Video-7B's token shapes and random weights, dense and converted to MoD, "
        "on the same weights and synthetic image / clip batches with answers (dense and MoD steps interleaved), "
        "and compare the measured step speedup with the training-FLOPs prediction; the peak memory of each "
        "step is measured too. A converted --model is measured with its own MoD layers.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint directory or hub id")
    source.add_argument(
        "--preset", choices=sorted(TRAIN_PRESETS), default="llava-1.5", help="model built from config (default: llava-1.5)"
    )
    p.add_argument(
        "--trainable", choices=TRAINABLE, default="full",
        help="what trains, as `vlmod finetune` chooses it: full (language model, projector, routers), lora "
        "(adapters, projector, routers) or router (routers only; a dense model has none, so the dense reference "
        "then trains its projector: the cheapest dense fine-tune whose gradient crosses the whole language model) "
        "(default: full)",
    )
    p.add_argument(
        "--capacity", type=capacity, default=None,
        help="fraction of vision tokens per MoD layer (default: 0.5; a converted --model is measured with its own)",
    )
    p.add_argument(
        "--layers", type=layers, default=None,
        help="every_other | all | comma list (default: every_other for an image model, every layer but the first "
        "two and the last for a video model; a converted --model is measured with its own)",
    )
    option(p, "--batch-size", aliases=("--batch",), dest="batch", type=positive_int, default=1,
           help="sequences per step (default: 1)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer's activations in backward (default: off)")
    p.add_argument("--mixed-precision", choices=MIXED_PRECISION, default="no",
                   help="run the forward under bfloat16 autocast (float32 master weights; a float16 checkpoint's "
                   "frozen weights then load in bfloat16) (default: no)")
    p.add_argument("--compile", action="store_true",
                   help="compile each decoder layer of both models (dynamic shapes; the first step compiles and "
                   "its time is reported) (default: off, eager)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and adapters (default: 0)")
    add_device_arguments(
        p, "the checkpoint's own or the preset's (what trains is float32; a bfloat16 / float16 model runs its "
        "forward under autocast in that dtype, as vlmod finetune does)", what="dtype of the frozen weights",
    )
    add_timing_arguments(p, warmup=1, repeats=5, warmup_help="untimed steps of each model first; at least 1 runs, "
                         "for AdamW's state")
    p.set_defaults(run=run_bench_train, model_flags=MODEL_FLAG)
    return p


@under_sdpa_priority
def run_bench_train(args: argparse.Namespace) -> int:
    check_json_output(args.json, inputs=[args.model])  # before the benchmark, not after it
    result = bench_train(
        model=args.model, preset=args.preset, trainable=args.trainable, capacity=args.capacity, layers=args.layers,
        batch=args.batch, gradient_checkpointing=args.gradient_checkpointing, mixed_precision=args.mixed_precision,
        warmup=args.warmup, repeats=args.repeats, threads=args.threads, progress=not args.no_progress, seed=args.seed,
        device=args.device, dtype=args.dtype, compile=args.compile,
    )
    print(format_train_result(result))
    write_json_result(args.json, result)
    return 0


__all__ = ["add_bench_train_parser", "run_bench_train"]
