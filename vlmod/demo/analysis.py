"""Run a converted LLaVA model on one image or video under `trace_routing` and turn the trace into
the JSON the demo page draws: which vision tokens each MoD layer processed, laid out on the
picture's patch grid, plus the answer, FLOPs and latency.

Why the layout code: the trace knows token positions in the sequence, the page needs patch cells
on a picture. The mapping follows the families' token layouts, worked out from token counts so
that it holds for any checkpoint of a family:

- LLaVA: one image = a side x side grid (side = image_size / patch_size), row-major; a video on an
  image-only model is sent as its frames, one image each.
- LLaVA-NeXT / OneVision images (anyres): a side x side overview of the whole picture, then the
  high-resolution grid (h rows of w cells, each row followed by a newline token) unpadded to the
  picture's aspect ratio.
- Video models: T frames of equal square grids (pooled), OneVision with one newline at the end.
- Families whose plugin knows its layout (`vlmod.plugins.decoder.token_grids`): Qwen2.5-VL /
  Qwen3-VL from `image_grid_thw` / `video_grid_thw` (dynamic resolution, 2x2 merged patches; a
  video's temporal step covers two frames), InternVL's tiles and thumbnail, Gemma 3's pooled grid.
"""

from __future__ import annotations

import base64
import io
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from vlmod.cache import generate_cache
from vlmod.config import TokenType
from vlmod.demo.media import Media

# Longest side of the pictures sent back to the page (they are drawn under the overlay).
PREVIEW_SIDE = 512
# Timed generate calls per model per request (interleaved, median reported); 0 = no timing.
TIMING_RUNS = 3


class AnalysisError(RuntimeError):
    """The model's tokens could not be mapped onto the picture (an unsupported layout)."""


@dataclass
class View:
    """A grid of vision tokens that covers the whole (displayed) picture."""

    name: str
    rows: int
    cols: int
    tokens: list[int]  # sequence positions, row-major, rows * cols of them
    cell: int | None = None  # model input pixels per token side, where the family's plugin says


