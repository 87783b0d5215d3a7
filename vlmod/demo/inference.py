"""Running the models for a request: the processor's inputs for a picture or a video, a greedy
generate, and the warm-up that makes later timings fair (`vlmod.demo.latency`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from vlmod.demo.guards import check_cancelled
from vlmod.demo.media import Media
from vlmod.demo.model import LoadedModel
from vlmod.tools.cache import generate_cache


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
    model: nn.Module,
    inputs: dict[str, Any],
    processor: Any,
    max_new_tokens: int,
    exact: bool = False,
    clock: Any = None,
) -> tuple[str, float]:
    """(answer, seconds) of a greedy generate; exact: always `max_new_tokens` new tokens (an
    end-of-sequence token does not stop it), so two models' times count the same work. clock: a
    logits processor called once per new token (`vlmod.bench.decode.StepClock`), which tells the
    prefill from the decode steps. A request that is cancelled meanwhile (its client left, the
    server stops: `vlmod.demo.guards.cancellable`) raises Cancelled at its next token."""
    from transformers import LogitsProcessorList

    check_cancelled()
    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {"min_new_tokens": max_new_tokens} if exact else {}
    extra.update(generate_cache(model, max_new_tokens))
    extra["logits_processor"] = LogitsProcessorList([_cancel_check] + ([clock] if clock is not None else []))
    device = next(model.parameters()).device
    _sync(device)
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **extra)
    _sync(device)
    seconds = time.perf_counter() - start
    new = out[:, inputs["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new, skip_special_tokens=True)[0].strip(), seconds


def _cancel_check(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A logits processor that ends a cancelled request's generate at the next token."""
    check_cancelled()
    return scores


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
