"""Running the models for a request: the processor's inputs for a picture or a video, a greedy
generate, and a fair latency of MoD against dense (warm, untraced, interleaved)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from vlmod.demo.media import Media
from vlmod.demo.model import LoadedModel
from vlmod.tools.cache import generate_cache

# Timed generate calls per model per request (interleaved, median reported); 0 = no timing.
TIMING_RUNS = 3
TIMING_METHOD = (
    "greedy generate of {tokens} new tokens (end-of-sequence ignored), untraced, after a start-up "
    "warm-up; {models} interleaved, {runs} runs each in alternating order; median"
)


def build_inputs(loaded: LoadedModel, media: Media, prompt: str) -> tuple[dict[str, Any], bool]:
    """(processor outputs, as_video): a video goes in as video tokens on a video model, else as one
    image per frame."""
    processor = loaded.processor
    as_video = media.kind == "video" and loaded.supports_video
    if as_video:
        content = [{"type": "video"}]
    else:
        content = [{"type": "image"} for _ in media.frames]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]
    if getattr(processor, "chat_template", None):
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
    else:
        token = "<video>" if as_video else "<image>"
        text = "USER: " + " ".join([token] * (1 if as_video else len(media.frames))) + f"\n{prompt} ASSISTANT:"
    if as_video:
        video = np.stack([np.asarray(f) for f in media.frames])
        inputs = processor(videos=[video], text=[text], return_tensors="pt")
    else:
        # Nested per prompt: what every family's processor takes (Gemma 3's requires it).
        inputs = processor(images=[list(media.frames)], text=[text], return_tensors="pt")
    device = next(loaded.model.parameters()).device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, as_video


def generate(
    model: nn.Module, inputs: dict[str, Any], processor: Any, max_new_tokens: int, exact: bool = False
) -> tuple[str, float]:
    """(answer, seconds) of a greedy generate; exact: always `max_new_tokens` new tokens (an
    end-of-sequence token does not stop it), so two models' times count the same work."""
    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {"min_new_tokens": max_new_tokens} if exact else {}
    extra.update(generate_cache(model, max_new_tokens))
    device = next(model.parameters()).device
    _sync(device)
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **extra)
    _sync(device)
    seconds = time.perf_counter() - start
    new = out[:, inputs["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new, skip_special_tokens=True)[0].strip(), seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_latency(
    loaded: LoadedModel, inputs: dict[str, Any], max_new_tokens: int, runs: int = TIMING_RUNS
) -> dict[str, Any] | None:
    """Fair wall-clock latency of the MoD model and (when loaded) the dense one on `inputs`: both
    untraced and warm, the same number of new tokens, interleaved in alternating order (MoD first,
    then dense first, ...) so a change in machine load hits both alike; medians of `runs` each.

    None when `runs` is 0 or the models were not warmed up (`warm_up`): then there is no fair
    number to show."""
    if runs <= 0 or loaded.warm_up_s is None:
        return None
    models = [("mod", loaded.model)] + ([("dense", loaded.dense)] if loaded.dense is not None else [])
    samples: dict[str, list[float]] = {name: [] for name, _ in models}
    with torch.inference_mode():
        for run in range(runs):
            for name, model in models if run % 2 == 0 else models[::-1]:
                samples[name].append(generate(model, inputs, loaded.processor, max_new_tokens, exact=True)[1])
    mod_s = statistics.median(samples["mod"])
    dense_s = statistics.median(samples["dense"]) if "dense" in samples else None
    return {
        "mod_s": mod_s,
        "dense_s": dense_s,
        "speedup": None if dense_s is None else dense_s / mod_s,
        "runs": runs,
        "new_tokens": max_new_tokens,
        "samples": samples,
        "method": TIMING_METHOD.format(
            tokens=max_new_tokens, runs=runs, models="MoD and dense" if dense_s is not None else "MoD only"
        ),
    }


def warm_up(loaded: LoadedModel, max_new_tokens: int = 4) -> float:
    """Run each model once on a neutral picture so a request's timing does not pay first-call costs
    (lazy initialisation, allocator growth, kernel selection); returns the seconds it took."""
    start = time.perf_counter()
    side = max(loaded.input_size())
    picture = Image.new("RGB", (side, side), (128, 128, 128))
    inputs, _ = build_inputs(loaded, Media("image", [picture]), "what is it ?")
    with torch.inference_mode():
        for model in (loaded.model, loaded.dense):
            if model is not None:
                for _ in range(2):
                    generate(model, inputs, loaded.processor, max_new_tokens, exact=True)
    loaded.warm_up_s = time.perf_counter() - start
    return loaded.warm_up_s
