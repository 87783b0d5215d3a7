"""`bench llava` and the generation timing `bench video` shares: prefill latency, decode speed per
step, KV cache, peak memory and FLOPs of a dense LLaVA model and its MoD conversion.

Decode is timed by a clock inside `generate` (`StepClock`, a logits processor that notes each
token's time), in the very calls being timed, dense and MoD calls alternating: a decode figure
is a median of real steps, never a difference of two separately timed medians (under load that
difference printed 15,000,000,000 tokens/s).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import vlmod
from vlmod.bench.inputs import parse_layers, prompt_text, synthetic_image
from vlmod.bench.timing import (
    Contention,
    Timings,
    contention,
    keeps_threads,
    load_average,
    peak_memory_bytes,
    set_threads,
    spread,
    time_interleaved,
)
from vlmod.cache import generate_cache
from vlmod.errors import InputError
from vlmod.flops import generation_flops
from vlmod.plugins.calls import cache_name, output_cache

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
DEFAULT_CAPACITY = 0.5
DEFAULT_LAYERS = "every_other"
# KV caches generate can run with: vlmod's preallocated one (written in place, see vlmod.cache) or
# transformers' DynamicCache (K and V concatenated every step).
CACHES = ("preallocated", "dynamic")
DEFAULT_CACHE = "preallocated"


def check_cache(cache: str) -> None:
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")


def cache_kwargs(model: nn.Module, cache: str, new_tokens: int) -> dict[str, Any]:
    """What one forward or generate call of `model` takes to run with a fresh cache of kind `cache`
    (`vlmod.cache.generate_cache`: nothing where the checkpoint's generation config names its own)."""
    check_cache(cache)
    return generate_cache(model, new_tokens) if cache == "preallocated" else {}


def build_preset(preset: str | None, presets: Mapping[str, Mapping[str, Any]]) -> tuple[nn.Module, Any, int]:
    """(model, processor, prompt words) of a preset built from config with random weights."""
    from vlmod import tiny

    if preset not in presets:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(presets)}")
    settings = dict(presets[preset])
    prompt = settings.pop("prompt_tokens")
    family = settings.pop("family")
    built, processor = tiny.build(family, **settings)
    return built, processor, prompt


def shared_copy(model: nn.Module) -> nn.Module:
    """A second module tree over the same parameter and buffer tensors: the dense twin of a MoD
    model (or the reverse) without a second copy of the weights, so a 7B pair fits where one
    model does (converting or unconverting a layer swaps classes and routers, never weights)."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def build_pair(
    model: str | None,
    preset: str | None,
    presets: Mapping[str, Mapping[str, Any]],
    capacity: float | None,
    layers: str | Sequence[int] | None,
    default_layers: Any = DEFAULT_LAYERS,
) -> tuple[nn.Module, nn.Module, Any, int, str]:
    """(dense, mod, processor, prompt words, where the MoD layers come from).

    A checkpoint saved converted is measured as saved: its own MoD layers and capacities, against
    the same weights loaded dense (routers dropped); asking for other layers or capacities then is
    an error rather than a silent reconversion. A plain checkpoint or a preset is converted with
    `capacity` and `layers` (defaults when None); `default_layers` may be a function of the number
    of language layers.
    """
    words = 60
    if model is not None:
        from vlmod.hf import load_config, load_vlm, part_configs, vlm_class

        vlm_class(model, InputError, "bench measures")  # a missing or foreign checkpoint: one line
        settings = getattr(load_config(model), "vlmod", None)
        if settings and (capacity is not None or layers is not None):
            parts = ", ".join(f"{part}: capacity {c.capacity:g}, layers {c.layers}" for part, c in part_configs(settings).items())
            raise InputError(
                f"{model} is already converted to MoD ({parts}); drop --capacity / --layers to measure it "
                "as saved, or give the plain checkpoint to convert it otherwise"
            )
        mod, processor = load_vlm(model, InputError, "bench measures", converted=True)
        if vlmod.mod_layers(mod):
            dense = vlmod.remove_mod(shared_copy(mod))
            return dense.eval(), mod.eval(), processor, words, "the checkpoint's own MoD layers"
        dense = mod.eval()
    else:
        dense, processor, words = build_preset(preset, presets)
    if layers is None:
        layers = default_layers(dense.config.text_config.num_hidden_layers) if callable(default_layers) else default_layers
    capacity = DEFAULT_CAPACITY if capacity is None else capacity
    try:
        config = vlmod.MoDConfig(capacity=capacity, layers=parse_layers(layers))
        mod = vlmod.apply_mod(shared_copy(dense), config)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from e
    return dense, mod, processor, words, "converted here"


def kv_cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values a cache holds, over all layers."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: the language model's layers, final norm and LM
    head (MoD routers included), once per step whatever the batch. Not read: the vision side and
    the embedding table (one row per token)."""
    lm = model.get_decoder()  # the language model of every vision-language family vlmod converts
    head = model.get_output_embeddings()
    embedding = {id(p) for p in lm.get_input_embeddings().parameters()}
    read = {id(p): p for p in (*lm.parameters(), *(head.parameters() if head is not None else ()))}
    if head is not None:
        embedding -= {id(p) for p in head.parameters()}  # tied: read whole, as the head
    return sum(p.numel() * p.element_size() for i, p in read.items() if i not in embedding)


