"""Host cost of a forward, counted rather than timed: the aten ops it dispatches (on a GPU each is
a kernel launch, and at batch 1 the launches set the pace), the host reads (each a device sync
on a GPU), and the graph breaks `torch.compile` meets. Dense and MoD are counted on the same
input, so the table says what routing adds per routed layer (docs/engine.md, host cost).

Counts are exact and machine-independent: a test can hold them, unlike a timing.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no kernel on a GPU: allocation, metadata, the scalar read (counted as a sync).
NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
    "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "set_", "resize_",
}
# Tensor methods that copy a value to the host; on a CPU tensor they bypass the dispatcher.
HOST_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")
# Other ops that read values to size their output or answer on the host (a sync on an accelerator).
SYNCING_OPS = {"equal", "masked_select", "unique", "_unique2"}
# Ops not marked as views that return their input when there is nothing to convert.
MAY_RETURN_INPUT = {"type_as"}
# A small batch of one image or clip for each family: tiny.build arguments where the defaults
# would give too few vision tokens to route.
BUILD = {"qwen2_5_vl": {"patch_size": 4}, "qwen3_vl": {"patch_size": 4}}


class OpCounter(TorchDispatchMode):
    """Every aten op dispatched that launches a kernel (views and allocations left out, in-place
    ops counted), by name, plus the syncing ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.syncs[name] += 1
        out = func(*args, **(kwargs or {}))
        if name in NO_KERNEL:
            return out
        # Under inference mode `reshape`, `contiguous`, `flatten` arrive whole, marked as views
        # since they may alias, and `type_as` whole: one that returned new memory launched a copy.
        if not (func.is_view or name in MAY_RETURN_INPUT) or _copied(args, out):
            self.ops[name] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _copied(args: tuple, out: Any) -> bool:
    """Whether a may-alias op's output lives in memory other than its input's."""
    source = next((a for a in args if isinstance(a, torch.Tensor)), None)
    result = out if isinstance(out, torch.Tensor) else next((o for o in out if isinstance(o, torch.Tensor)), None)
    if source is None or result is None:
        return False
    try:
        return result.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse or wrapper tensors: no storage to compare
        return False


