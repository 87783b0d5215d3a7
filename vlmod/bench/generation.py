"""`bench llava` and the generation timing `bench video` shares: prefill latency, decode speed per
step, KV cache, peak memory and FLOPs of a dense LLaVA model and its MoD conversion.

Decode is timed by a clock inside `generate` (`StepClock`, a logits processor that notes each
token's time), in the very calls being timed, dense and MoD calls alternating: a decode figure
is a median of real steps, never a difference of two separately timed medians (under load that
difference printed 15,000,000,000 tokens/s).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    decode_weight_bytes,
    generation_footprint,
    shared_copy,
    timed_lockstep,
)
from vlmod.bench.inputs import on_device, parse_layers, prompt_text, synthetic_image
from vlmod.bench.timing import (
    contention,
    describe_device,
    keeps_threads,
    load_average,
    paired_ratio,
    peak_memory_bytes,
    peak_memory_change,
    set_threads,
    time_interleaved,
)
from vlmod.errors import InputError

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
    # The real model (`vlmod.models.scale`): width 4096, the CLIP-L/336 tower, bfloat16; for a GPU.
    "llava-1.5-7b-full": dict(shape="llava-1.5-7b", prompt_tokens=60),
    "tiny": dict(family="llava", **TINY_SHAPES),
}
DEFAULT_CAPACITY = 0.5
DEFAULT_LAYERS = "every_other"


def build_preset(
    preset: str | None,
    presets: Mapping[str, Mapping[str, Any]],
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> tuple[nn.Module, Any, int]:
    """(model, processor, prompt words) of a preset built from config with random weights, on
    `device`. dtype None or "auto": float32 for the small presets, bfloat16 for the real 7B shapes
    (built straight on `device` in that dtype: a float32 7B would not fit where a bf16 one runs)."""
    from vlmod.io.hf import torch_dtype
    from vlmod.models import scale, tiny

    if preset not in presets:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(presets)}")
    settings = dict(presets[preset])
    prompt = settings.pop("prompt_tokens")
    wanted = torch_dtype(dtype)
    if "shape" in settings:
        wanted = torch.bfloat16 if wanted == "auto" else wanted
        built, processor = scale.build_model(settings["shape"], dtype=wanted, device=device)
        return built, processor, prompt
    built, processor = tiny.build(settings.pop("family"), **settings)
    return built.to(device=device, dtype=None if wanted == "auto" else wanted), processor, prompt


def build_pair(
    model: str | None,
    preset: str | None,
    presets: Mapping[str, Mapping[str, Any]],
    capacity: float | None,
    layers: str | Sequence[int] | None,
    default_layers: Any = DEFAULT_LAYERS,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> tuple[nn.Module, nn.Module, Any, int, str]:
    """(dense, mod, processor, prompt words, where the MoD layers come from).

    A checkpoint saved converted is measured as saved: its own MoD layers and capacities, against
    the same weights loaded dense (routers dropped); asking for other layers or capacities then is
    an error rather than a silent reconversion. A plain checkpoint or a preset is converted with
    `capacity` and `layers` (defaults when None); `default_layers` may be a function of the number
    of language layers. device, dtype: where both models run and in what dtype (None or "auto": the
    checkpoint's own, or the preset's, `build_preset`).
    """
    words = 60
    if model is not None:
        from vlmod.io.hf import load_config, load_vlm, loading_kwargs, part_configs, vlm_class

        vlm_class(model, InputError, "bench measures")  # a missing or foreign checkpoint: one line
        settings = getattr(load_config(model), "vlmod", None)
        if settings and (capacity is not None or layers is not None):
            parts = ", ".join(f"{part}: capacity {c.capacity:g}, layers {c.layers}" for part, c in part_configs(settings).items())
            raise InputError(
                f"{model} is already converted to MoD ({parts}); drop --capacity / --layers to measure it "
                "as saved, or give the plain checkpoint to convert it otherwise"
            )
        mod, processor = load_vlm(
            model, InputError, "bench measures", converted=True, **loading_kwargs(dtype or "auto", device)
        )
        if vlmod.mod_layers(mod):
            dense = vlmod.remove_mod(shared_copy(mod))
            return dense.eval(), mod.eval(), processor, words, "the checkpoint's own MoD layers"
        dense = mod.eval()
    else:
        dense, processor, words = build_preset(preset, presets, device, dtype)
    if layers is None:
        layers = default_layers(dense.config.text_config.num_hidden_layers) if callable(default_layers) else default_layers
    capacity = DEFAULT_CAPACITY if capacity is None else capacity
    try:
        config = vlmod.MoDConfig(capacity=capacity, layers=parse_layers(layers))
        mod = vlmod.apply_mod(shared_copy(dense), config)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from e
    return dense, mod, processor, words, "converted here"


def timed_prefill(
    dense: nn.Module,
    mod: nn.Module,
    inputs: Mapping[str, Any],
    cache: str,
    new_tokens: int,
    warmup: int,
    repeats: int,
    progress: bool,
    control: bool = False,
) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Prefill timings of both models, interleaved, their contention verdict, and the paired
    figures: `prefill_speedup_paired` (the median of the per-repeat dense / MoD ratios) and, with
    `control`, `prefill_control`: a second dense model over the same weights joins the rotation,
    and its dense / dense ratio is what the machine's noise alone makes of two identical models (a
    gap smaller than that is not resolved)."""
    timed = {"dense": dense, "dense_control": shared_copy(dense), "mod": mod} if control else {"dense": dense, "mod": mod}
    prefill = time_interleaved(
        {n: (lambda m=m: m(**inputs, **cache_kwargs(m, cache, new_tokens), use_cache=True, logits_to_keep=1))
         for n, m in timed.items()},
        warmup=warmup, repeats=repeats, progress="prefill dense/MoD" if progress else None,
        device=inputs["input_ids"].device,
    )
    judged = contention(prefill)
    pairs: dict[str, Any] = {"prefill_speedup_paired": paired_ratio(prefill["dense"], prefill["mod"], judged.clean_repeats)}
    if control:
        pairs["prefill_control"] = {
            "ratio": paired_ratio(prefill["dense"], prefill["dense_control"], judged.clean_repeats),
            "control_s": prefill["dense_control"].median(judged.clean_repeats),
            "samples_s": prefill["dense_control"].wall_s,
        }
    return prefill, judged, pairs


