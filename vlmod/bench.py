"""Benchmarks: does MoD's FLOP reduction turn into wall-clock speed?

Each benchmark measures a dense model and its MoD conversion on the same inputs and sets the
measured speedup against the FLOPs prediction of `vlmod.flops`; `efficiency` = measured /
predicted is the number to watch (1.0: routing costs nothing beyond the blocks it skips).

The helpers at the top (timing, JSON output, tables) are shared by every benchmark
(`bench_vit` here; LLaVA and video benchmarks plug in next to it).
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlmod
from vlmod.errors import InputError
from vlmod.flops import ViTDims, processed_counts, vit_flops

SOURCES = ("timm", "open_clip")


# ----------------------------------------------------------------------------- shared helpers


@dataclass
class Timings:
    """Wall-clock and CPU seconds of each timed call of one function."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    threads: int = 1

    @property
    def utilization(self) -> list[float]:
        """CPU seconds / (wall seconds * threads) per call: about 1 when the process had all the
        cores it asked for, well below 1 when other jobs took some."""
        return [
            c / (w * self.threads) if w > 0 else 0.0 for w, c in zip(self.wall_s, self.cpu_s, strict=True)
        ]

    def median(self, repeats: Sequence[int] | None = None) -> float:
        """Median wall seconds over all calls, or over the calls numbered in `repeats`."""
        picked = self.wall_s if repeats is None else [self.wall_s[i] for i in repeats]
        return statistics.median(picked)


# A repeat counts as uncontended when every function in it got at least this share of its
# threads' CPU time. Measured on the 2-core dev machine: 0.94-1.0 alone, 0.35-0.6 with one
# other busy process.
MIN_UTILIZATION = 0.8


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    warmup: int = 3,
    repeats: int = 10,
    progress: str | None = None,
) -> dict[str, Timings]:
    """Time each function in `fns` `repeats` times, under `torch.inference_mode`.

    The functions take turns within each repeat, and the order is reversed on every other repeat
    (A B, B A, A B, ...). Why: a benchmark compares them, and a machine shared with other jobs
    drifts (load, thermal state, caches) over seconds; interleaving puts slow drifts on all of
    them alike, and reversing cancels any advantage of running first or second. Take medians:
    they ignore the occasional call hit by an outside burst.

    Interleaving does not make sustained contention fair, though: when another process holds a
    core, a multi-threaded torch forward loses far more than that core's share (every parallel
    region waits for its slowest thread), and a model made of many small ops (a MoD model) loses
    more than one made of fewer large ones. So CPU time is recorded too, and
    `uncontended_repeats` finds the repeats that ran with the CPU they asked for.

    warmup: untimed calls of each function first (allocator, oneDNN kernel selection, caches:
        the first 2-3 forwards of a ViT are several times slower).
    progress: a tqdm description, or None for no progress bar.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    names = list(fns)
    threads = torch.get_num_threads()
    timings = {name: Timings(threads=threads) for name in names}
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                fns[name]()
        steps: Any = range(repeats)
        if progress is not None:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc=progress, unit="rep", leave=False)
        for rep in steps:
            for name in names if rep % 2 == 0 else names[::-1]:
                cpu = time.process_time()
                wall = time.perf_counter()
                fns[name]()
                wall = time.perf_counter() - wall
                cpu = time.process_time() - cpu
                timings[name].wall_s.append(wall)
                timings[name].cpu_s.append(cpu)
    return timings


def uncontended_repeats(
    timings: Mapping[str, Timings], min_utilization: float = MIN_UTILIZATION
) -> list[int]:
    """Indices of the repeats in which every function ran with at least `min_utilization` of its
    threads' CPU time (see `time_interleaved`)."""
    utils = [t.utilization for t in timings.values()]
    repeats = min(len(u) for u in utils)
    return [i for i in range(repeats) if all(u[i] >= min_utilization for u in utils)]


def robust_repeats(timings: Mapping[str, Timings]) -> tuple[list[int], bool]:
    """The repeats to take medians over, and whether the machine was busy.

    The uncontended repeats when there are enough of them (at least 3 and a quarter of all),
    else all repeats, flagged as contended: their ratio is biased (against the model with more,
    smaller ops) and should not be trusted.
    """
    repeats = min(len(t.wall_s) for t in timings.values())
    clean = uncontended_repeats(timings)
    if len(clean) == repeats or len(clean) >= max(3, repeats / 4):
        return clean, False
    return list(range(repeats)), True