@contextlib.contextmanager
def count_host_reads() -> Iterator[Counter]:
    """{method: calls} of the Tensor methods that read a value to the host, while the block runs."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name: str, original: Callable) -> Callable:
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


@dataclass
class Count:
    """What one forward dispatched."""

    ops: int
    syncs: int  # host reads plus syncing ops
    by_op: dict[str, int] = field(default_factory=dict)
    by_sync: dict[str, int] = field(default_factory=dict)


class _Counting:
    """Counts each forward of a module separately (its hooks included): a pre-hook put in front
    of every other starts the counters, a forward hook behind every other stops them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.counts: list[Count] = []
        self._active: tuple | None = None
        self._handles = [
            module.register_forward_pre_hook(self._start, prepend=True),
            module.register_forward_hook(self._stop),
        ]

    def _start(self, module: torch.nn.Module, args: tuple) -> None:
        reads = count_host_reads()
        counter = OpCounter()
        self._active = (reads, reads.__enter__(), counter.__enter__())

    def _stop(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        reads, read_counts, counter = self._active
        counter.__exit__(None, None, None)
        reads.__exit__(None, None, None)
        syncs = Counter(read_counts) + counter.syncs
        self.counts.append(Count(counter.total, sum(syncs.values()), dict(counter.ops), dict(syncs)))
        self._active = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def prefill_and_decode(model: torch.nn.Module, inputs: dict[str, Any], steps: int = 2) -> tuple[Count, Count]:
    """Counts of the prefill of `inputs` and of the last of `steps` decode steps of greedy
    `generate` on vlmod's preallocated cache, as vlmod's own generation runs them."""
    from vlmod.tools.cache import generate_cache

    new = steps + 1
    counting = _Counting(model)
    try:
        with torch.inference_mode():
            model.generate(
                **inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, **generate_cache(model, new)
            )
    finally:
        counting.remove()
    return counting.counts[0], counting.counts[-1]


def graph_breaks(model: torch.nn.Module, inputs: dict[str, Any]) -> int:
    """Graph breaks of a prefill under `torch._dynamo.explain` (no cache, logits of the last
    token), dynamo reset before and after."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            explained = torch._dynamo.explain(model)(**inputs, use_cache=False, logits_to_keep=1)
        return int(explained.graph_break_count)
    finally:
        torch._dynamo.reset()


def tiny_inputs(family: str, processor: Any, frames: int = 4, seed: int = 0) -> dict[str, Any]:
    """One chat prompt with one 32 x 32 image (a `frames`-frame clip for LLaVA-NeXT-Video), as the
    family's processor returns it: a batch of one, no padding."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    media = "video" if family == "llava_next_video" else "image"
    conversation = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": "what color is the shape ?"}]}]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    if media == "video":
        clip = (rng.rand(frames, 32, 32, 3) * 255).astype("uint8")
        return dict(processor(videos=[clip], text=prompt, return_tensors="pt"))
    image = Image.fromarray((rng.rand(32, 32, 3) * 255).astype("uint8"))
    return dict(processor(images=[[image]] if family == "gemma3" else image, text=prompt, return_tensors="pt"))


@dataclass
class HostCost:
    """One family's row: dense and MoD counts, and what each routed layer adds."""

    family: str
    routed_layers: int
    dense_prefill: Count
    mod_prefill: Count
    dense_decode: Count
    mod_decode: Count
    dense_breaks: int | None = None
    mod_breaks: int | None = None

    @property
    def prefill_per_layer(self) -> float:
        return (self.mod_prefill.ops - self.dense_prefill.ops) / self.routed_layers

    @property
    def decode_per_layer(self) -> float:
        return (self.mod_decode.ops - self.dense_decode.ops) / self.routed_layers

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_per_layer": self.prefill_per_layer, "decode_per_layer": self.decode_per_layer}


def host_cost(
    family: str, capacity: float = 0.5, layers: str = "every_other", breaks: bool = False, router: str = "learned"
) -> HostCost:
    """Counts of a tiny `family` model (4 layers, float32, one image or a 4-frame clip, batch 1)
    and of its MoD conversion at `capacity` on `layers`, selecting by `router`."""
    import vlmod
    from vlmod.models import tiny

    model, processor = tiny.build(family, **BUILD.get(family, {}))
    inputs = tiny_inputs(family, processor)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=capacity, layers=layers, router=router))
    routed = len(vlmod.mod_layers(mod))
    dense_prefill, dense_decode = prefill_and_decode(model, inputs)
    mod_prefill, mod_decode = prefill_and_decode(mod, inputs)
    row = HostCost(family, routed, dense_prefill, mod_prefill, dense_decode, mod_decode)
    if breaks:
        row.dense_breaks, row.mod_breaks = graph_breaks(model, inputs), graph_breaks(mod, inputs)
    return row


def format_host_cost(rows: list[HostCost]) -> str:
    """The Markdown table of `vlmod bench ops`."""
    head = (
        "| family | routed layers | prefill ops dense / MoD | extra per routed layer | decode-step ops dense / MoD "
        "| extra per routed layer | host reads prefill dense / MoD | decode dense / MoD | graph breaks dense / MoD |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        breaks = "-" if r.dense_breaks is None else f"{r.dense_breaks} / {r.mod_breaks}"
        lines.append(
            f"| {r.family} | {r.routed_layers} | {r.dense_prefill.ops} / {r.mod_prefill.ops} | {r.prefill_per_layer:.1f} "
            f"| {r.dense_decode.ops} / {r.mod_decode.ops} | {r.decode_per_layer:.1f} "
            f"| {r.dense_prefill.syncs} / {r.mod_prefill.syncs} | {r.dense_decode.syncs} / {r.mod_decode.syncs} | {breaks} |"
        )
    return "\n".join(lines)