def bench_generation(
    dense: nn.Module,
    mod: nn.Module,
    inputs: Mapping[str, Any],
    new_tokens: int = 16,
    warmup: int = 1,
    repeats: int = 5,
    progress: bool = True,
    pad_token_id: int = 0,
    cache: str = DEFAULT_CACHE,
    decode_bound: bool = False,
    control: bool = False,
    compile: bool = False,  # noqa: A002
) -> dict[str, Any]:
    """Prefill latency, decode per step, KV-cache bytes, peak memory of generate and FLOPs of a
    dense LLaVA model and its MoD conversion on the same processed inputs (runs interleaved), both
    with a KV cache of kind `cache` (`CACHES`); `decode_bound` adds `routing_bypassed(mod)` to the
    lockstep decode. control: a second dense model over the same weights joins the prefill
    rotation, and the dense / dense ratio it gives (`prefill_control`) is what the machine's noise
    alone makes of two identical models: a gap smaller than that is not resolved. compile: both
    models decode compiled (`vlmod.compile`, the prefill stays eager), what compiling costs in
    `compile`, no lockstep decode. The models and inputs are on one device; on a GPU every timing
    waits for it."""
    from transformers import LogitsProcessorList

    device = inputs["input_ids"].device
    batch = inputs["input_ids"].shape[0]
    flops, kv = generation_footprint(dense, mod, inputs)
    models = {"dense": dense, "mod": mod}
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
    compiled = compile_decoding(models, inputs, gen, cache) if compile else None
    prefill, prefill_judged, prefill_pairs = timed_prefill(
        dense, mod, inputs, cache, new_tokens, warmup, repeats, progress, control
    )
    clocks = {name: StepClock() for name in models}

    def generate(name: str) -> None:
        kv = cache_kwargs(models[name], cache, new_tokens)
        clocks[name].start()
        models[name].generate(**inputs, **gen, **kv, logits_processor=LogitsProcessorList([clocks[name]]))

    timings = time_interleaved(
        {n: (lambda n=n: generate(n)) for n in models},
        warmup=warmup, repeats=repeats, progress="generate dense/MoD" if progress else None, device=device,
    )
    decode, decode_judged, paired = decode_figures(clocks, timings, repeats, batch)
    lockstep = None
    if new_tokens > 1 and not compile:
        lockstep = timed_lockstep(models, inputs, new_tokens * repeats, cache, decode_bound)
    peaks = {
        n: peak_memory_bytes(lambda m=m: m.generate(**inputs, **gen, **cache_kwargs(m, cache, new_tokens)), device)
        for n, m in models.items()
    }
    result: dict[str, Any] = {}
    for name in models:
        result[name] = {
            **model_figures(models[name], prefill[name].median(prefill_judged.clean_repeats), decode[name], kv[name],
                            peaks[name], flops[name]),
            "generate_s": timings[name].median(decode_judged.clean_repeats),
            "prefill_samples_s": prefill[name].wall_s,
        }
    result["decode_lockstep"] = lockstep
    result["compile"] = compiled
    result.update(speedups(result, flops, kv))
    result.update(prefill_pairs)
    result.update(
        decode_speedup_paired=paired,
        contended=prefill_judged.contended or decode_judged.contended,
        contention={"prefill": prefill_judged.as_dict(), "decode": decode_judged.as_dict()},
        timed_repeats={"prefill": prefill_judged.clean_repeats, "generate": decode_judged.clean_repeats},
        repeats=repeats,
        warmup=warmup,
        cache=cache,
        device=describe_device(device),
        dtype=str(next(dense.parameters()).dtype).removeprefix("torch."),
    )
    return result