def time_fn(fn: Callable[[], Any], warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds per call of one function (see `time_interleaved`)."""
    return time_interleaved({"fn": fn}, warmup, repeats)["fn"].median()


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages, or None where the OS has none. Stored with each result:
    a benchmark on a machine other jobs are using reads differently (see `time_interleaved`)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def parse_layers(spec: str | Sequence[int]) -> str | list[int]:
    """`--layers` value: "every_other", "all" or a comma list of layer indices ("1,3,-1")."""
    if not isinstance(spec, str):
        return list(spec)
    spec = spec.strip()
    if spec in ("every_other", "all"):
        return spec
    try:
        layers = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"layers must be 'every_other', 'all' or a comma list of layer indices, got {spec!r}"
        ) from None
    if not layers:
        raise ValueError("layers is empty: name at least one layer to convert")
    return layers


def _set_threads(threads: int | None) -> int:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# ----------------------------------------------------------------------------- ViT


def build_vit(model_name: str, source: str = "timm", image_size: int | None = None) -> nn.Module:
    """A randomly initialised ViT image encoder, in eval mode (no weights are downloaded:
    timing and FLOPs do not depend on the weights)."""
    if source == "timm":
        import timm

        if not timm.is_model(model_name):
            close = timm.list_models(f"*{model_name}*")[:5]
            hint = f"; similar: {', '.join(close)}" if close else ""
            raise ValueError(f"unknown timm model {model_name!r}{hint}")
        kwargs: dict[str, Any] = {} if image_size is None else {"img_size": image_size}
        model = timm.create_model(model_name, pretrained=False, **kwargs)
    elif source == "open_clip":
        import open_clip

        if model_name not in open_clip.list_models():
            raise ValueError(
                f"unknown open_clip model {model_name!r}; see open_clip.list_models() (e.g. ViT-B-16)"
            )
        kwargs = {} if image_size is None else {"force_image_size": image_size}
        model = open_clip.create_model(model_name, pretrained=None, **kwargs).visual
    else:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    return model.eval()


def _input_size(model: nn.Module, source: str) -> tuple[int, int, int]:
    if source == "timm":
        proj = model.patch_embed.proj
        return (proj.in_channels, *model.patch_embed.img_size)
    size = model.image_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    return (model.conv1.in_channels, *size)


def bench_vit(
    model_name: str,
    source: str = "timm",
    batch: int = 8,
    capacity: float = 0.125,
    layers: str | Sequence[int] = "every_other",
    image_size: int | None = None,
    warmup: int = 3,
    repeats: int = 10,
    threads: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Images/s of a dense ViT and of its MoD conversion on one random batch, against the FLOPs
    prediction.

    The MoD copy is `vlmod.apply_mod(copy.deepcopy(dense), MoDConfig(capacity, layers))` with its
    fresh zero router: routing cost does not depend on the router's weights, and the trace gives
    the token counts actually processed at each MoD layer. Returns a JSON-able dict.
    """
    try:
        # Validate the cheap inputs before building a model.
        config = vlmod.MoDConfig(capacity=capacity, layers=parse_layers(layers))
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if repeats < 1 or warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
        num_threads = _set_threads(threads)
        torch.manual_seed(seed)
        dense = build_vit(model_name, source, image_size)
        mod = vlmod.apply_mod(copy.deepcopy(dense), config)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from e

    channels, height, width = _input_size(dense, source)
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, channels, height, width, generator=generator)

    with torch.inference_mode(), vlmod.trace_routing(mod) as trace:
        mod(images)
    counts = processed_counts(trace.processed)
    dims = ViTDims.from_model(dense)
    dense_flops = vit_flops(dims)
    mod_flops = vit_flops(dims, counts)

    load_before = load_average()
    timings = time_interleaved(
        {"dense": lambda: dense(images), "mod": lambda: mod(images)},
        warmup=warmup,
        repeats=repeats,
        progress=f"{model_name} dense/MoD" if progress else None,
    )
    used, contended = robust_repeats(timings)

    def variant(name: str, flops: float) -> dict[str, Any]:
        t = timings[name]
        latency = t.median(used)
        return {
            "images_per_s": batch / latency,
            "latency_s": latency,
            "flops_per_image": flops,
            "latency_samples_s": t.wall_s,
            "cpu_utilization": [round(u, 3) for u in t.utilization],
        }

    result_dense = variant("dense", dense_flops)
    result_mod = variant("mod", mod_flops)
    predicted = dense_flops / mod_flops
    speedup = result_mod["images_per_s"] / result_dense["images_per_s"]
    # Second estimate: the median of per-repeat ratios. Each ratio compares two runs made seconds
    # apart, so it is less sensitive to slow drift than the ratio of the two medians.
    paired = statistics.median(timings["dense"].wall_s[i] / timings["mod"].wall_s[i] for i in used)
    return {
        "benchmark": "vit",
        "model": model_name,
        "source": source,
        "batch": batch,
        "image_size": [height, width],
        "capacity": capacity,
        "layers": config.layers if isinstance(config.layers, str) else list(config.layers),
        "mod_layers": sorted(counts),
        "tokens": dims.num_tokens,
        "processed_tokens": {str(i): c for i, c in counts.items()},
        "dense": result_dense,
        "mod": result_mod,
        "predicted_speedup": predicted,
        "speedup": speedup,
        "efficiency": speedup / predicted,
        "speedup_paired": paired,
        "warmup": warmup,
        "repeats": repeats,
        # Medians are over these repeats: the ones where both models had their CPU (see
        # `robust_repeats`); `contended` means there were too few and the result is unreliable.
        "timed_repeats": used,
        "contended": contended,
        "torch": torch.__version__,
        "threads": num_threads,
        "load_average": {"before": load_before, "after": load_average()},
    }