@dataclass
class LoadedModel:
    """A converted checkpoint, its processor, and optionally its dense counterpart."""

    model: nn.Module
    processor: Any
    path: Path | str
    dense: nn.Module | None = None
    dense_path: Path | str | None = None
    warm_up_s: float | None = None  # set by `warm_up`: timing is fair only after it

    @property
    def supports_video(self) -> bool:
        return getattr(self.model.config, "video_token_id", None) is not None and hasattr(
            self.processor, "video_processor"
        )

    @property
    def mod_layers(self) -> dict[str, list[int]]:
        """{part: converted layer indices}."""
        import vlmod

        layers: dict[str, list[int]] = {}
        for part, layer in vlmod.mod_layers(self.model):
            layers.setdefault(part, []).append(layer)
        return {p: sorted(ls) for p, ls in layers.items()}

    def describe(self) -> dict[str, Any]:
        """What /api/health reports about the model."""
        import vlmod

        capacities = {f"{p}:{i}": c for (p, i), c in vlmod.mod_layers(self.model).items()}
        text, vision = self.model.config.text_config, self.model.config.vision_config
        return {
            "name": _name(self.path),
            "architecture": type(self.model).__name__,
            "video": self.supports_video,
            "language_layers": text.num_hidden_layers,
            "vision_layers": _depth(vision),
            "mod_layers": self.mod_layers,
            "capacities": capacities,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "dense": None if self.dense_path is None else _name(self.dense_path),
            "input_size": dict(zip(("width", "height"), self.input_size(), strict=True)),
            "patch_size": _side(vision.patch_size),
            "warm": self.warm_up_s is not None,
        }

    def input_size(self) -> tuple[int, int]:
        """(width, height) in pixels of one picture as the vision tower takes it (a dynamic-resolution
        family, Qwen: the largest square its processor keeps)."""
        vision = self.model.config.vision_config
        side = getattr(vision, "image_size", None)
        if side is None:
            size = getattr(self.processor.image_processor, "size", None) or {}
            unit = _side(vision.patch_size) * getattr(vision, "spatial_merge_size", 1)
            side = max(unit, math.isqrt(int(_get(size, "longest_edge") or 448 * 448)) // unit * unit)
        return (_side(side), _side(side))


def _side(size: Any) -> int:
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def _depth(vision_config: Any) -> int:
    return getattr(vision_config, "depth", None) or vision_config.num_hidden_layers


def _name(path: Path | str) -> str:
    """A checkpoint's short name: a local folder's name, or a hub id as given."""
    return path.name if isinstance(path, Path) else path


def load_model(path: str | Path, dense_path: str | Path | None = None, device: str = "cpu") -> LoadedModel:
    """Load a converted checkpoint (and a dense one to compare with: a local directory or a hub
    id, see `vlmod.demo.checkpoints`) for the demo."""
    import vlmod
    from vlmod.hf import load_vlm, loading_kwargs

    if Path(path).expanduser().exists():
        path = Path(path).expanduser()
    loading = loading_kwargs("auto", device)  # the checkpoint's own dtype, straight onto a GPU
    model, processor = load_vlm(path, ValueError, "the demo shows", **loading)
    model = model.to(device).eval()
    if not vlmod.mod_layers(model):
        raise ValueError(
            f"{path} has no MoD layers, so there is no routing to show; convert it first "
            "(vlmod convert --model DIR --out DIR)"
        )
    dense = None
    if dense_path is not None:
        dense = vlmod.load_pretrained(dense_path, **loading).to(device).eval()
        if vlmod.mod_layers(dense):
            vlmod.remove_mod(dense)
    return LoadedModel(model=model, processor=processor, path=path, dense=dense, dense_path=dense_path)


# ----------------------------------------------------------------------------- layout


def _base_side(model: nn.Module) -> int:
    vision = model.config.vision_config
    return _side(vision.image_size) // _side(vision.patch_size)


def image_views(n: int, side: int, aspect: float) -> list[View]:
    """Views of the `n` tokens of one image (positions 0..n-1) given the family's base grid side and
    the picture's width / height; see the module doc."""
    base = side * side
    if n == base or n == base + 1:  # plain LLaVA; anyres with a single tile (+ newline)
        return [View("tokens", side, side, list(range(base)))]
    rest = n - base
    if rest > 0:
        fits = [(h, rest // h - 1) for h in range(1, rest + 1) if rest % h == 0 and rest // h >= 2]
        if fits:
            h, w = min(fits, key=lambda hw: abs(math.log(hw[1] / hw[0]) - math.log(aspect)))
            detail = [base + r * (w + 1) + c for r in range(h) for c in range(w)]
            return [View("high-res", h, w, detail), View("overview", side, side, list(range(base)))]
    if math.isqrt(n) ** 2 == n:
        s = math.isqrt(n)
        return [View("tokens", s, s, list(range(n)))]
    raise AnalysisError(f"cannot lay out {n} image tokens on a grid (base grid {side}x{side})")


def video_views(n: int, frames: int) -> list[list[View]]:
    """Per frame, the view of its tokens out of the `n` video tokens of `frames` frames."""
    for extra in (0, 1):  # OneVision appends one newline token after all frames
        if (n - extra) % frames == 0:
            per = (n - extra) // frames
            s = math.isqrt(per)
            if s * s == per:
                return [[View("tokens", s, s, list(range(f * per, (f + 1) * per)))] for f in range(frames)]
    raise AnalysisError(f"cannot lay out {n} video tokens as {frames} square frame grids")


def seen_box(size: tuple[int, int], processor: Any) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the part of a `size` = (width, height) picture the processor
    keeps: the centre crop of a resize-shortest-edge + center-crop processor (CLIP, LLaVA-NeXT-Video
    frames), else the whole picture (squashed, or tiled by an anyres processor, whose tiles are
    already square so its crop changes nothing)."""
    width, height = size
    whole = (0, 0, width, height)
    if not getattr(processor, "do_center_crop", False) or getattr(processor, "image_grid_pinpoints", None):
        return whole
    ch, cw = _hw(getattr(processor, "crop_size", None))
    if not ch or not cw:
        return whole
    processor_size = getattr(processor, "size", None)
    shortest = _get(processor_size, "shortest_edge")
    if shortest:
        scale = shortest / min(width, height)
        rh, rw = height * scale, width * scale
    else:
        rh, rw = _hw(processor_size)
        if not rh or not rw:
            return whole
    fx, fy = min(1.0, cw / rw), min(1.0, ch / rh)
    box = ((1 - fx) / 2 * width, (1 - fy) / 2 * height, (1 + fx) / 2 * width, (1 + fy) / 2 * height)
    left, top, right, bottom = (round(v) for v in box)
    return (left, top, right, bottom)


def seen_region(picture: Image.Image, processor: Any) -> Image.Image:
    """The part of `picture` the processor keeps (`seen_box`)."""
    box = seen_box(picture.size, processor)
    return picture if box == (0, 0, *picture.size) else picture.crop(box)


def model_resolution(processor: Any, view: View, patch_size: int) -> tuple[int, int]:
    """(width, height) of the pixels the model takes for one picture: the grid's own cells where the
    family's plugin laid it out, else the processor's crop or fixed size, else (anyres) the first
    grid's cells times the patch size."""
    if view.cell:
        return (view.cols * view.cell, view.rows * view.cell)
    if getattr(processor, "do_center_crop", False) and not getattr(processor, "image_grid_pinpoints", None):
        ch, cw = _hw(getattr(processor, "crop_size", None))
        if ch and cw:
            return (int(cw), int(ch))
    h, w = _hw(getattr(processor, "size", None))
    if h and w and not getattr(processor, "image_grid_pinpoints", None):
        return (int(w), int(h))
    return (view.cols * patch_size, view.rows * patch_size)


def _get(d: Any, key: str) -> Any:
    if d is None:
        return None
    return d.get(key) if isinstance(d, dict) else getattr(d, key, None)


def _hw(d: Any) -> tuple[Any, Any]:
    return _get(d, "height"), _get(d, "width")


def _data_url(picture: Image.Image, size: tuple[int, int] | None = None) -> str:
    """A PNG (small pictures) or JPEG data URL of `picture`, at most PREVIEW_SIDE px (or resized to
    exactly `size`, as the processor resizes: bicubic)."""
    if size is not None:
        img = picture.resize(size, Image.Resampling.BICUBIC)
    else:
        img = picture.copy()
        img.thumbnail((PREVIEW_SIDE, PREVIEW_SIDE))
    buf = io.BytesIO()
    if max(img.size) <= 256:
        img.save(buf, format="PNG")
        mime = "png"
    else:
        img.save(buf, format="JPEG", quality=88)
        mime = "jpeg"
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# ----------------------------------------------------------------------------- running


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


def _generate(
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


TIMING_METHOD = (
    "greedy generate of {tokens} new tokens (end-of-sequence ignored), untraced, after a start-up "
    "warm-up; {models} interleaved, {runs} runs each in alternating order; median"
)


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
                samples[name].append(_generate(model, inputs, loaded.processor, max_new_tokens, exact=True)[1])
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
                    _generate(model, inputs, loaded.processor, max_new_tokens, exact=True)
    loaded.warm_up_s = time.perf_counter() - start
    return loaded.warm_up_s


def analyze(
    loaded: LoadedModel, media: Media, prompt: str, max_new_tokens: int = 16, timing_runs: int = TIMING_RUNS
) -> dict[str, Any]:
    """Answer `prompt` about `media` with the MoD model (and the dense one when loaded), describe
    what each MoD layer processed (a traced run), and time both fairly (`measure_latency`, untraced);
    see `vlmod.demo.app` for the JSON shape."""
    import vlmod
    from vlmod.bench import generation_flops

    model = loaded.model
    t0 = time.perf_counter()
    inputs, as_video = build_inputs(loaded, media, prompt)
    preprocess_s = time.perf_counter() - t0
    with torch.inference_mode():
        with vlmod.trace_routing(model) as trace:
            answer, generate_s = _generate(model, inputs, loaded.processor, max_new_tokens)
        dense = None
        if loaded.dense is not None:
            dense_answer, _ = _generate(loaded.dense, inputs, loaded.processor, max_new_tokens)
            dense = {"answer": dense_answer, "same_answer": dense_answer == answer}
    latency = measure_latency(loaded, inputs, max_new_tokens, timing_runs)
    # The prefill step: [rows, tokens] masks; language has one row (one prompt), the vision tower
    # one per image tile or frame.
    prefill_trace = trace.first_step()
    prefill = {k: processed.cpu() for k, processed in prefill_trace.processed.items()}
    seq_len = inputs["input_ids"].shape[1]
    types = trace.part_token_types("language")[0, :seq_len].cpu()
    vision_types = trace.part_token_types("vision").cpu() if "vision" in loaded.mod_layers else None

    media_views = _layout(loaded, media, types, as_video, inputs)
    text_cfg, vision_cfg = model.config.text_config, model.config.vision_config
    lang_mod = loaded.mod_layers.get("language", [])
    vis_mod = loaded.mod_layers.get("vision", [])
    n_layers, n_vis_layers = text_cfg.num_hidden_layers, _depth(vision_cfg)

    items = []
    picture_processor = _picture_processor(loaded.processor, as_video)
    for i, (picture, views) in enumerate(zip(media.frames, media_views, strict=True)):
        box = seen_box(picture.size, picture_processor)
        shown = picture if box == (0, 0, *picture.size) else picture.crop(box)
        model_w, model_h = model_resolution(picture_processor, views[0], _side(vision_cfg.patch_size))
        item: dict[str, Any] = {
            "index": i,
            "time_s": media.timestamps[i] if media.kind == "video" and i < len(media.timestamps) else None,
            "width": shown.width,
            "height": shown.height,
            "src": _data_url(shown),
            # What the model saw: this crop of the original picture, resized to model_size.
            "original": {"width": picture.width, "height": picture.height},
            "crop": {"x": box[0], "y": box[1], "width": box[2] - box[0], "height": box[3] - box[1]},
            "model_size": {"width": model_w, "height": model_h},
            "model_src": _data_url(shown, (model_w, model_h)),
            "views": [_view_json(v, lang_mod, prefill, "language") for v in views],
        }
        tokens = sorted({t for v in views for t in v.tokens})
        item["stats"] = _passes(tokens, lang_mod, n_layers, prefill, "language")
        item["vision"] = None
        if vision_types is not None and vis_mod:
            row = 0 if media.kind == "image" else i
            item["vision"] = _vision_json(row, vision_types, vis_mod, n_vis_layers, prefill)
        items.append(item)

    vision_positions = torch.nonzero((types == TokenType.IMAGE) | (types == TokenType.VIDEO)).flatten()
    n_vision = int(vision_positions.numel())
    processed_by_layer = {
        layer: int(prefill[("language", layer)][0, vision_positions].sum()) for layer in lang_mod
    }
    skipped = sum(n_vision - p for p in processed_by_layer.values())
    flops_mod = generation_flops(model, inputs, prefill_trace)
    flops_dense = generation_flops(model, inputs, None)
    stats: dict[str, Any] = {
        "vision_tokens": n_vision,
        "text_tokens": int(seq_len - n_vision),
        "processed_per_layer": {str(k): v for k, v in processed_by_layer.items()},
        "tokens_skipped": skipped,
        "skipped_fraction_mod_layers": skipped / max(1, n_vision * len(lang_mod)),
        "skipped_fraction_all_layers": skipped / max(1, n_vision * n_layers),
        "flops": {
            "dense": flops_dense["total"],
            "mod": flops_mod["total"],
            "dense_language": flops_dense["language"],
            "mod_language": flops_mod["language"],
            "dense_vision": flops_dense["vision"],
            "mod_vision": flops_mod["vision"],
            "saved_fraction": 1.0 - flops_mod["total"] / flops_dense["total"],
        },
        # generate: the traced run that made the maps (not a fair latency: see "latency").
        "latency_s": {"preprocess": preprocess_s, "generate": generate_s},
        "latency": latency,
        "dense": dense,
    }
    if vis_mod and vision_types is not None:
        patches = vision_types != TokenType.PREFIX
        vskipped = sum(int((~prefill[("vision", layer)] & patches).sum()) for layer in vis_mod)
        stats["vision_tower"] = {
            "patch_tokens": int(patches.sum()),
            "tokens_skipped": vskipped,
            "skipped_fraction_all_layers": vskipped / max(1, int(patches.sum()) * n_vis_layers),
        }
    return {
        "kind": media.kind,
        "input": "video" if as_video else ("frames" if media.kind == "video" else "image"),
        "prompt": prompt,
        "answer": answer,
        "layers": {
            "language": {"total": n_layers, "mod": lang_mod},
            "vision": {"total": n_vis_layers, "mod": vis_mod},
        },
        "media": items,
        "stats": stats,
    }


def _picture_processor(processor: Any, as_video: bool) -> Any:
    if as_video and hasattr(processor, "video_processor"):
        return processor.video_processor
    return processor.image_processor


def _layout(
    loaded: LoadedModel, media: Media, types: torch.Tensor, as_video: bool, inputs: dict[str, Any]
) -> list[list[View]]:
    """Per picture, its views with sequence positions of their tokens."""
    from vlmod.plugins.decoder import token_grids

    kind = TokenType.VIDEO if as_video else TokenType.IMAGE
    positions = torch.nonzero(types == kind).flatten().tolist()
    n, frames = len(positions), len(media.frames)
    grids = token_grids(loaded.model, inputs, [picture.size for picture in media.frames], as_video)
    if grids is not None:
        local = [[View(g.name, g.rows, g.cols, g.tokens, g.cell) for g in views] for views in grids]
        if as_video and local:  # a temporal step of merged patches covers several frames
            local = [local[f * len(local) // frames] for f in range(frames)]
        if len(local) != frames or any(t >= n for views in local for v in views for t in v.tokens):
            raise AnalysisError(f"the {len(local)} token grids of this model do not fit {frames} picture(s) of {n} tokens")
    elif as_video:
        local = video_views(n, frames)
    else:
        if n % frames:
            raise AnalysisError(f"{n} image tokens do not split evenly over {frames} images")
        per = n // frames
        side = _base_side(loaded.model)
        local = []
        for f, picture in enumerate(media.frames):
            views = image_views(per, side, picture.width / picture.height)
            local.append([View(v.name, v.rows, v.cols, [t + f * per for t in v.tokens]) for v in views])
    return [[View(v.name, v.rows, v.cols, [positions[t] for t in v.tokens], v.cell) for v in views] for views in local]


def _view_json(view: View, layers: list[int], prefill: dict, part: str) -> dict[str, Any]:
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


def _passes(tokens: list[int], mod: list[int], n_layers: int, prefill: dict, part: str) -> dict[str, Any]:
    """Layer passes (token x layer runs) of `tokens`: dense layers run all of them."""
    idx = torch.tensor(tokens, dtype=torch.long)
    n = len(tokens)
    run = n * (n_layers - len(mod)) + sum(int(prefill[(part, layer)][0, idx].sum()) for layer in mod)
    dense = n * n_layers
    return {"tokens": n, "layer_passes": run, "dense_layer_passes": dense, "compute_fraction": run / max(1, dense)}


def _vision_json(
    row: int, vision_types: torch.Tensor, layers: list[int], n_layers: int, prefill: dict
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
