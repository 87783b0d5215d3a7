"""`vlmod bench vit|llava|video`: does MoD's FLOP reduction turn into wall-clock speed? The
benchmarks themselves live in `vlmod.bench`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from vlmod.bench import (
    CACHES,
    DEFAULT_CACHE,
    LLAVA_PRESETS,
    VIDEO_PRESETS,
    bench_llava,
    bench_video,
    bench_vit,
    format_generation_result,
    format_video_result,
    format_vit_result,
)
from vlmod.cli.argtypes import non_negative_int, option, positive_int, threads
from vlmod.cli.bench_ops import add_bench_ops_parser
from vlmod.cli.bench_train import add_bench_train_parser
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


def add_bench_vit_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench vit`: dense vs MoD images/s of a ViT image encoder against the FLOPs prediction."""
    p = subparsers.add_parser(
        "vit",
        help="dense vs MoD throughput of a timm / open_clip ViT",
        description="Measure images/s of a randomly initialised ViT and of its MoD conversion on one "
        "random batch (dense and MoD runs interleaved), and compare the measured speedup with "
        "the FLOPs prediction.",
    )
    p.add_argument(
        "--model", required=True, help="timm model name (vit_base_patch16_224) or open_clip name (ViT-B-16)"
    )
    p.add_argument(
        "--source", choices=("timm", "open_clip"), default="timm", help="model library (default: timm)"
    )
    option(p, "--batch-size", aliases=("--batch",), dest="batch", type=positive_int, default=8,
           help="images per forward (default: 8)")
    p.add_argument(
        "--capacity",
        type=capacity,
        default=0.125,
        help="fraction of patch tokens a MoD layer processes (default: 0.125)",
    )
    p.add_argument(
        "--layers",
        type=layers,
        default="every_other",
        help="every_other | all | comma list of block indices (default: every_other)",
    )
    p.add_argument(
        "--image-size", type=positive_int, default=None, help="input resolution (default: the model's)"
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=3,
        help="untimed forwards of each model first (default: 3)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=10, help="timed forwards of each model (default: 10)"
    )
    p.add_argument(
        "--threads", type=threads, default=None,
        help="torch intra-op threads, at most the machine's cores (default: torch's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch (default: 0)")
    add_device_arguments(p, "float32 (the random weights' own)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_bench_vit)
    return p


@under_sdpa_priority
def run_bench_vit(args: argparse.Namespace) -> int:
    check_json_output(args.json, inputs=[args.model])  # before the benchmark, not after it
    result = bench_vit(
        args.model,
        source=args.source,
        batch=args.batch,
        capacity=args.capacity,
        layers=args.layers,
        image_size=args.image_size,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        seed=args.seed,
        progress=not args.no_progress,
        device=args.device,
        dtype=args.dtype,
    )
    print(format_vit_result(result))
    write_json_result(args.json, result)
    return 0


def _add_cache_argument(p: argparse.ArgumentParser) -> None:
    """--cache, --decode-bound and --compile: how the models decode."""
    p.add_argument(
        "--cache", choices=CACHES, default=DEFAULT_CACHE,
        help="KV cache both models generate with: preallocated (vlmod.preallocated_cache, written in place) "
        f"or dynamic (transformers' DynamicCache, concatenated every step) (default: {DEFAULT_CACHE})",
    )
    p.add_argument(
        "--decode-bound", action="store_true",
        help="also decode in lockstep with MoD's router and gate bypassed (a copy of the MoD model whose layers "
        "run their blocks ungated over the same small caches in decode steps): what MoD could decode at if "
        "routing cost nothing (default: off; a third model over the same weights; needs --new-tokens >= 2)",
    )
    p.add_argument(
        "--compile", action="store_true",
        help="decode compiled, both models (vlmod.compile: torch.compile with fullgraph of each decode step on a "
        "CompiledCache; CUDA graphs on a GPU); the first generate call of each compiles and its time is reported "
        "(default: off, eager)",
    )


def _add_control_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control", action="store_true",
        help="also time a second dense model over the same weights in the prefill rotation: the dense / dense "
        "ratio is the gap this machine's noise alone makes, so a MoD gap below it is not resolved "
        "(default: off; the prefill timing takes half as long again)",
    )