def format_vit_result(result: Mapping[str, Any]) -> str:
    """The plain-text report of `bench_vit`."""
    rows = []
    for name, label in (("dense", "dense"), ("mod", "MoD")):
        r = result[name]
        rows.append(
            [
                label,
                f"{r['images_per_s']:.2f}",
                f"{r['latency_s'] * 1e3:.1f}",
                f"{r['flops_per_image'] / 1e9:.2f}",
            ]
        )
    layers = ",".join(map(str, result["mod_layers"]))
    counts = sorted(set(round(c, 2) for c in result["processed_tokens"].values()))
    header = (
        f"{result['model']} ({result['source']}), batch {result['batch']}, "
        f"{result['image_size'][0]}x{result['image_size'][1]}, capacity {result['capacity']:g} on "
        f"{len(result['mod_layers'])} MoD layers ({layers}: "
        f"{'/'.join(f'{c:g}' for c in counts)} of {result['tokens']} tokens), "
        f"torch {result['torch']}, {result['threads']} thread{'' if result['threads'] == 1 else 's'}, "
        f"median of {len(result['timed_repeats'])}/{result['repeats']} repeats"
    )
    table = format_table(["model", "images/s", "latency ms", "GFLOPs/image"], rows)
    summary = (
        f"predicted speedup {result['predicted_speedup']:.3f}x  "
        f"measured {result['speedup']:.3f}x  "
        f"efficiency {result['efficiency']:.3f}  "
        f"(paired-repeat speedup {result['speedup_paired']:.3f}x)"
    )
    lines = [header, table, summary]
    if result["contended"]:
        lines.append(
            f"warning: other jobs held the CPU during most repeats (load average "
            f"{result['load_average']['after']}); the speedup is biased against MoD. Rerun on an idle "
            "machine, or with --threads 1 where one other job is running."
        )
    elif len(result["timed_repeats"]) < result["repeats"]:
        lines.append(
            f"note: {result['repeats'] - len(result['timed_repeats'])} repeats ran while other jobs held "
            "the CPU and were left out of the medians"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- LLaVA

# LLaVA-1.5-7B's token shapes (576 image tokens from a 336 px CLIP tower with 14 px patches, a
# ~60-token prompt, 32 decoder layers, Llama's MLP ratio 11008/4096) at a width that runs on a
# laptop CPU; the vision tower is kept small, as it is a small share of a 7B model's compute.
CPU_7B_SHAPES: dict[str, Any] = dict(
    width=512, layers=32, heads=8, kv_heads=8, mlp_ratio=11008 / 4096,
    vision_width=64, vision_layers=2, image_size=336, patch_size=14,
)
TINY_SHAPES: dict[str, Any] = dict(
    width=64, layers=4, heads=4, kv_heads=2, vision_width=32, vision_layers=2, image_size=32, patch_size=8,
    prompt_tokens=12,
)
LLAVA_PRESETS: dict[str, dict[str, Any]] = {
    "llava-1.5": dict(family="llava", **CPU_7B_SHAPES, prompt_tokens=60),
    "tiny": dict(family="llava", **TINY_SHAPES),
}


def build_llava(
    model: str | None = None, preset: str | None = None, presets: Mapping[str, Mapping[str, Any]] | None = None
) -> tuple[nn.Module, Any, int]:
    """(model, processor, prompt words) of a checkpoint (path or hub id) or of a preset built
    from config with random weights; `presets` defaults to `LLAVA_PRESETS`."""
    from vlmod import tiny

    if model is not None:
        from transformers import AutoProcessor

        from vlmod.hf import load_config, model_class

        try:
            cls = model_class(load_config(model))
            return cls.from_pretrained(model).eval(), AutoProcessor.from_pretrained(model), 60
        except (FileNotFoundError, TypeError) as e:
            raise InputError(str(e)) from e
    presets = LLAVA_PRESETS if presets is None else presets
    if preset not in presets:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(presets)}")
    settings = dict(presets[preset])
    prompt = settings.pop("prompt_tokens")
    family = settings.pop("family")
    built, processor = tiny.build(family, **settings)
    return built, processor, prompt