def model_figures(
    model: nn.Module,
    prefill_s: float,
    decode: Mapping[str, Any],
    kv_bytes: int,
    peak_bytes: int | None,
    flops: Mapping[str, float],
) -> dict[str, Any]:
    """The figures of one model (dense or MoD) that every generation benchmark reports.

    `decode_read_bytes`, what a decode step reads from memory (the language model's weights once,
    one embedding row aside, and the KV cache the prefill left), is decode's prediction: at a small batch a step does a few
    FLOPs per byte read, so its time follows the bytes, not the FLOPs."""
    return {
        "prefill_s": prefill_s,
        **decode,
        "kv_cache_bytes": kv_bytes,
        "decode_read_bytes": decode_weight_bytes(model) + kv_bytes,
        "peak_memory_bytes": peak_bytes,
        "flops": flops["total"],
        "flops_vision": flops["vision"],
        "flops_language": flops["language"],
        "flops_causal_attention": flops["total_causal"],
    }


def speedups(
    result: Mapping[str, Mapping[str, Any]], flops: Mapping[str, Mapping[str, float]], kv: Mapping[str, int]
) -> dict[str, Any]:
    """Prefill against both FLOPs predictions, decode, KV cache and peak memory, MoD over dense."""
    d, m = result["dense"], result["mod"]
    predicted = flops["dense"]["total"] / flops["mod"]["total"]
    causal = flops["dense"]["total_causal"] / flops["mod"]["total_causal"]
    prefill = d["prefill_s"] / m["prefill_s"]
    decode = d["decode_step_s"] / m["decode_step_s"] if d["decode_step_s"] and m["decode_step_s"] else None
    predicted_decode = d["decode_read_bytes"] / m["decode_read_bytes"]
    lockstep = (result.get("decode_lockstep") or {}).get("speedup")
    peak = peak_memory_change(d, m)
    return {
        "predicted_speedup": predicted,
        "prefill_speedup": prefill,
        "prefill_efficiency": prefill / predicted,
        "predicted_speedup_causal_attention": causal,
        "prefill_efficiency_causal_attention": prefill / causal,
        "decode_speedup": decode,
        "predicted_decode_speedup": predicted_decode,
        "decode_efficiency": None if lockstep is None else lockstep / predicted_decode,
        "kv_cache_reduction": 1.0 - kv["mod"] / kv["dense"] if kv["dense"] else 0.0,
        "peak_memory_change": peak,
    }