def generation_footprint(
    dense: nn.Module, mod: nn.Module, inputs: Mapping[str, Any]
) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """({"dense"|"mod": generation_flops}, {"dense"|"mod": KV-cache bytes}) after one prefill of
    each model: what the timings are held against."""
    with torch.inference_mode():
        with vlmod.trace_routing(mod) as trace:
            mod_cache = output_cache(mod(**inputs, use_cache=True, logits_to_keep=1))
        dense_cache = output_cache(dense(**inputs, use_cache=True, logits_to_keep=1))
    flops = {"dense": generation_flops(dense, inputs, None), "mod": generation_flops(mod, inputs, trace)}
    return flops, {"dense": kv_cache_bytes(dense_cache), "mod": kv_cache_bytes(mod_cache)}


class StepClock:
    """A logits processor that only notes when it is called: once per generated token, right after
    that token's forward. `start()` before a generate call; then `calls[-1]` holds the start and
    one tick per token: the first tick ends the prefill, each later one a decode step."""

    def __init__(self) -> None:
        self.calls: list[list[float]] = []

    def start(self) -> None:
        self.calls.append([time.perf_counter()])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.calls[-1].append(time.perf_counter())
        return scores

    @staticmethod
    def first_token_s(ticks: Sequence[float]) -> float:
        return ticks[1] - ticks[0]

    @staticmethod
    def steps_s(ticks: Sequence[float]) -> list[float]:
        """Seconds of each decode step (token 2 onwards) of one call."""
        return [b - a for a, b in zip(ticks[1:-1], ticks[2:], strict=True)]


def decode_figures(
    clocks: Mapping[str, StepClock], timings: Mapping[str, Timings], repeats: int, batch: int
) -> tuple[dict[str, dict[str, Any]], Contention, float | None]:
    """Per model: median seconds per decode step and tokens/s over the clean repeats of the last
    `repeats` generate calls; the contention of those calls (decode-step spread included); and the
    median over repeats of the paired dense/MoD step ratio (None without decode steps)."""
    calls = {name: clock.calls[-repeats:] for name, clock in clocks.items()}
    steps = {name: [StepClock.steps_s(ticks) for ticks in c] for name, c in calls.items()}
    first = contention(timings)
    pooled = {f"{n} decode steps": [s for r in first.clean_repeats for s in steps[n][r]] for n in steps}
    judged = contention(timings, extra_samples={k: v for k, v in pooled.items() if v})
    figures: dict[str, dict[str, Any]] = {}
    for name in clocks:
        samples = [s for r in judged.clean_repeats for s in steps[name][r]]
        step = statistics.median(samples) if samples else None
        figures[name] = {
            "first_token_s": statistics.median(StepClock.first_token_s(calls[name][r]) for r in judged.clean_repeats),
            "decode_step_s": step,
            "decode_tokens_per_s": batch / step if step else None,
            "decode_step_samples_s": [[round(s, 6) for s in rep] for rep in steps[name]],
        }
    paired = None
    if all(figures[n]["decode_step_s"] for n in clocks) and {"dense", "mod"} <= set(clocks):
        paired = statistics.median(
            statistics.median(steps["dense"][r]) / statistics.median(steps["mod"][r]) for r in judged.clean_repeats
        )
    return figures, judged, paired


