"""Batched processor inputs several test files build the same way: chat prompts with one image or
clip each, of different lengths, so rows are left-padded and carry different token counts."""

from __future__ import annotations

import numpy as np
from PIL import Image


def chat_prompt(processor: object, question: str, media: str = "image") -> str:
    """One user turn: a media placeholder ("image" or "video"), then the question."""
    conversation = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(conversation, add_generation_prompt=True)


def padded_batch(processor: object, family: str) -> dict:
    """Batch 2, prompts of different lengths (left padding): two 4-frame clips for
    llava_next_video, two 32 x 32 images otherwise."""
    rng = np.random.RandomState(0)
    questions = ["what color", "how many objects are in the picture ? answer with one word"]
    if family == "llava_next_video":
        videos = [(rng.rand(4, 32, 32, 3) * 255).astype("uint8") for _ in questions]
        prompts = [chat_prompt(processor, q, "video") for q in questions]
        inputs = processor(videos=videos, text=prompts, return_tensors="pt", padding=True)
    else:
        images = [Image.fromarray((rng.rand(32, 32, 3) * 255).astype("uint8")) for _ in questions]
        prompts = [chat_prompt(processor, q) for q in questions]
        if family == "gemma3":  # its processor takes each row's images as a list
            images = [[image] for image in images]
        inputs = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    inputs = dict(inputs)
    assert (inputs["attention_mask"] == 0).any()
    return inputs


def anyres_inputs(processor: object, family: str) -> dict:
    """Three prompts with images of different sizes (rows of 36, 70 and 72 image tokens on the
    anyres families) and left padding; same-size images for plain LLaVA."""
    sizes = [(32, 32), (48, 64), (64, 40)] if family != "llava" else [(32, 32)] * 3
    rng = np.random.RandomState(0)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]
    questions = ["what color", "how many objects are in the image", "where is the red circle in this picture ?"]
    prompts = [chat_prompt(processor, q) for q in questions]
    return dict(processor(images=images, text=prompts, return_tensors="pt", padding=True))
