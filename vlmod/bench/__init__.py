"""Benchmarks: does MoD's FLOP reduction turn into wall-clock speed?

Each benchmark measures a dense model and its MoD conversion on the same inputs, interleaved in
one process, and sets the measured speedup against the FLOPs prediction of `vlmod.tools.flops`;
`efficiency` = measured / predicted is the number to watch (1.0: routing costs nothing beyond
the blocks it skips). Modules: `timing` (interleaved timing, contention, peak memory), `inputs`
(layer specs, synthetic pictures, prompts, clips), `vit`, `generation` (LLaVA prefill and
generate), `decode` (decode timing and its bounds), `video`, `train` (a fine-tuning step), `report`
(tables).
"""

from vlmod.bench.decode import (
    CACHES,
    DEFAULT_CACHE,
    StepClock,
    generation_footprint,
    kv_cache_bytes,
    lockstep_decode,
    routing_bypassed,
)
from vlmod.bench.generation import CPU_7B_SHAPES, LLAVA_PRESETS, TINY_SHAPES, bench_generation, bench_llava
from vlmod.bench.inputs import parse_layers, prompt_text, synthetic_clip, synthetic_image
from vlmod.bench.report import (
    format_generation_result,
    format_table,
    format_video_result,
    format_vit_result,
    signed_percent,
)
from vlmod.bench.timing import (
    Contention,
    Timings,
    contention,
    load_average,
    peak_memory_bytes,
    robust_repeats,
    time_fn,
    time_interleaved,
)
from vlmod.bench.train import TRAIN_PRESETS, bench_train, format_train_result
from vlmod.bench.video import VIDEO_PRESETS, VIDEO_PROMPT_WORDS, bench_video
from vlmod.bench.vit import SOURCES, bench_vit, build_vit
from vlmod.tools.flops import generation_flops  # re-exported: the demo imports it from here

__all__ = [
    "CACHES",
    "CPU_7B_SHAPES",
    "DEFAULT_CACHE",
    "LLAVA_PRESETS",
    "SOURCES",
    "TINY_SHAPES",
    "TRAIN_PRESETS",
    "VIDEO_PRESETS",
    "VIDEO_PROMPT_WORDS",
    "Contention",
    "StepClock",
    "Timings",
    "bench_generation",
    "bench_llava",
    "bench_train",
    "bench_video",
    "bench_vit",
    "build_vit",
    "contention",
    "format_generation_result",
    "format_table",
    "format_train_result",
    "format_video_result",
    "format_vit_result",
    "generation_flops",
    "generation_footprint",
    "kv_cache_bytes",
    "load_average",
    "lockstep_decode",
    "routing_bypassed",
    "parse_layers",
    "peak_memory_bytes",
    "prompt_text",
    "robust_repeats",
    "signed_percent",
    "synthetic_clip",
    "synthetic_image",
    "time_fn",
    "time_interleaved",
]
