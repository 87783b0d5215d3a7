"""`bench video`: dense vs MoD video question answering, end to end (decode the clip's frames,
preprocess them, vision tower, prefill, generation), with the prefill against its FLOPs
predictions and decode timed per step inside generate."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlmod
from vlmod.bench.decode import (
    DEFAULT_CACHE,
    StepClock,
    cache_kwargs,
    check_cache,
    compile_decoding,
    decode_figures,
    generation_footprint,
    timed_lockstep,
)
from vlmod.bench.generation import (
    CPU_7B_SHAPES,
    DEFAULT_CAPACITY,
    TINY_SHAPES,
    build_pair,
    model_figures,
    prompt_counts,
    speedups,
    timed_prefill,
)
from vlmod.bench.inputs import on_device, parse_layers, prompt_text, synthetic_clip
from vlmod.bench.timing import (
    describe_device,
    keeps_threads,
    load_average,
    peak_memory_bytes,
    set_threads,
    time_interleaved,
)
from vlmod.errors import InputError

# LLaVA-NeXT-Video-7B's token shapes: a 336 px CLIP tower with 14 px patches (24 x 24 = 576 patches
# per frame) pooled 2 x 2 (spatial_pool_stride=2) to 144 tokens per frame, a ~40-token prompt,
# 32 decoder layers with Llama's MLP ratio 11008/4096, at a width that runs on a laptop CPU (8
# frames: a prefill of ~1190 tokens in a few seconds). The vision tower is kept small, as in the
# LLaVA preset. "-full" is the real model (width 4096, the CLIP-L/336 tower, bfloat16; for a GPU).
# "tiny" and "tiny-onevision" are for tests (seconds to build and run).
VIDEO_PRESETS: dict[str, dict[str, Any]] = {
    "llava-next-video-7b": dict(family="llava_next_video", **CPU_7B_SHAPES, prompt_tokens=35),
    "llava-next-video-7b-full": dict(shape="llava-next-video-7b", prompt_tokens=35),
    "tiny": dict(family="llava_next_video", **TINY_SHAPES),
    "tiny-onevision": dict(family="llava_onevision", **TINY_SHAPES),
}
# Prompt words for a checkpoint (`--model`): about the prompt length of the preset.
VIDEO_PROMPT_WORDS = 35
STAGES = ("decode_video_s", "preprocess_s", "generate_s", "first_token_s", "decode_steps_s")


def default_video_layers(num_layers: int) -> list[int]:
    """Every decoder layer but the first two and the last: the layers whose vision tokens are the
    most redundant (the first layers mix them into the text, the last one feeds the LM head)."""
    return list(range(2, num_layers - 1))


def _load_clip(path: Path, frames: int) -> Any:
    from vlmod.data.llava_format import DataError
    from vlmod.data.video import VideoError, load_video

    try:
        return load_video(path, num_frames=frames)
    except (FileNotFoundError, VideoError, DataError) as e:  # DataError: a FIFO, a folder, a symlink loop
        raise InputError(str(e)) from None


def _check_video_checkpoint(model: str) -> None:
    """Refuse an image-only checkpoint from its config, before its weights are loaded."""
    from vlmod.io.hf import load_config, model_class

    try:
        config = load_config(model)
        name = model_class(config).__name__
    except (FileNotFoundError, TypeError) as e:
        raise InputError(str(e)) from e
    if getattr(config, "video_token_id", None) is None:
        raise InputError(
            f"{model} is a {name}, which takes no video; use a LlavaNextVideo or LlavaOnevision checkpoint"
        )


def _describe_clip(path: Path) -> str:
    from vlmod.data.video import load_video

    info = load_video(path, num_frames=1)
    height, width = info.frames.shape[1:3]
    return f"{info.total_frames} frames, {width}x{height}, {info.fps:g} fps"


@keeps_threads
def bench_video(
    model: str | None = None,
    preset: str | None = "llava-next-video-7b",
    video: str | os.PathLike[str] | None = None,
    frames: int = 8,
    batch: int = 1,
    capacity: float | None = None,
    layers: str | Sequence[int] | None = None,
    new_tokens: int = 16,
    warmup: int = 1,
    repeats: int = 5,
    threads: int | None = None,
    progress: bool = True,
    cache: str = DEFAULT_CACHE,
    decode_bound: bool = False,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    control: bool = False,
    compile: bool = False,  # noqa: A002
) -> dict[str, Any]:
    """Dense vs MoD video question answering, end to end.

    Why end to end: video is where MoD pays most (8 frames x 144 tokens dwarf the prompt), but
    what a user gets is frames/s of the whole pipeline, and decoding and preprocessing do not
    shrink. So the result gives both: `speedup` (end-to-end frames/s, MoD over dense) and
    `prefill_speedup` against `predicted_speedup` (the FLOPs ratio of vision tower + language
    prefill), the time split, decode per step, and the frames/s of video decoding alone.

    capacity / layers: how to convert a preset or a plain checkpoint (None: 0.5 on every decoder
        layer but the first two and the last). A checkpoint saved converted is measured with its
        own MoD layers. video: a file, or None for a generated clip (`synthetic_clip`).
    cache: the KV cache both models generate with (`vlmod.bench.decode.CACHES`). threads: torch's
    intra-op threads while the benchmark runs (the caller's count is restored afterwards).
    decode_bound: also decode in lockstep with MoD's routing bypassed (`routing_bypassed`).
    control: time a second dense model over the same weights in the prefill rotation (the noise
    floor, `prefill_control`; `vlmod.bench.generation.timed_prefill`).
    device, dtype: where the models run and in what dtype (None: the checkpoint's or the preset's
    own); frames are decoded and preprocessed on the CPU, as a user's pipeline does.
    compile: both models decode compiled (`vlmod.compile`; the prefill stays eager).
    """
    try:
        if capacity is not None or layers is not None:
            vlmod.MoDConfig(
                capacity=DEFAULT_CAPACITY if capacity is None else capacity,
                layers="all" if layers is None else parse_layers(layers),
            )
        if min(frames, batch, new_tokens) < 1:
            raise ValueError(f"frames, batch and new_tokens must be >= 1, got {frames}, {batch} and {new_tokens}")
        if repeats < 1 or warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
        check_cache(cache)
        if compile and cache != DEFAULT_CACHE:
            raise ValueError(f"--compile decodes on vlmod's own cache: drop --cache {cache}")
        num_threads = set_threads(threads)
    except ValueError as e:
        raise InputError(str(e)) from e
    if model is None and preset not in VIDEO_PRESETS:
        raise InputError(f"unknown video preset {preset!r}; choose one of {sorted(VIDEO_PRESETS)}")
    with tempfile.TemporaryDirectory(prefix="vlmod-video-") as tmp:
        if video is None:
            path = synthetic_clip(Path(tmp) / "clip.mp4")
            source = f"generated {path.name} ({_describe_clip(path)})"
        else:
            path = Path(video)
            source = str(video)
        clip = _load_clip(path, frames)  # bad files fail here, before any model is built
        if model is not None:
            _check_video_checkpoint(model)
        dense, mod, processor, words, mod_source = build_pair(
            model, preset, VIDEO_PRESETS, capacity, layers, default_layers=default_video_layers, device=device,
            dtype=dtype,
        )
        if model is not None:
            words = VIDEO_PROMPT_WORDS
        if getattr(processor, "video_processor", None) is None:
            raise InputError(f"the processor of {model} has no video processor: it cannot prepare video inputs")
        result = _time_video(
            dense, mod, processor, path, clip, words, batch, new_tokens, warmup, repeats, progress, cache,
            decode_bound, control, compile,
        )
    result.update(
        benchmark="video",
        model=model or f"preset:{preset}",
        video=source,
        frames_requested=frames,
        batch=batch,
        mod_layers={f"{p}:{i}": c for (p, i), c in vlmod.mod_layers(mod).items()},
        mod_source=mod_source,
        language_layers=dense.config.text_config.num_hidden_layers,
        new_tokens=new_tokens,
        warmup=warmup,
        repeats=repeats,
        torch=torch.__version__,
        threads=num_threads,
        load_average=load_average(),
        cache=cache,
    )
    return result


def _time_video(
    dense: nn.Module,
    mod: nn.Module,
    processor: Any,
    path: Path,
    clip: Any,
    words: int,
    batch: int,
    new_tokens: int,
    warmup: int,
    repeats: int,
    progress: bool,
    cache: str,
    decode_bound: bool = False,
    control: bool = False,
    compile: bool = False,  # noqa: A002
) -> dict[str, Any]:
    """The timed part of `bench_video` (models built, clip checked)."""
    from transformers import LogitsProcessorList

    from vlmod.data.video import load_video

    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt_text(words)}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    num_frames = len(clip.frames)
    device = next(dense.parameters()).device

    def preprocess(videos: list[Any]) -> dict[str, Any]:
        return on_device(processor(videos=videos, text=[text] * batch, return_tensors="pt", padding=True), dense)

    inputs = preprocess([clip.frames] * batch)
    flops, kv = generation_footprint(dense, mod, inputs)
    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    models = {"dense": dense, "mod": mod}
    stages: dict[str, list[tuple[float, ...]]] = {name: [] for name in models}
    clocks = {name: StepClock() for name in models}

    def pipeline(name: str) -> None:
        t0 = time.perf_counter()
        videos = [load_video(path, num_frames=num_frames).frames for _ in range(batch)]
        t1 = time.perf_counter()
        batch_inputs = preprocess(videos)
        kv = cache_kwargs(models[name], cache, new_tokens)
        clocks[name].start()
        t2 = time.perf_counter()
        models[name].generate(**batch_inputs, **gen, **kv, logits_processor=LogitsProcessorList([clocks[name]]))
        t3 = time.perf_counter()
        ticks = clocks[name].calls[-1]
        stages[name].append((t1 - t0, t2 - t1, t3 - t2, ticks[1] - t2, ticks[-1] - ticks[1]))

    compiled = compile_decoding(models, inputs, gen, cache) if compile else None
    decode_video = time_interleaved(
        {"decode": lambda: load_video(path, num_frames=num_frames)}, warmup=warmup, repeats=repeats
    )["decode"]
    prefill, prefill_judged, prefill_pairs = timed_prefill(
        dense, mod, inputs, cache, new_tokens, warmup, repeats, progress, control
    )
    end_to_end = time_interleaved(
        {n: (lambda n=n: pipeline(n)) for n in models},
        warmup=warmup, repeats=repeats, progress="end to end dense/MoD" if progress else None, device=device,
    )
    decode, e2e_judged, paired = decode_figures(clocks, end_to_end, repeats, batch)
    lockstep = None
    if new_tokens > 1 and not compile:
        lockstep = timed_lockstep(models, inputs, new_tokens * repeats, cache, decode_bound)
    used = e2e_judged.clean_repeats
    peaks = {
        n: peak_memory_bytes(lambda m=m: m.generate(**inputs, **gen, **cache_kwargs(m, cache, new_tokens)), device)
        for n, m in models.items()
    }
    result: dict[str, Any] = {}
    for name in models:
        picked = [stages[name][-repeats:][i] for i in used]
        split = {stage: statistics.median(s[k] for s in picked) for k, stage in enumerate(STAGES)}
        latency = end_to_end[name].median(used)
        result[name] = {
            "frames_per_s": batch * num_frames / latency,
            "end_to_end_s": latency,
            **model_figures(models[name], prefill[name].median(prefill_judged.clean_repeats), decode[name], kv[name],
                            peaks[name], flops[name]),
            "time_split": split,
            "end_to_end_samples_s": end_to_end[name].wall_s,
            "prefill_samples_s": prefill[name].wall_s,
        }
    video_tokens, prompt_tokens = prompt_counts(inputs, dense.config.video_token_id)
    result["decode_lockstep"] = lockstep
    result["compile"] = compiled
    result.update(speedups(result, flops, kv))
    result.update(prefill_pairs)
    result.update(
        frames=num_frames,
        video_tokens=video_tokens,
        prompt_tokens=prompt_tokens,
        speedup=result["mod"]["frames_per_s"] / result["dense"]["frames_per_s"],
        decode_speedup_paired=paired,
        decode_only_frames_per_s=num_frames / decode_video.median(),
        decode_only_s=decode_video.median(),
        device=describe_device(device),
        dtype=str(next(dense.parameters()).dtype).removeprefix("torch."),
        contended=prefill_judged.contended or e2e_judged.contended,
        contention={"prefill": prefill_judged.as_dict(), "end to end and decode": e2e_judged.as_dict()},
        timed_repeats={"prefill": prefill_judged.clean_repeats, "end_to_end": used},
    )
    return result
