"""`bench vit`: images/s of a ViT image encoder and of its MoD conversion against the FLOPs
prediction of `vlmod.tools.flops`."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import vlmod
from vlmod.bench.inputs import parse_layers
from vlmod.bench.timing import (
    contention,
    describe_device,
    keeps_threads,
    load_average,
    set_threads,
    time_interleaved,
)
from vlmod.errors import InputError
from vlmod.tools.flops import ViTDims, processed_counts, vit_flops

SOURCES = ("timm", "open_clip")


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


def _patch_conv(model: nn.Module, source: str) -> nn.Conv2d:
    return model.patch_embed.proj if source == "timm" else model.conv1


def _input_size(model: nn.Module, source: str) -> tuple[int, int, int]:
    if source == "timm":
        return (_patch_conv(model, source).in_channels, *model.patch_embed.img_size)
    size = model.image_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    return (model.conv1.in_channels, *size)


def _check_image_size(model: nn.Module, source: str, model_name: str) -> None:
    """An image smaller than one patch has no token to route: say so before any forward fails."""
    _, height, width = _input_size(model, source)
    ph, pw = _patch_conv(model, source).kernel_size
    if height < ph or width < pw:
        raise ValueError(
            f"image size {height}x{width} is smaller than one {ph}x{pw} patch of {model_name}: "
            f"use --image-size {max(ph, pw)} or more (a multiple of {max(ph, pw)})"
        )


@keeps_threads
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
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> dict[str, Any]:
    """Images/s of a dense ViT and of its MoD conversion on one random batch, against the FLOPs
    prediction.

    The MoD copy is `vlmod.apply_mod(copy.deepcopy(dense), MoDConfig(capacity, layers))` with its
    fresh zero router: routing cost does not depend on the router's weights, and the trace gives
    the token counts actually processed at each MoD layer. device, dtype: where both run and in
    what dtype (None or "auto": float32, the random weights' own). Returns a JSON-able dict.
    """
    from vlmod.io.hf import torch_dtype

    try:
        # Validate the cheap inputs before building a model.
        config = vlmod.MoDConfig(capacity=capacity, layers=parse_layers(layers))
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if image_size is not None and image_size < 1:
            raise ValueError(f"image size must be >= 1, got {image_size}")
        if repeats < 1 or warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
        num_threads = set_threads(threads)
        wanted = torch_dtype(dtype)
        wanted = torch.float32 if wanted == "auto" else wanted
        torch.manual_seed(seed)
        dense = build_vit(model_name, source, image_size).to(device=device, dtype=wanted)
        _check_image_size(dense, source, model_name)
        mod = vlmod.apply_mod(copy.deepcopy(dense), config)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from e

    channels, height, width = _input_size(dense, source)
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, channels, height, width, generator=generator).to(device=device, dtype=wanted)

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
        device=device,
    )
    judged = contention(timings)
    used = judged.clean_repeats

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
        # Medians are over these repeats (see `vlmod.bench.timing.contention`); `contended` means
        # the result is unreliable.
        "timed_repeats": used,
        "contended": judged.contended,
        "contention": {"timing": judged.as_dict()},
        "device": describe_device(images.device),
        "dtype": str(wanted).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": num_threads,
        "load_average": {"before": load_before, "after": load_average()},
    }
