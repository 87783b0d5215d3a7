"""Run a converted model on one image or video under `trace_routing` and turn the trace into the
JSON the demo page draws: which vision tokens each MoD layer processed, laid out on the picture's
grid (`vlmod.demo.layout`), plus the answer, FLOPs and latency. The JSON shape is in
`vlmod.demo.app`."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

import vlmod
from vlmod.bench.decode import decode_weight_bytes, generation_footprint
from vlmod.config import TokenType
from vlmod.demo.inference import build_inputs, generate
from vlmod.demo.latency import TIMING_RUNS, measure_latency
from vlmod.demo.layout import View, picture_views, side_of
from vlmod.demo.media import Media
from vlmod.demo.model import LoadedModel, tower_depth
from vlmod.demo.pictures import data_url, model_resolution, seen_box
from vlmod.tools.flops import generation_flops

# Longest side of the whole-picture thumbnail the crop is outlined on.
ORIGINAL_SIDE = 192
# prefill: {(part, layer): BoolTensor[rows, tokens]}, True where the token ran the layer; the
# language part has one row (one prompt), the vision tower one per image tile or frame.
Prefill = dict[tuple[str, int], torch.Tensor]


def analyze(
    loaded: LoadedModel,
    media: Media,
    prompt: str,
    max_new_tokens: int = 16,
    timing_runs: int = TIMING_RUNS,
    hold_off: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[str, Any]:
    """Answer `prompt` about `media` with the MoD model (and the dense one when loaded), describe
    what each MoD layer processed (a traced run), and time both fairly (`measure_latency`, untraced,
    inside `hold_off()`); see `vlmod.demo.app` for the JSON shape."""
    model = loaded.model
    t0 = time.perf_counter()
    inputs, as_video = build_inputs(loaded, media, prompt)
    preprocess_s = time.perf_counter() - t0
    with torch.inference_mode():
        with vlmod.trace_routing(model) as trace:
            answer, generate_s = generate(model, inputs, loaded.processor, max_new_tokens)
        dense = None
        if loaded.dense is not None:
            dense_answer, _ = generate(loaded.dense, inputs, loaded.processor, max_new_tokens)
            dense = {"answer": dense_answer, "same_answer": dense_answer == answer}
    prefill_trace = trace.first_step()
    prefill = {k: processed.cpu() for k, processed in prefill_trace.processed.items()}
    seq_len = inputs["input_ids"].shape[1]
    types = trace.part_token_types("language")[0, :seq_len].cpu()
    vision_types = trace.part_token_types("vision").cpu() if "vision" in loaded.mod_layers else None
    layout = picture_views(model, media.frames, types, as_video, inputs)
    items = [
        _picture_json(loaded, media, i, views, as_video, prefill, vision_types)
        for i, (_, views) in enumerate(zip(media.frames, layout, strict=True))
    ]
    stats = _language_stats(loaded, types, seq_len, prefill)
    flops_mod = generation_flops(model, inputs, prefill_trace)
    flops_dense = generation_flops(model, inputs, None)
    stats["flops"] = {
        "dense": flops_dense["total"],
        "mod": flops_mod["total"],
        "dense_language": flops_dense["language"],
        "mod_language": flops_mod["language"],
        "dense_vision": flops_dense["vision"],
        "mod_vision": flops_mod["vision"],
        # What MoD cuts: the language model's prefill (and the tower's, when it is converted).
        "language_saved_fraction": 1.0 - flops_mod["language"] / flops_dense["language"],
        "saved_fraction": 1.0 - flops_mod["total"] / flops_dense["total"],
    }
    stats["capacity"] = {
        part: {str(layer): c for (p, layer), c in sorted(vlmod.mod_layers(model).items()) if p == part}
        for part in loaded.mod_layers
    }
    # generate: the traced run that made the maps (not a fair latency: see "latency").
    stats["latency_s"] = {"preprocess": preprocess_s, "generate": generate_s}
    predicted = _predictions(loaded, inputs, flops_dense, flops_mod) if timing_runs > 0 else None
    stats["latency"] = measure_latency(loaded, inputs, max_new_tokens, timing_runs, predicted, hold_off)
    stats["dense"] = dense
    vis_mod = loaded.mod_layers.get("vision", [])
    if vis_mod and vision_types is not None:
        stats["vision_tower"] = _tower_stats(vision_types, vis_mod, tower_depth(model.config.vision_config), prefill)
    return {
        "kind": media.kind,
        "input": "video" if as_video else ("frames" if media.kind == "video" else "image"),
        "prompt": prompt,
        "answer": answer,
        "layers": {
            "language": {"total": model.config.text_config.num_hidden_layers, "mod": loaded.mod_layers.get("language", [])},
            "vision": {"total": tower_depth(model.config.vision_config), "mod": vis_mod},
        },
        "media": items,
        "stats": stats,
    }


def _predictions(
    loaded: LoadedModel, inputs: dict[str, Any], flops_dense: dict[str, float], flops_mod: dict[str, float]
) -> dict[str, float | None]:
    """What each latency figure is held against, dense / MoD: the prefill FLOPs for time to first
    token, the bytes a decode step reads (language model weights plus KV cache, as `vlmod bench`
    counts them) for a decode step; decode None without a dense model to read the cache of."""
    decode = None
    if loaded.dense is not None:
        _, kv = generation_footprint(loaded.dense, loaded.model, inputs)
        dense_bytes = decode_weight_bytes(loaded.dense) + kv["dense"]
        decode = dense_bytes / (decode_weight_bytes(loaded.model) + kv["mod"])
    return {"prefill": flops_dense["total"] / flops_mod["total"], "decode": decode}


def _picture_json(
    loaded: LoadedModel,
    media: Media,
    i: int,
    views: list[View],
    as_video: bool,
    prefill: Prefill,
    vision_types: torch.Tensor | None,
) -> dict[str, Any]:
    """One picture (an image, or a frame) of the request: what the model saw of it, its token
    grids with the MoD language layers that ran each token, and the tower's view of it."""
    picture = media.frames[i]
    config = loaded.model.config
    lang_mod = loaded.mod_layers.get("language", [])
    vis_mod = loaded.mod_layers.get("vision", [])
    processor = _picture_processor(loaded.processor, as_video)
    box = seen_box(picture.size, processor)
    shown = picture if box == (0, 0, *picture.size) else picture.crop(box)
    model_w, model_h = model_resolution(processor, views[0], side_of(config.vision_config.patch_size))
    item: dict[str, Any] = {
        "index": i,
        "time_s": media.timestamps[i] if media.kind == "video" and i < len(media.timestamps) else None,
        "width": shown.width,
        "height": shown.height,
        "src": data_url(shown),
        # What the model saw: this crop of the original picture, resized to model_size.
        "original": {"width": picture.width, "height": picture.height},  # + "src" when cropped
        # The file's own size where the decoder scaled its frames down (crop and grid are in decoded pixels).
        **({"source": {"width": media.source_size[0], "height": media.source_size[1]}} if media.source_size else {}),
        "crop": {"x": box[0], "y": box[1], "width": box[2] - box[0], "height": box[3] - box[1]},
        "model_size": {"width": model_w, "height": model_h},
        "model_src": data_url(shown, (model_w, model_h)),
        "views": [_view_json(v, lang_mod, prefill, "language") for v in views],
    }
    if box != (0, 0, *picture.size):
        # The whole picture as decoded here (upright, EXIF applied), for the page to outline the
        # crop on: the browser's own copy of the file may be turned another way.
        scale = ORIGINAL_SIDE / max(picture.size)
        thumb = (max(1, round(picture.width * scale)), max(1, round(picture.height * scale)))
        item["original"]["src"] = data_url(picture, thumb)
    # Each grid its own model resolution (anyres: the high-res grid's tiles, the overview's square);
    # pixels at it where it differs from the first grid's.
    patch = side_of(config.vision_config.patch_size)
    for view, view_json in zip(views, item["views"], strict=True):
        w, h = model_resolution(processor, view, patch)
        view_json["model_size"] = {"width": w, "height": h}
        if (w, h) != (model_w, model_h):
            view_json["model_src"] = data_url(shown, (w, h))
    tokens = sorted({t for v in views for t in v.tokens})
    item["stats"] = _passes(tokens, lang_mod, config.text_config.num_hidden_layers, prefill, "language")
    item["vision"] = None
    if vision_types is not None and vis_mod:
        row = 0 if media.kind == "image" else i
        item["vision"] = _vision_json(row, vision_types, vis_mod, tower_depth(config.vision_config), prefill)
    return item