def synthetic_image(size: int = 336, seed: int = 0) -> Any:
    """A deterministic RGB test picture: coloured shapes on a gradient."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size, dtype=np.float64)
    base = np.stack([np.add.outer(ramp, ramp) / 2, np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size))], -1)
    image = Image.fromarray(base.astype("uint8"))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.integers(0, size - size // 4, 2)
        r = int(rng.integers(size // 12, size // 5))
        draw.ellipse([x, y, x + r, y + r], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return image


def prompt_text(words: int) -> str:
    """A question of about `words` words."""
    from vlmod.tiny import WORDS

    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def _kv_cache_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _vision_images(inputs: Mapping[str, Any]) -> int:
    """How many pictures (images, anyres tiles, video frames) the vision tower encodes."""
    n = 0
    for key in ("pixel_values", "pixel_values_videos"):
        value = inputs.get(key)
        if isinstance(value, torch.Tensor):
            n += value.shape[0] * (value.shape[1] if value.dim() == 5 else 1)
    return n


def generation_flops(model: nn.Module, inputs: Mapping[str, Any], trace: Any | None) -> dict[str, float]:
    """Prefill FLOPs per sequence: vision tower (every picture) + language backbone."""
    from vlmod.flops import DecoderDims, hf_vision_dims, language_prefill_flops

    batch = inputs["input_ids"].shape[0]
    processed = trace.processed if trace is not None else {}
    vision = vit_flops(hf_vision_dims(model.config.vision_config), processed_counts(processed, "vision"))
    vision *= _vision_images(inputs) / batch
    tokens = float(inputs["attention_mask"].sum(1, dtype=torch.float64).mean())
    language = language_prefill_flops(
        DecoderDims.from_config(model.config.text_config), tokens, processed_counts(processed, "language")
    )
    return {"vision": vision, "language": language, "total": vision + language}


def generation_footprint(
    dense: nn.Module, mod: nn.Module, inputs: Mapping[str, Any]
) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """({"dense"|"mod": generation_flops}, {"dense"|"mod": KV-cache bytes}) after one prefill of
    each model: what both benchmarks of generation hold their timings against. The FLOPs also hold
    "language_causal" and "total_causal" (see `causal_language_flops`)."""
    with torch.inference_mode():
        with vlmod.trace_routing(mod) as trace:
            mod_cache = mod(**inputs, use_cache=True, logits_to_keep=1).past_key_values
        dense_cache = dense(**inputs, use_cache=True, logits_to_keep=1).past_key_values
    flops = {"dense": generation_flops(dense, inputs, None), "mod": generation_flops(mod, inputs, trace)}
    for name, model, tr in (("dense", dense, None), ("mod", mod, trace)):
        causal = causal_language_flops(model, inputs, tr)
        flops[name].update(language_causal=causal, total_causal=flops[name]["vision"] + causal)
    return flops, {"dense": _kv_cache_bytes(dense_cache), "mod": _kv_cache_bytes(mod_cache)}


def causal_language_flops(model: nn.Module, inputs: Mapping[str, Any], trace: Any | None) -> float:
    """Language prefill FLOPs per sequence counting only the attention scores a causal kernel
    computes: each query attends to (n + 1) / 2 keys on average, not n.

    Why a second count: `vlmod.flops` counts the full n x n square (what a dense-mask kernel
    computes), but the prefill kernels actually used (sdpa with is_causal, flash) skip the masked
    half. Attention shrinks quadratically under MoD and the linears only linearly, so the full-square
    count overstates MoD's gain wherever attention is a large share of a layer: at the video preset's
    width (512, ~1190 tokens) attention is ~28% of the counted FLOPs, at LLaVA-NeXT-Video-7B's width
    (4096) ~5%.
    """
    from vlmod.flops import DecoderDims, decoder_layer_flops, linear_flops, router_flops

    dims = DecoderDims.from_config(model.config.text_config)
    counts = processed_counts(trace.processed, "language") if trace is not None else {}
    tokens = float(inputs["attention_mask"].sum(1, dtype=torch.float64).mean())
    total = linear_flops(1, dims.dim, dims.vocab)
    for layer in range(dims.layers):
        n = counts.get(layer, tokens)
        total += decoder_layer_flops(dims, n, (n + 1) / 2)
        if layer in counts:
            total += router_flops(tokens, dims.dim)
    return total


def bench_generation(
    dense: nn.Module,
    mod: nn.Module,
    inputs: Mapping[str, Any],
    new_tokens: int = 16,
    warmup: int = 1,
    repeats: int = 5,
    progress: bool = True,
) -> dict[str, Any]:
    """Prefill latency, decode tokens/s, KV-cache bytes and FLOPs of a dense LLaVA model and its
    MoD conversion on the same processed inputs (dense and MoD runs interleaved)."""
    batch = inputs["input_ids"].shape[0]
    flops, kv = generation_footprint(dense, mod, inputs)
    models = {"dense": dense, "mod": mod}
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    prefill = time_interleaved(
        {n: (lambda m=m: m(**inputs, use_cache=True, logits_to_keep=1)) for n, m in models.items()},
        warmup=warmup, repeats=repeats, progress="prefill dense/MoD" if progress else None,
    )
    generate = time_interleaved(
        {n: (lambda m=m: m.generate(**inputs, **gen)) for n, m in models.items()},
        warmup=warmup, repeats=repeats, progress="generate dense/MoD" if progress else None,
    )
    used, contended = robust_repeats(prefill)
    result: dict[str, Any] = {}
    for name in models:
        prefill_s = prefill[name].median(used)
        # generate = prefill + (new_tokens - 1) decode steps
        decode_s = max(generate[name].median() - prefill_s, 1e-9)
        result[name] = {
            "prefill_s": prefill_s,
            "generate_s": generate[name].median(),
            "decode_tokens_per_s": batch * max(new_tokens - 1, 1) / decode_s,
            "kv_cache_bytes": kv[name],
            "flops": flops[name]["total"],
            "flops_vision": flops[name]["vision"],
            "flops_language": flops[name]["language"],
        }
    result["predicted_speedup"] = flops["dense"]["total"] / flops["mod"]["total"]
    result["speedup"] = result["dense"]["prefill_s"] / result["mod"]["prefill_s"]
    result["efficiency"] = result["speedup"] / result["predicted_speedup"]
    result["decode_speedup"] = result["mod"]["decode_tokens_per_s"] / result["dense"]["decode_tokens_per_s"]
    result["kv_cache_reduction"] = 1.0 - kv["mod"] / kv["dense"]
    result["mod_layers"] = {f"{p}:{i}": c for (p, i), c in vlmod.mod_layers(mod).items()}
    result["contended"] = contended
    result["timed_repeats"] = used
    result["repeats"] = repeats
    return result


def bench_llava(
    model: str | None = None,
    preset: str | None = "llava-1.5",
    capacity: float = 0.5,
    layers: str | Sequence[int] = "every_other",
    batch: int = 1,
    new_tokens: int = 16,
    warmup: int = 1,
    repeats: int = 5,
    threads: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Dense vs MoD generation of a LLaVA model on one synthetic image and prompt."""
    try:
        config = vlmod.MoDConfig(capacity=capacity, layers=parse_layers(layers))
        if batch < 1 or new_tokens < 1:
            raise ValueError(f"batch and new_tokens must be >= 1, got {batch} and {new_tokens}")
        num_threads = _set_threads(threads)
    except ValueError as e:
        raise InputError(str(e)) from e
    dense, processor, words = build_llava(model, None if model else preset)
    try:
        mod = vlmod.apply_mod(copy.deepcopy(dense), config)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from e
    size = dense.config.vision_config.image_size
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt_text(words)}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = dict(
        processor(images=[synthetic_image(size, i) for i in range(batch)], text=[text] * batch, return_tensors="pt", padding=True)
    )
    result = bench_generation(dense, mod, inputs, new_tokens, warmup, repeats, progress)
    image_tokens = int((inputs["input_ids"][0] == dense.config.image_token_id).sum())
    result.update(
        benchmark="llava",
        model=model or f"preset:{preset}",
        batch=batch,
        capacity=capacity,
        layers=config.layers if isinstance(config.layers, str) else list(config.layers),
        image_tokens=image_tokens,
        prompt_tokens=int(inputs["attention_mask"][0].sum()) - image_tokens,
        language_layers=dense.config.text_config.num_hidden_layers,
        new_tokens=new_tokens,
        torch=torch.__version__,
        threads=num_threads,
        load_average=load_average(),
    )
    return result


