"""Helpers several test files share: counting host syncs and dispatched ops, and the anyres batch
of different-size images that exercises padding and per-row token counts."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that copy a value to the host (a device sync on an accelerator).
SYNCS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")
# Routing work a decode step must not do: ranking, gathering or scattering tokens.
ROUTING_OPS = {"topk", "sort", "argsort", "index", "index_put", "index_put_", "gather", "scatter", "scatter_"}


@contextlib.contextmanager
def count_syncs() -> Iterator[Counter]:
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name: str, original):  # noqa: ANN001, ANN202
        def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            counts[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(name, original))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class CountOps(TorchDispatchMode):
    """Every aten op dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def anyres_inputs(processor: object, family: str) -> dict:
    """Three prompts with images of different sizes (rows of 36, 70 and 72 image tokens on the
    anyres families) and left padding; same-size images for plain LLaVA."""
    sizes = [(32, 32), (48, 64), (64, 40)] if family != "llava" else [(32, 32)] * 3
    rng = np.random.RandomState(0)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]
    questions = ["what color", "how many objects are in the image", "where is the red circle in this picture ?"]
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}], add_generation_prompt=True
        )
        for q in questions
    ]
    return dict(processor(images=images, text=prompts, return_tensors="pt", padding=True))
