"""What `vlmod bench train` needs, checked before its batch is built: the synthetic batch's files in
the temp folder and the two models' training memory, refused in one line (as `vlmod finetune`
refuses, with its estimate: `vlmod.training.memory`). Before, `--batch-size 1000000` wrote 372,000
PNGs (1.5 GB) in 3 minutes and large batches ended in allocator tracebacks."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmod.errors import InputError

GB = 10**9


def check_room(
    models: dict[str, tuple[nn.Module, str]], make_batch: Callable[[int, Path], dict[str, Any]], batch: int,
    directory: Path, compute_dtype: torch.dtype, gradient_checkpointing: bool, device: str | torch.device,
) -> None:
    """InputError when `batch` rows do not fit: the files `make_batch(rows, folder)` writes (one row
    is made and measured in a folder under `directory`, then removed) against the free space there,
    and the training memory of `models` (name: (model, what trains, in `set_trainable`'s words))
    stepped one after the other: frozen weights shared once, each one's trainable state, the
    larger activations (`vlmod.training.memory.estimate` and `check_fits`)."""
    from vlmod.training import memory
    from vlmod.training.logits import answer_logits_inputs
    from vlmod.training.setup import set_trainable

    probe = directory / "probe"
    probe.mkdir()
    try:
        row = make_batch(1, probe)
        per_row = sum(f.stat().st_size for f in probe.iterdir() if f.is_file())
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    free = shutil.disk_usage(directory).free
    if per_row * batch > free:
        raise InputError(
            f"--batch-size {batch} writes about {_size(per_row * batch)} of synthetic pictures or clips "
            f"({_size(per_row)} a row) to the temp folder {directory.parent}, which has {_size(free)} free; lower "
            "--batch-size or point TMPDIR at a folder with room"
        )
    ids = row["input_ids"]
    estimates = []
    for model, trainable in models.values():  # flags only: `prepare_training` sets them again
        set_trainable(model, trainable)
        keep = answer_logits_inputs(model, row).get("logits_to_keep")
        estimates.append(memory.estimate(
            model, ids.shape[1] * batch, longest=ids.shape[1], compute_dtype=compute_dtype,
            gradient_checkpointing=gradient_checkpointing, logit_rows=None if keep is None else batch * keep.numel(),
        ))
    frozen = max(e.frozen_weights for e in estimates)  # the dense twin shares the MoD model's
    state = sum(e.trainable_state for e in estimates)
    activations = max(e.activations for e in estimates)  # the steps take turns
    process = estimates[0].process
    needed = memory.MemoryEstimate(
        frozen, state, activations, process,
        memory.headroom(state // 16, state + activations + process, frozen, torch.device(device).type),
    )
    memory.check_fits(needed, torch.device(device), InputError)


def _size(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


__all__ = ["check_room"]