def format_generation_result(result: Mapping[str, Any], extra: Sequence[tuple[str, str]] = ()) -> str:
    """The plain-text report of `bench_llava` / `bench_video`."""
    extra_names = [name for name, _ in extra]
    rows = []
    for name, label in (("dense", "dense"), ("mod", "MoD")):
        r = result[name]
        rows.append(
            [label]
            + [f"{r[key]:.2f}" for _, key in extra]
            + [
                f"{r['prefill_s'] * 1e3:.1f}",
                f"{r['decode_tokens_per_s']:.1f}",
                f"{r['kv_cache_bytes'] / 2**20:.2f}",
                f"{r['flops'] / 1e9:.2f}",
            ]
        )
    header = (
        f"{result['model']}: batch {result['batch']}, {result['image_tokens']} vision + "
        f"{result['prompt_tokens']} text tokens, {len(result['mod_layers'])} MoD layers at capacity "
        f"{result['capacity']:g}, {result['new_tokens']} new tokens, torch {result['torch']}, "
        f"{result['threads']} threads"
    )
    table = format_table(
        ["model", *extra_names, "prefill ms", "decode tok/s", "KV cache MiB", "GFLOPs/seq"], rows
    )
    summary = (
        f"predicted prefill speedup {result['predicted_speedup']:.3f}x  measured {result['speedup']:.3f}x  "
        f"efficiency {result['efficiency']:.3f}  decode {result['decode_speedup']:.2f}x  "
        f"KV cache -{100 * result['kv_cache_reduction']:.1f}%"
    )
    lines = [header, table, summary]
    if result["contended"]:
        lines.append("warning: other jobs held the CPU during most repeats; the speedup is biased against MoD")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- video