def _language_stats(loaded: LoadedModel, types: torch.Tensor, seq_len: int, prefill: Prefill) -> dict[str, Any]:
    """Vision tokens the MoD language layers ran and skipped in the prefill."""
    lang_mod = loaded.mod_layers.get("language", [])
    n_layers = loaded.model.config.text_config.num_hidden_layers
    vision_positions = torch.nonzero((types == TokenType.IMAGE) | (types == TokenType.VIDEO)).flatten()
    n_vision = int(vision_positions.numel())
    processed_by_layer = {
        layer: int(prefill[("language", layer)][0, vision_positions].sum()) for layer in lang_mod
    }
    skipped = sum(n_vision - p for p in processed_by_layer.values())
    return {
        "vision_tokens": n_vision,
        "text_tokens": int(seq_len - n_vision),
        "processed_per_layer": {str(k): v for k, v in processed_by_layer.items()},
        "tokens_skipped": skipped,
        "skipped_fraction_mod_layers": skipped / max(1, n_vision * len(lang_mod)),
        "skipped_fraction_all_layers": skipped / max(1, n_vision * n_layers),
    }


def _tower_stats(vision_types: torch.Tensor, layers: list[int], n_layers: int, prefill: Prefill) -> dict[str, Any]:
    """Patch tokens the MoD tower layers skipped, over every tower input."""
    patches = vision_types != TokenType.PREFIX
    skipped = sum(int((~prefill[("vision", layer)] & patches).sum()) for layer in layers)
    return {
        "patch_tokens": int(patches.sum()),
        "tokens_skipped": skipped,
        "skipped_fraction_all_layers": skipped / max(1, int(patches.sum()) * n_layers),
    }