def add_bench_llava_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench llava`: dense vs MoD prefill, decode and KV cache of a LLaVA model."""
    p = subparsers.add_parser(
        "llava",
        help="dense vs MoD prefill latency, decode tokens/s and KV cache of a LLaVA model",
        description="Run a LLaVA checkpoint (or a preset with LLaVA-1.5's token shapes and random "
        "weights) dense and converted to MoD on one synthetic image per prompt, and compare the measured "
        "prefill speedup with the FLOPs prediction; decode is timed per step inside generate, and the KV "
        "cache and peak memory are compared. A converted checkpoint is measured with its own MoD layers.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint directory or hub id")
    source.add_argument(
        "--preset", choices=sorted(LLAVA_PRESETS), default="llava-1.5",
        help="model built from config with random weights: llava-1.5 has LLaVA-1.5-7B's token shapes at width 512 "
        "for a CPU; llava-1.5-7b-full is the real 7B (width 4096, CLIP-L/336, bfloat16) for a GPU (default: llava-1.5)",
    )
    p.add_argument(
        "--capacity", type=capacity, default=None,
        help="fraction of image tokens per MoD layer (default: 0.5; a converted --model is measured with its own)",
    )
    p.add_argument(
        "--layers", type=layers, default=None,
        help="every_other | all | comma list (default: every_other; a converted --model is measured with its own)",
    )
    option(p, "--batch-size", aliases=("--batch",), dest="batch", type=positive_int, default=1,
           help="prompts per batch (default: 1)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens to generate (default: 16)")
    _add_cache_argument(p)
    _add_control_argument(p)
    add_device_arguments(p, "the checkpoint's own, float32 for llava-1.5, bfloat16 for the -full preset")
    add_timing_arguments(p, warmup=1, repeats=5)
    p.set_defaults(run=run_bench_llava, model_flags=MODEL_FLAG)
    return p


@under_sdpa_priority
def run_bench_llava(args: argparse.Namespace) -> int:
    check_json_output(args.json, inputs=[args.model])  # before the benchmark, not after it
    result = bench_llava(
        model=args.model, preset=args.preset, capacity=args.capacity, layers=args.layers, batch=args.batch,
        new_tokens=args.new_tokens, warmup=args.warmup, repeats=args.repeats, threads=args.threads,
        progress=not args.no_progress, cache=args.cache, decode_bound=args.decode_bound, device=args.device,
        dtype=args.dtype, control=args.control, compile=args.compile,
    )
    print(format_generation_result(result))
    write_json_result(args.json, result)
    return 0


def add_bench_video_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench video`: dense vs MoD video question answering, end to end."""
    p = subparsers.add_parser(
        "video",
        help="dense vs MoD frames/s of a video LLaVA model, end to end",
        description="Run a LlavaNextVideo / LlavaOnevision checkpoint (or a preset with LLaVA-NeXT-Video-7B's "
        "token shapes and random weights) dense and converted to MoD on a video clip: frame decoding, "
        "preprocessing, vision tower, prefill and generation, timed interleaved. Reports end-to-end "
        "frames/s, where the time goes, and the measured prefill speedup against the FLOPs prediction.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="LlavaNextVideo or LlavaOnevision checkpoint directory or hub id")
    source.add_argument(
        "--preset", default="llava-next-video-7b",
        help=f"model built from config: {' | '.join(sorted(VIDEO_PRESETS))}; llava-next-video-7b has the 7B's "
        "token shapes at width 512 for a CPU, -full is the real 7B in bfloat16 for a GPU (default: llava-next-video-7b)",
    )
    p.add_argument("--video", default=None, help="video file (default: a generated 3 s clip)")
    p.add_argument("--frames", type=positive_int, default=8, help="frames sampled uniformly from the clip (default: 8)")
    option(p, "--batch-size", aliases=("--batch",), dest="batch", type=positive_int, default=1,
           help="clips per batch (default: 1)")
    p.add_argument(
        "--capacity", type=capacity, default=None,
        help="fraction of video tokens per MoD layer (default: 0.5; a converted --model is measured with its own)",
    )
    p.add_argument(
        "--layers", type=layers, default=None,
        help="every_other | all | comma list (default: every layer but the first two and the last; "
        "a converted --model is measured with its own)",
    )
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens to generate (default: 16)")
    _add_cache_argument(p)
    _add_control_argument(p)
    add_device_arguments(p, "the checkpoint's own, float32 for the small presets, bfloat16 for -full")
    add_timing_arguments(p, warmup=1, repeats=5)
    p.set_defaults(run=run_bench_video, model_flags=MODEL_FLAG)
    return p


@under_sdpa_priority
def run_bench_video(args: argparse.Namespace) -> int:
    check_json_output(args.json, inputs=[args.model, args.video])  # before the benchmark, not after it
    result = bench_video(
        model=args.model, preset=args.preset, video=args.video, frames=args.frames, batch=args.batch,
        capacity=args.capacity, layers=args.layers, new_tokens=args.new_tokens, warmup=args.warmup,
        repeats=args.repeats, threads=args.threads, progress=not args.no_progress, cache=args.cache,
        decode_bound=args.decode_bound, device=args.device, dtype=args.dtype, control=args.control,
        compile=args.compile,
    )
    print(format_video_result(result))
    write_json_result(args.json, result)
    return 0


# Benchmarks under `vlmod bench`.
BENCHMARKS: list[Callable[[SubParsers], argparse.ArgumentParser]] = [
    add_bench_vit_parser, add_bench_llava_parser, add_bench_video_parser, add_bench_train_parser, add_bench_ops_parser,
]


def add_bench_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench <benchmark>`."""
    p = subparsers.add_parser("bench", help="benchmarks: measured vs predicted MoD speedup")
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for add in BENCHMARKS:
        add(sub)
    return p


__all__ = ["BENCHMARKS", "add_bench_parser"]