# LLaVA-NeXT-Video-7B's token shapes: a 336 px CLIP tower with 14 px patches (24 x 24 = 576 patches
# per frame) pooled 2 x 2 (spatial_pool_stride=2) to 144 tokens per frame, a ~40-token prompt,
# 32 decoder layers with Llama's MLP ratio 11008/4096, at a width that runs on a laptop CPU (8
# frames: a prefill of ~1190 tokens in a few seconds). The vision tower is kept small, as in the
# LLaVA preset. "tiny" and "tiny-onevision" are for tests (seconds to build and run).
VIDEO_PRESETS: dict[str, dict[str, Any]] = {
    "llava-next-video-7b": dict(family="llava_next_video", **CPU_7B_SHAPES, prompt_tokens=35),
    "tiny": dict(family="llava_next_video", **TINY_SHAPES),
    "tiny-onevision": dict(family="llava_onevision", **TINY_SHAPES),
}
# Prompt words for a checkpoint (`--model`): about the prompt length of the preset.
VIDEO_PROMPT_WORDS = 35


def synthetic_clip(
    path: str | os.PathLike[str], seconds: float = 3.0, fps: int = 10, size: tuple[int, int] = (360, 640), seed: int = 0
) -> Path:
    """Write a deterministic test clip (H.264 mp4): a coloured square moving across a textured
    background. Texture and motion make the encoder do real work, so decoding it costs what
    decoding a real clip of this size costs."""
    import numpy as np

    from vlmod.video import write_video

    height, width = size
    frames = max(1, round(seconds * fps))
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / width * 200, yy / height * 200, (xx + yy) / (width + height) * 120], -1)
    base += rng.normal(0, 18, (height, width, 1)).astype(np.float32)  # texture
    side = max(2, min(height, width) // 4)
    clip = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        frame = base.copy()
        x = int((width - side) * t / max(frames - 1, 1))
        y = int((height - side) * (0.5 + 0.4 * np.sin(2 * np.pi * t / max(frames, 1))))
        frame[y : y + side, x : x + side] = (230, 40 + 180 * t / max(frames, 1), 60)
        clip[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return write_video(path, clip, fps=fps)


def _default_video_layers(num_layers: int) -> list[int]:
    """Every decoder layer but the first two and the last: the layers whose vision tokens are the
    most redundant (the first layers mix them into the text, the last one feeds the LM head)."""
    return list(range(2, num_layers - 1))


def _load_clip(path: Path, frames: int) -> Any:
    from vlmod.video import VideoError, load_video

    try:
        return load_video(path, num_frames=frames)
    except (FileNotFoundError, VideoError) as e:
        raise InputError(str(e)) from None


STAGES = ("decode_video_s", "preprocess_s", "generate_s", "first_token_s", "decode_steps_s")


def _stage_medians(stages: Sequence[Sequence[float]], used: Sequence[int]) -> dict[str, float]:
    picked = [stages[i] for i in used]
    return {name: statistics.median(s[k] for s in picked) for k, name in enumerate(STAGES)}


class _StepClock:
    """A logits processor that only notes when it is called: once per generated token, right
    after that token's forward. The first call ends the prefill; the calls after it time the
    decode steps inside the very generate call being timed (a difference of two separately timed
    medians is far noisier)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def bench_video(
    model: str | None = None,
    preset: str | None = "llava-next-video-7b",
    video: str | os.PathLike[str] | None = None,
    frames: int = 8,
    batch: int = 1,
    capacity: float = 0.5,
    layers: str | Sequence[int] | None = None,
    new_tokens: int = 16,
    warmup: int = 1,
    repeats: int = 5,
    threads: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Dense vs MoD video question answering, end to end: decode the clip's frames, preprocess
    them, run the vision tower and the prefill, generate `new_tokens` tokens.

    Why end to end: video is where MoD pays most (8 frames x 144 tokens dwarf the prompt), but
    what a user gets is frames/s of the whole pipeline, and decoding and preprocessing do not
    shrink. So the result gives both: `speedup` (measured end-to-end frames/s, MoD over dense)
    and `prefill_speedup` against `predicted_speedup` (the FLOPs ratio of what the models run:
    vision tower + language prefill), plus the time split and the frames/s of decoding alone.

    layers: None for every decoder layer but the first two and the last, else "every_other",
        "all" or a list of indices. video: a file, or None for a generated clip (`synthetic_clip`).
    """
    try:
        config_layers = None if layers is None else parse_layers(layers)
        vlmod.MoDConfig(capacity=capacity, layers=config_layers or "all")
        if min(frames, batch, new_tokens) < 1:
            raise ValueError(f"frames, batch and new_tokens must be >= 1, got {frames}, {batch} and {new_tokens}")
        num_threads = _set_threads(threads)
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
        dense, processor, words = build_llava(model, None if model else preset, VIDEO_PRESETS)
        if model is not None:
            words = VIDEO_PROMPT_WORDS
        if getattr(processor, "video_processor", None) is None:
            raise InputError(f"the processor of {model} has no video processor: it cannot prepare video inputs")
        num_layers = dense.config.text_config.num_hidden_layers
        config_layers = _default_video_layers(num_layers) if config_layers is None else config_layers
        try:
            mod = vlmod.apply_mod(copy.deepcopy(dense), vlmod.MoDConfig(capacity=capacity, layers=config_layers))
        except (ValueError, TypeError) as e:
            raise InputError(str(e)) from e
        result = _time_video(dense, mod, processor, path, clip, words, batch, new_tokens, warmup, repeats, progress)
    result.update(
        benchmark="video",
        model=model or f"preset:{preset}",
        video=source,
        frames_requested=frames,
        batch=batch,
        capacity=capacity,
        layers=config_layers if isinstance(config_layers, str) else list(config_layers),
        language_layers=num_layers,
        new_tokens=new_tokens,
        warmup=warmup,
        repeats=repeats,
        torch=torch.__version__,
        threads=num_threads,
        load_average=load_average(),
    )
    return result


def _check_video_checkpoint(model: str) -> None:
    """Refuse an image-only checkpoint from its config, before its weights are loaded."""
    from vlmod.hf import load_config, model_class

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
    from vlmod.video import load_video

    info = load_video(path, num_frames=1)
    height, width = info.frames.shape[1:3]
    return f"{info.total_frames} frames, {width}x{height}, {info.fps:g} fps"


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
) -> dict[str, Any]:
    """The timed part of `bench_video` (models built, clip checked)."""
    from vlmod.video import load_video

    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt_text(words)}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    num_frames = len(clip.frames)
    dtype = next(dense.parameters()).dtype

    def preprocess(videos: list[Any]) -> dict[str, Any]:
        out = processor(videos=videos, text=[text] * batch, return_tensors="pt", padding=True)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}

    inputs = preprocess([clip.frames] * batch)
    flops, kv = generation_footprint(dense, mod, inputs)
    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    models = {"dense": dense, "mod": mod}
    stages: dict[str, list[tuple[float, ...]]] = {name: [] for name in models}
    from transformers import LogitsProcessorList

    clock = _StepClock()
    processors = LogitsProcessorList([clock])

    def pipeline(name: str) -> None:
        t0 = time.perf_counter()
        videos = [load_video(path, num_frames=num_frames).frames for _ in range(batch)]
        t1 = time.perf_counter()
        batch_inputs = preprocess(videos)
        clock.times.clear()
        t2 = time.perf_counter()
        models[name].generate(**batch_inputs, **gen, logits_processor=processors)
        t3 = time.perf_counter()
        ticks = clock.times
        stages[name].append((t1 - t0, t2 - t1, t3 - t2, ticks[0] - t2, ticks[-1] - ticks[0]))

    decode = time_interleaved(
        {"decode": lambda: load_video(path, num_frames=num_frames)}, warmup=warmup, repeats=repeats
    )["decode"]
    prefill = time_interleaved(
        {n: (lambda m=m: m(**inputs, use_cache=True, logits_to_keep=1)) for n, m in models.items()},
        warmup=warmup, repeats=repeats, progress="prefill dense/MoD" if progress else None,
    )
    end_to_end = time_interleaved(
        {n: (lambda n=n: pipeline(n)) for n in models},
        warmup=warmup, repeats=repeats, progress="end to end dense/MoD" if progress else None,
    )
    prefill_used, prefill_contended = robust_repeats(prefill)
    e2e_used, e2e_contended = robust_repeats(end_to_end)
    result: dict[str, Any] = {}
    for name in models:
        split = _stage_medians(stages[name][-repeats:], e2e_used)
        latency = end_to_end[name].median(e2e_used)
        prefill_s = prefill[name].median(prefill_used)
        # new_tokens - 1 decode steps follow the token the prefill gives
        steps = new_tokens - 1
        result[name] = {
            "frames_per_s": batch * num_frames / latency,
            "end_to_end_s": latency,
            "prefill_s": prefill_s,
            "decode_tokens_per_s": batch * steps / split["decode_steps_s"] if steps else None,
            "kv_cache_bytes": kv[name],
            "flops": flops[name]["total"],
            "flops_vision": flops[name]["vision"],
            "flops_language": flops[name]["language"],
            "flops_causal_attention": flops[name]["total_causal"],
            "time_split": split,
            "end_to_end_samples_s": end_to_end[name].wall_s,
            "prefill_samples_s": prefill[name].wall_s,
            "cpu_utilization": [round(u, 3) for u in end_to_end[name].utilization],
        }
    predicted = flops["dense"]["total"] / flops["mod"]["total"]
    predicted_causal = flops["dense"]["total_causal"] / flops["mod"]["total_causal"]
    prefill_speedup = result["dense"]["prefill_s"] / result["mod"]["prefill_s"]
    video_tokens = int((inputs["input_ids"][0] == dense.config.video_token_id).sum())
    result.update(
        frames=num_frames,
        video_tokens=video_tokens,
        prompt_tokens=int(inputs["attention_mask"][0].sum()) - video_tokens,
        predicted_speedup=predicted,
        speedup=result["mod"]["frames_per_s"] / result["dense"]["frames_per_s"],
        prefill_speedup=prefill_speedup,
        prefill_efficiency=prefill_speedup / predicted,
        # The same with attention counted as a causal kernel computes it (`causal_language_flops`).
        predicted_speedup_causal_attention=predicted_causal,
        prefill_efficiency_causal_attention=prefill_speedup / predicted_causal,
        decode_speedup=(
            result["mod"]["decode_tokens_per_s"] / result["dense"]["decode_tokens_per_s"] if new_tokens > 1 else None
        ),
        kv_cache_reduction=1.0 - kv["mod"] / kv["dense"],
        decode_only_frames_per_s=num_frames / decode.median(),
        decode_only_s=decode.median(),
        mod_layers={f"{p}:{i}": c for (p, i), c in vlmod.mod_layers(mod).items()},
        contended=prefill_contended or e2e_contended,
        timed_repeats={"prefill": prefill_used, "end_to_end": e2e_used},
    )
    return result