def prompt_counts(inputs: Mapping[str, Any], media_token_id: int | None) -> tuple[int, int]:
    """(media tokens, text tokens) of the first row: real tokens only, never negative."""
    ids, mask = inputs["input_ids"][0], inputs["attention_mask"][0].bool()
    media = (ids == media_token_id) & mask if media_token_id is not None else torch.zeros_like(mask)
    return int(media.sum()), int((mask & ~media).sum())


@keeps_threads
def bench_llava(
    model: str | None = None,
    preset: str | None = "llava-1.5",
    capacity: float | None = None,
    layers: str | Sequence[int] | None = None,
    batch: int = 1,
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
    """Dense vs MoD generation of a LLaVA model on synthetic images and a prompt.

    capacity / layers: how to convert a preset or a plain checkpoint (None: 0.5, every other
    layer). A checkpoint saved converted is measured with its own MoD layers (see `build_pair`).
    cache: the KV cache both models generate with (`CACHES`). threads: torch's intra-op threads
    while the benchmark runs (the caller's count is restored afterwards). decode_bound: also decode
    in lockstep with MoD's routing bypassed (`routing_bypassed`). control: time a second dense model
    in the prefill too, for the noise floor (`bench_generation`). device, dtype: where the models
    run and in what dtype (None: the checkpoint's or the preset's own, see `build_preset`).
    compile: both models decode compiled (`vlmod.compile`; `bench_generation`).
    """
    try:
        if capacity is not None or layers is not None:
            vlmod.MoDConfig(
                capacity=DEFAULT_CAPACITY if capacity is None else capacity,
                layers=parse_layers(DEFAULT_LAYERS if layers is None else layers),
            )
        if batch < 1 or new_tokens < 1:
            raise ValueError(f"batch and new_tokens must be >= 1, got {batch} and {new_tokens}")
        if repeats < 1 or warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
        check_cache(cache)
        if compile and cache != DEFAULT_CACHE:
            raise ValueError(f"--compile decodes on vlmod's own cache: drop --cache {cache}")
        num_threads = set_threads(threads)
    except ValueError as e:
        raise InputError(str(e)) from e
    dense, mod, processor, words, mod_source = build_pair(
        model, preset, LLAVA_PRESETS, capacity, layers, device=device, dtype=dtype
    )
    if compile:
        from vlmod.tools.compile import compile_problem

        problem = compile_problem(dense)
        if problem is not None:
            raise InputError(f"--compile: {problem}")
    size = dense.config.vision_config.image_size
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt_text(words)}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = on_device(
        processor(images=[synthetic_image(size, i) for i in range(batch)], text=[text] * batch, return_tensors="pt", padding=True),
        dense,
    )
    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    result = bench_generation(
        dense, mod, inputs, new_tokens, warmup, repeats, progress, pad, cache, decode_bound, control, compile
    )
    image_tokens, prompt_tokens = prompt_counts(inputs, dense.config.image_token_id)
    result.update(
        benchmark="llava",
        model=model or f"preset:{preset}",
        batch=batch,
        mod_layers={f"{p}:{i}": c for (p, i), c in vlmod.mod_layers(mod).items()},
        mod_source=mod_source,
        image_tokens=image_tokens,
        prompt_tokens=prompt_tokens,
        language_layers=dense.config.text_config.num_hidden_layers,
        new_tokens=new_tokens,
        torch=torch.__version__,
        threads=num_threads,
        load_average=load_average(),
    )
    return result