def routing_bypassed(mod: nn.Module) -> nn.Module:
    """A copy of `mod` whose MoD layers, in a decode step, run their block with no router and no
    gate (the adapter's own call: its masks and key-slot records, over KV caches a routed prefill
    filled, as small as MoD's). Not a model to use (its decode ignores the gate): a bound on MoD
    decode, which tells what the router and gate cost a step from what the smaller caches allow."""
    from vlmod.routing.layer import LAYER_ATTR

    bypassed = shared_copy(mod)
    for module in bypassed.modules():
        routing = module.__dict__.get(LAYER_ATTR)
        if routing is not None:
            routing.ungated_decode = True
    return bypassed


def lockstep_decode(
    models: Mapping[str, nn.Module], inputs: Mapping[str, Any], steps: int, cache: str = DEFAULT_CACHE, warmup: int = 2
) -> dict[str, Any]:
    """Decode steps of dense and MoD in lockstep: after one prefill each, one step of each model in
    turn (the order alternating), each on its own greedy tokens, `warmup` steps untimed. A model
    named "bypassed" (`routing_bypassed`) gets its own speedup over dense, `bypassed_speedup`.

    Why: timed inside `generate`, the two models' steps come from different calls, and on a
    shared CPU a slow phase can last a whole call (steps of one model 66 ms in one call, 78 in
    the next); here the two steps of a pair are adjacent in time, so such phases hit both. The
    figure is the median over pairs of dense step / MoD step."""
    names = list(models)
    state: dict[str, list[Any]] = {}
    times: dict[str, list[float]] = {name: [] for name in names}
    cache_arg = {name: cache_name(type(model).forward) for name, model in models.items()}
    with torch.inference_mode():
        for name, model in models.items():
            out = model(**inputs, **cache_kwargs(model, cache, steps + warmup + 1), use_cache=True, logits_to_keep=1)
            state[name] = [output_cache(out), out.logits[:, -1:].argmax(-1), inputs["attention_mask"]]
        for i in range(warmup + steps):
            for name in names if i % 2 == 0 else names[::-1]:
                past, token, mask = state[name]
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                start = time.perf_counter()
                out = models[name](input_ids=token, attention_mask=mask, **{cache_arg[name]: past}, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                if token.is_cuda:
                    torch.cuda.synchronize(token.device)
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
                state[name] = [past, token, mask]
    result: dict[str, Any] = {"steps": steps, **{f"{n}_step_s": statistics.median(times[n]) for n in names}}
    if {"dense", "mod"} <= set(names):
        pairs = [d / m for d, m in zip(times["dense"], times["mod"], strict=True)]
        result["speedup"] = statistics.median(pairs)
        result["spread"] = spread(pairs)
    if {"dense", "bypassed"} <= set(names):
        result["bypassed_speedup"] = statistics.median(
            d / b for d, b in zip(times["dense"], times["bypassed"], strict=True)
        )
    result["samples_s"] = {n: [round(t, 6) for t in times[n]] for n in names}
    return result


def timed_lockstep(
    models: Mapping[str, nn.Module], inputs: Mapping[str, Any], steps: int, cache: str, decode_bound: bool
) -> dict[str, Any]:
    """`lockstep_decode` of dense and MoD, and with `decode_bound` of MoD's routing-bypassed copy too
    (dropped right after: it holds a third copy of the weights)."""
    if not decode_bound:
        return lockstep_decode(models, inputs, steps, cache)
    return lockstep_decode({**models, "bypassed": routing_bypassed(models["mod"])}, inputs, steps, cache)


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
) -> dict[str, Any]:
    """Prefill latency, decode per step, KV-cache bytes, peak memory of generate and FLOPs of a
    dense LLaVA model and its MoD conversion on the same processed inputs (runs interleaved), both
    with a KV cache of kind `cache` (`CACHES`); `decode_bound` adds `routing_bypassed(mod)` to the
    lockstep decode."""
    from transformers import LogitsProcessorList

    batch = inputs["input_ids"].shape[0]
    flops, kv = generation_footprint(dense, mod, inputs)
    models = {"dense": dense, "mod": mod}
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
    prefill = time_interleaved(
        {n: (lambda m=m: m(**inputs, **cache_kwargs(m, cache, new_tokens), use_cache=True, logits_to_keep=1))
         for n, m in models.items()},
        warmup=warmup, repeats=repeats, progress="prefill dense/MoD" if progress else None,
    )
    clocks = {name: StepClock() for name in models}

    def generate(name: str) -> None:
        kv = cache_kwargs(models[name], cache, new_tokens)
        clocks[name].start()
        models[name].generate(**inputs, **gen, **kv, logits_processor=LogitsProcessorList([clocks[name]]))

    timings = time_interleaved(
        {n: (lambda n=n: generate(n)) for n in models},
        warmup=warmup, repeats=repeats, progress="generate dense/MoD" if progress else None,
    )
    prefill_judged = contention(prefill)
    decode, decode_judged, paired = decode_figures(clocks, timings, repeats, batch)
    lockstep = timed_lockstep(models, inputs, new_tokens * repeats, cache, decode_bound) if new_tokens > 1 else None
    peaks = {
        n: peak_memory_bytes(lambda m=m: m.generate(**inputs, **gen, **cache_kwargs(m, cache, new_tokens)))
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
    result.update(speedups(result, flops, kv))
    result.update(
        decode_speedup_paired=paired,
        contended=prefill_judged.contended or decode_judged.contended,
        contention={"prefill": prefill_judged.as_dict(), "decode": decode_judged.as_dict()},
        timed_repeats={"prefill": prefill_judged.clean_repeats, "generate": decode_judged.clean_repeats},
        repeats=repeats,
        warmup=warmup,
        cache=cache,
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
    peak = None
    if d["peak_memory_bytes"] and m["peak_memory_bytes"] is not None:
        peak = m["peak_memory_bytes"] / d["peak_memory_bytes"] - 1.0
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
) -> dict[str, Any]:
    """Dense vs MoD generation of a LLaVA model on synthetic images and a prompt.

    capacity / layers: how to convert a preset or a plain checkpoint (None: 0.5, every other
    layer). A checkpoint saved converted is measured with its own MoD layers (see `build_pair`).
    cache: the KV cache both models generate with (`CACHES`). threads: torch's intra-op threads
    while the benchmark runs (the caller's count is restored afterwards). decode_bound: also decode
    in lockstep with MoD's routing bypassed (`routing_bypassed`).
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
        num_threads = set_threads(threads)
    except ValueError as e:
        raise InputError(str(e)) from e
    dense, mod, processor, words, mod_source = build_pair(model, preset, LLAVA_PRESETS, capacity, layers)
    size = dense.config.vision_config.image_size
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt_text(words)}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = dict(
        processor(images=[synthetic_image(size, i) for i in range(batch)], text=[text] * batch, return_tensors="pt", padding=True)
    )
    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    result = bench_generation(dense, mod, inputs, new_tokens, warmup, repeats, progress, pad, cache, decode_bound)
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