def format_video_result(result: Mapping[str, Any]) -> str:
    """The plain-text report of `bench_video`: throughput, where the time goes, and the prefill
    speedup against its FLOPs prediction."""
    rows = []
    for name, label in (("dense", "dense"), ("mod", "MoD")):
        r = result[name]
        split = r["time_split"]
        rows.append(
            [
                label,
                f"{r['frames_per_s']:.2f}",
                f"{r['end_to_end_s'] * 1e3:.0f}",
                f"{split['decode_video_s'] * 1e3:.1f}",
                f"{split['preprocess_s'] * 1e3:.1f}",
                f"{split['first_token_s'] * 1e3:.0f}",
                f"{split['decode_steps_s'] * 1e3:.0f}",
                f"{r['prefill_s'] * 1e3:.0f}",
                "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}",
                f"{r['kv_cache_bytes'] / 2**20:.2f}",
                f"{r['flops'] / 1e9:.4g}",
            ]
        )
    layers = sorted(int(k.split(":")[1]) for k in result["mod_layers"])
    contiguous = len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1))
    span = f"{layers[0]}-{layers[-1]}" if contiguous else ",".join(map(str, layers))
    header = (
        f"{result['model']}: {result['video']}; batch {result['batch']} x {result['frames']} frames, "
        f"{result['video_tokens']} video + {result['prompt_tokens']} text tokens per sequence, "
        f"{len(layers)} MoD layer{'' if len(layers) == 1 else 's'} ({span} of {result['language_layers']}) at capacity {result['capacity']:g}, "
        f"{result['new_tokens']} new tokens, torch {result['torch']}, {result['threads']} threads, "
        f"median of {len(result['timed_repeats']['end_to_end'])}/{result['repeats']} repeats"
    )
    table = format_table(
        [
            "model", "frames/s", "end-to-end ms", "decode video ms", "preprocess ms", "first token ms",
            "decode steps ms", "prefill ms", "decode tok/s", "KV cache MiB", "GFLOPs/seq",
        ],
        rows,
    )
    decode = "-" if result["decode_speedup"] is None else f"{result['decode_speedup']:.2f}x"
    summary = (
        f"prefill (vision + language): predicted speedup {result['predicted_speedup']:.3f}x  measured "
        f"{result['prefill_speedup']:.3f}x  efficiency {result['prefill_efficiency']:.3f}\n"
        f"  attention counted as a causal kernel computes it: predicted "
        f"{result['predicted_speedup_causal_attention']:.3f}x  efficiency "
        f"{result['prefill_efficiency_causal_attention']:.3f}\n"
        f"end to end: {result['speedup']:.3f}x frames/s  decode {decode} tokens/s  "
        f"KV cache -{100 * result['kv_cache_reduction']:.1f}%  video decoding alone: "
        f"{result['decode_only_frames_per_s']:.1f} frames/s"
    )
    lines = [header, table, summary]
    if result["contended"]:
        lines.append("warning: other jobs held the CPU during most repeats; the speedups are biased against MoD")
    return "\n".join(lines)
