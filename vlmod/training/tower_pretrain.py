"""Pretrain a tiny LLaVA's vision tower on the synthetic scenes, before any language training.

LLaVA starts from a pretrained CLIP; the recipes' towers start from random weights. Trained
only through the language model's answer loss, a 2-layer tower barely encodes shape: a linear
probe on the object's patch of the tower's last layer reads the shape 44% of the time (5
shapes), and the video model, which sees each frame as 2x2-pooled tokens, answered shape
questions at 43%. Here every patch is told what it shows (the shape and colour of the object
covering it, or background) through a linear head on the features the projector reads: about
1,500 steps of 64 images (2-3 min on 2 cores) and the same probe reads shape at 99%. The head
is thrown away; the checkpoint saved is the whole LLaVA with the pretrained tower.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlmod.data.llava_format import load_image, read_json_records, resolve_image_path
from vlmod.data.scenes import COLORS, SHAPES, shape_alpha
from vlmod.errors import InputError
from vlmod.io.files import save_pretrained_atomic, write_json

MIN_COVER = 0.2  # a patch shows an object when the object covers at least this share of it
NO_DIGIT = 10  # a patch that shows no glyph (fine-detail set)
COLOR_NAMES = tuple(COLORS)


def patch_targets(objects: list[dict[str, Any]], image_size: int, patch_size: int) -> np.ndarray:
    """[2, patches] int64: each patch's shape class and colour class (row-major), from the
    objects a synthetic scene's meta lists; background is `len(SHAPES)` / `len(COLORS)`. Where
    objects overlap the patch goes to the one covering most of it."""
    if image_size % patch_size:
        raise InputError(f"image size {image_size} is not a multiple of patch size {patch_size}")
    g = image_size // patch_size
    targets = np.array([[len(SHAPES)], [len(COLORS)]], dtype=np.int64).repeat(g * g, axis=1)
    best = np.full(g * g, MIN_COVER)
    for obj in objects:
        cover = shape_alpha(obj["shape"], *obj["center"], obj["radius"], image_size)
        cover = cover.reshape(g, patch_size, g, patch_size).mean(axis=(1, 3)).reshape(-1)
        wins = cover >= best
        best = np.where(wins, cover, best)
        targets[0, wins] = SHAPES.index(obj["shape"])
        targets[1, wins] = COLOR_NAMES.index(obj["color"])
    return targets


def glyph_targets(glyphs: list[dict[str, Any]], image_size: int, patch_size: int) -> np.ndarray:
    """[patches] int64: the digit each patch shows (a fine-detail glyph's box touches it,
    `vlmod.data.detail`), else 10 (none)."""
    from vlmod.data.detail import box_patches

    targets = np.full((image_size // patch_size) ** 2, NO_DIGIT, dtype=np.int64)
    for g in glyphs:
        targets[box_patches(g["box"], image_size, patch_size)] = g["digit"]
    return targets


def scene_images(data_json: str | Path, image_size: int, patch_size: int,
                 solid_only: bool = False) -> tuple[list[Any], np.ndarray]:
    """The distinct images of a synthetic image set (`vlmod data synthetic`) and their patch
    targets [n, 2, patches]: the scenes' object records are the labels. A fine-detail set
    (`vlmod.data.detail`, its records list `glyphs`) gets a third row, each patch's digit, and a
    glyph's patch has the glyph's colour (the question names the glyph by it). `solid_only`: the
    pictures whose objects are all at full contrast (no faint one's labels, which name shapes the
    noise may hide)."""
    data_json = Path(data_json).expanduser()
    seen: dict[str, list[dict[str, Any]]] = {}
    digits: dict[str, list[dict[str, Any]]] = {}
    for i, raw in enumerate(read_json_records(data_json)):
        meta, image = raw.get("meta") or {}, raw.get("image")
        if not isinstance(image, str) or "objects" not in meta:
            raise InputError(f"{data_json}: record {i} is not a synthetic scene (an 'image' and meta.objects); "
                             "tower pretraining needs `vlmod data synthetic` images")
        if solid_only and any(o.get("contrast", 1.0) < 1.0 for o in meta["objects"]):
            continue
        seen.setdefault(image, meta["objects"])
        if "glyphs" in meta:
            digits.setdefault(image, meta["glyphs"])
    images = [load_image(resolve_image_path(p, data_json.parent)) for p in seen]
    if images and images[0].size != (image_size, image_size):
        raise InputError(f"{data_json}: images are {images[0].size[0]} px, the tower reads {image_size} px; "
                         "generate the data at the tower's image size")
    targets = np.stack([patch_targets(objs, image_size, patch_size) for objs in seen.values()])
    if digits:  # the glyphs are what a fine-detail question reads: the tower learns their digit and colour
        from vlmod.data.detail import box_patches

        glyph_rows = np.stack([glyph_targets(digits.get(p, []), image_size, patch_size) for p in seen])
        targets = np.concatenate([targets, glyph_rows[:, None]], axis=1)
        for row, path in zip(targets, seen, strict=True):
            for g in digits.get(path, []):
                row[1, box_patches(g["box"], image_size, patch_size)] = COLOR_NAMES.index(g["color"])
    return images, targets


def _accuracy(logits: torch.Tensor, targets: torch.Tensor, background: int) -> float:
    """Share of the patches showing an object whose class is right."""
    shown = targets != background
    return float((logits.argmax(-1) == targets)[shown].float().mean()) if bool(shown.any()) else float("nan")


def pretrain_tower(model_dir: str | Path, data_json: str | Path, out: str | Path, steps: int = 1500,
                   batch_size: int = 64, lr: float = 2e-3, weight_decay: float = 0.05, val_images: int = 500,
                   seed: int = 0, solid_only: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train the vision tower of the LLaVA in `model_dir` to tell each patch's object (shape and
    colour) on the synthetic images of `data_json` (`solid_only`: its solid pictures, `scene_images`); save the whole model to `out/model` and
    `out/log.json` (per-patch accuracy on the last `val_images` held-out images). The learning
    rate warms up over 10% of the steps and decays by a cosine."""
    from tqdm.auto import tqdm
    from transformers import AutoProcessor

    from vlmod.io.hf import load_pretrained, vision_tower

    out = Path(out).expanduser()
    model = load_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    tower = vision_tower(model)
    if tower is None:
        raise InputError(f"{model_dir} has no vision_tower to pretrain (a LLaVA-family checkpoint has one)")
    vcfg = tower.config
    images, targets = scene_images(data_json, vcfg.image_size, vcfg.patch_size, solid_only)
    n_val = min(val_images, len(images) // 8)
    if len(images) - n_val < 1:
        raise InputError(f"{data_json} holds {len(images)} images: too few to pretrain the tower")
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    labels = torch.from_numpy(targets)
    train_n = len(images) - n_val
    with_digits = labels.shape[1] == 3
    head = torch.nn.Linear(vcfg.hidden_size, len(SHAPES) + 1 + len(COLORS) + 1 + (NO_DIGIT + 1) * with_digits)
    torch.manual_seed(seed)
    torch.nn.init.normal_(head.weight, std=0.02)
    torch.nn.init.zeros_(head.bias)
    params = list(tower.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(
        math.pi * max(0, s - warm) / max(1, steps - warm)))))
    gen = torch.Generator().manual_seed(seed)
    split, split2 = len(SHAPES) + 1, len(SHAPES) + len(COLORS) + 2

    def logits(px: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = head(tower(px).last_hidden_state[:, 1:])  # the patches (the projector drops CLS)
        return h[..., :split], h[..., split:split2], h[..., split2:]

    tower.train()
    start, losses = time.perf_counter(), []
    bar = tqdm(range(steps), desc="pretrain tower", unit="step", disable=not progress)
    for step in bar:
        idx = torch.randint(0, train_n, (batch_size,), generator=gen)
        shape_logits, color_logits, digit_logits = logits(pixels[idx])
        loss = F.cross_entropy(shape_logits.flatten(0, 1), labels[idx, 0].flatten()) + F.cross_entropy(
            color_logits.flatten(0, 1), labels[idx, 1].flatten())
        if with_digits:
            loss = loss + F.cross_entropy(digit_logits.flatten(0, 1), labels[idx, 2].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:  # one host sync every 50 steps, for the log
            losses.append({"step": step, "loss": round(loss.item(), 5)})
            bar.set_postfix(loss=f"{losses[-1]['loss']:.3f}")
    tower.eval()
    with torch.no_grad():
        shape_logits, color_logits, digit_logits = logits(pixels[train_n:])
    log = {
        "model": str(model_dir), "data": str(data_json), "steps": steps, "batch_size": batch_size, "lr": lr,
        "weight_decay": weight_decay, "seed": seed, "train_images": train_n, "val_images": n_val,
        "val_patch_shape_accuracy": _accuracy(shape_logits, labels[train_n:, 0], len(SHAPES)),
        "val_patch_color_accuracy": _accuracy(color_logits, labels[train_n:, 1], len(COLORS)),
        **({"val_patch_digit_accuracy": _accuracy(digit_logits, labels[train_n:, 2], NO_DIGIT)} if with_digits else {}),
        "seconds": time.perf_counter() - start, "losses": losses,
    }
    save_pretrained_atomic(model, processor, out / "model")
    write_json(out / "log.json", log)
    return log


__all__ = ["MIN_COVER", "NO_DIGIT", "glyph_targets", "patch_targets", "pretrain_tower", "scene_images"]
