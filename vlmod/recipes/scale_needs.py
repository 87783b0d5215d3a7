"""What a `vlmod scale-check` run needs of the machine, checked before anything is built or
written: the checkpoint's bytes (`vlmod.models.scale.checkpoint_bytes`, from its config), the
memory every stage holds at the least (the model once, plus the libraries), and the disk its
outputs take (the checkpoint, its converted copy, a fine-tuned model). Without it `--layers 1000`
started building a 406 GB checkpoint and was stopped by the allocator."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vlmod.errors import InputError
from vlmod.io.paths import nearest_existing

GB, GIB = 10**9, 1024**3
# What a stage holds besides the model: Python, torch, transformers and vlmod imported (the
# measured baseline was 0.86 GiB), and for the disk, the data set, logs and reports.
LIBRARIES = GIB
SMALL_FILES = GIB
# Fewer language layers than convert's default (every other layer, the first dense) converts
# any of: a one-layer model is refused by the convert stage.
MIN_LAYERS = 2
# Stages that write a copy of the model (a fine-tune's saved model; finetune-full refuses first).
MODEL_COPIES = {"convert": 1, "finetune-router": 1, "finetune-lora": 1}


def check_machine(shape: str, root: Path, layers: int, stages: tuple[str, ...], keep: bool) -> None:
    """InputError, in one line that says what the run needs and what this machine has, when the
    checkpoint scale-check would build and the stages' outputs do not fit the free disk under
    `root`, or the model does not fit the memory. A checkpoint already in `root` is measured; with
    none and no build stage the stages fail on their own, in their logs, and nothing is checked."""
    import torch

    from vlmod.models.scale import checkpoint_bytes
    from vlmod.training.memory import available_bytes

    ckpt = root / "checkpoint"
    built = not (ckpt / "config.json").is_file()
    if built and "build" not in stages:
        return
    size = checkpoint_bytes(shape, layers) if built else sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    memory = size + LIBRARIES
    finetunes = sum(MODEL_COPIES.get(s, 0) for s in stages if s.startswith("finetune"))
    # Fine-tuned models are deleted once measured, unless --keep: one at a time on disk.
    copies = int(built) + MODEL_COPIES["convert"] * ("convert" in stages) + (finetunes if keep else min(finetunes, 1))
    disk = size * copies + SMALL_FILES
    have_memory = available_bytes(torch.device("cpu"))
    where = nearest_existing(root)
    free = shutil.disk_usage(where).free
    memory_short = memory > have_memory and os.environ.get("VLMOD_SKIP_MEMORY_CHECK") != "1"
    if not memory_short and disk <= free:
        return
    what = f"a {shape} checkpoint of {layers} language layers is {size / GB:.1f} GB (bfloat16)" if built else \
        f"the checkpoint in {ckpt} is {size / GB:.1f} GB"
    short = " and ".join(x for x, s in (("memory", memory_short), ("disk", disk > free)) if s)
    raise InputError(
        f"not enough {short}: {what}; its stages need about {memory / GB:.1f} GB of memory and "
        f"{disk / GB:.1f} GB of disk, and this machine has {have_memory / GB:.1f} GB of memory free and "
        f"{free / GB:.1f} GB of disk free under {where}; choose fewer --layers (32 is the real model), fewer "
        "--stages or another --workdir (VLMOD_SKIP_MEMORY_CHECK=1 skips the memory check)"
    )


__all__ = ["MIN_LAYERS", "check_machine"]