def _picture_processor(processor: Any, as_video: bool) -> Any:
    if as_video and hasattr(processor, "video_processor"):
        return processor.video_processor
    return processor.image_processor


def _view_json(view: View, layers: list[int], prefill: Prefill, part: str) -> dict[str, Any]:
    idx = torch.tensor(view.tokens, dtype=torch.long)
    masks = [prefill[(part, layer)][0, idx].to(torch.int64) for layer in layers]
    counts = torch.stack(masks).sum(0) if masks else torch.zeros(len(view.tokens), dtype=torch.int64)
    return {
        "name": view.name,
        "rows": view.rows,
        "cols": view.cols,
        "counts": counts.tolist(),
        "masks": [m.tolist() for m in masks],
    }


def _passes(tokens: list[int], mod: list[int], n_layers: int, prefill: Prefill, part: str) -> dict[str, Any]:
    """Layer passes (token x layer runs) of `tokens`: dense layers run all of them."""
    idx = torch.tensor(tokens, dtype=torch.long)
    n = len(tokens)
    run = n * (n_layers - len(mod)) + sum(int(prefill[(part, layer)][0, idx].sum()) for layer in mod)
    dense = n * n_layers
    return {"tokens": n, "layer_passes": run, "dense_layer_passes": dense, "compute_fraction": run / max(1, dense)}


def _vision_json(
    row: int, vision_types: torch.Tensor, layers: list[int], n_layers: int, prefill: Prefill
) -> dict[str, Any] | None:
    """The vision-tower view of one tower input (image tile 0, or one video frame)."""
    if row >= vision_types.shape[0]:
        return None
    patch_cols = torch.nonzero(vision_types[row] != TokenType.PREFIX).flatten()
    side = math.isqrt(patch_cols.numel())
    if side * side != patch_cols.numel():
        return None
    masks = [prefill[("vision", layer)][row, patch_cols].to(torch.int64) for layer in layers]
    n = int(patch_cols.numel())
    run = n * (n_layers - len(layers)) + sum(int(m.sum()) for m in masks)
    return {
        "name": "vision tower",
        "rows": side,
        "cols": side,
        "counts": torch.stack(masks).sum(0).tolist(),
        "masks": [m.tolist() for m in masks],
        "stats": {"tokens": n, "layer_passes": run, "dense_layer_passes": n * n_layers, "compute_fraction": run / (n * n_layers)},
    }
