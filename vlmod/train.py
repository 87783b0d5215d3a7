"""Fine-tune a (converted) LLaVA model on LLaVA-format image-text data with Accelerate.

One loop for one CPU, one GPU or many: `accelerate launch scripts/finetune.py --config ...` runs
it under DDP, FSDP or DeepSpeed as the accelerate config says; plain `python scripts/finetune.py`
runs it in one process. What trains is a mode, not a list of names:

=============  ============================================================================
trainable      parameters that get gradients
=============  ============================================================================
router         the MoD routers only (the cheapest way to teach a fresh conversion to route)
language       routers + multimodal projector + language model (LLaVA stage-2 style)
lora           routers + projector in full, LoRA adapters (peft) on the language model's
               attention and MLP projections; merged into the weights when saved
full           everything but the vision tower
=============  ============================================================================

`train_vision_tower: true` adds the vision tower to any mode (training from scratch needs it).

Checkpoints, resuming and the run's ownership of its output folder: `vlmod.checkpoints`.
The final model is written with `save_pretrained` (and its processor) to `output_dir/model`:
`vlmod.load_pretrained` and `vlmod eval` load it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.checkpoints import (
    RUN_FILE,
    DamagedCheckpoint,
    check_output_dir_owner,
    checkpoint_dir,
    clear_output_dir,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    run_settings,
    save_checkpoint,
    save_model,
)
from vlmod.data.collate import answer_mask
from vlmod.errors import TrainError
from vlmod.fileio import write_json
from vlmod.train_config import (  # TrainConfig, TRAINABLE and config_from_args re-exported
    TRAINABLE,
    TrainConfig,
    add_config_arguments,
    config_from_args,
)

# ----------------------------------------------------------------------------- model


def weights_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the frozen weights: `dtype:` of the config, "auto" being the checkpoint's own
    (read from its config, before any weight loads). What trains is float32 whatever this is."""
    from vlmod.hf import checkpoint_dtype, load_config, torch_dtype

    dtype = torch_dtype(cfg.dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return checkpoint_dtype(load_config(cfg.model))
    except (OSError, ValueError) as e:
        raise TrainError(str(e)) from None


def mixed_precision(cfg: TrainConfig, frozen: torch.dtype) -> str:
    """accelerate's mixed precision: the config's, or, where it says "no" but the frozen weights
    are bfloat16 / float16, autocast in their dtype (float32 trainable weights meet low-precision
    activations: the matmuls must agree on a dtype)."""
    if cfg.mixed_precision != "no" or frozen == torch.float32:
        return cfg.mixed_precision
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[frozen]


def load_model(cfg: TrainConfig, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """The LLaVA model (converted as saved, then by `mod:`) and its processor, its weights in
    `dtype` (mapped from the checkpoint when that is its own)."""
    from vlmod.hf import load_vlm
    from vlmod.routing.api import apply_mod
    from vlmod.routing.trace import find_parts

    model, processor = load_vlm(cfg.model, TrainError, "fine-tuning supports", dtype=dtype)
    if cfg.mod is not None:
        try:
            apply_mod(model, cfg.mod_config(), part="language")
        except ValueError as e:
            raise TrainError(f"mod: {e}") from None
    parts = find_parts(model)
    if cfg.aux_loss is not None or cfg.aux_loss_weight is not None:
        if not parts:
            raise TrainError("aux_loss is set but the model has no MoD layers; add `mod:` or convert it first")
        for part in parts:
            changes = {"aux_loss": cfg.aux_loss or part.config.aux_loss}
            if cfg.aux_loss_weight is not None:
                changes["aux_loss_weight"] = cfg.aux_loss_weight
            part.config = dataclasses.replace(part.config, **changes)
    if cfg.trainable == "router" and not parts:
        raise TrainError("trainable: router, but the model has no MoD routers; add `mod:` or convert it first")
    return model, processor


def _is_router(name: str) -> bool:
    return "mod_router" in name.split(".")


def set_trainable(model: nn.Module, trainable: str, train_vision_tower: bool = False) -> dict[str, int]:
    """Freeze everything, then unfreeze what `trainable` names (see the module doc); returns the
    number of trainable parameters per group. LoRA adapters are added by `add_lora` first."""
    groups = {"router": 0, "projector": 0, "language": 0, "vision": 0, "lora": 0, "other": 0}
    for name, p in model.named_parameters():
        if _is_router(name):
            group = "router"
        elif "lora_" in name:
            group = "lora"
        elif "multi_modal_projector" in name:
            group = "projector"
        elif "vision_tower" in name:
            group = "vision"
        elif "language_model" in name or "lm_head" in name:
            group = "language"
        else:
            group = "other"  # e.g. the anyres image_newline parameter
        on = {
            "router": group == "router",
            "language": group in ("router", "projector", "language", "other"),
            "lora": group in ("router", "projector", "lora", "other"),
            "full": group != "vision",
        }[trainable] or (train_vision_tower and group == "vision")
        p.requires_grad_(on)
        if on:
            groups[group] += p.numel()
    return {k: v for k, v in groups.items() if v}


def cast_trainable(model: nn.Module, dtype: torch.dtype) -> int:
    """Cast the parameters that train to `dtype` in place (float32: their master weights; the
    frozen dtype again before saving, so the saved model keeps the checkpoint's dtype); how many
    parameters were cast."""
    cast = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
                cast += p.numel()
    return cast


def add_lora(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """Wrap the language model's projections in peft LoRA adapters (vision tower untouched)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise TrainError("trainable: lora needs peft: pip install peft") from None
    pattern = rf".*language_model.*\.({'|'.join(cfg.lora_targets)})"
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=pattern)
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise TrainError(f"LoRA: {e}") from None


# ----------------------------------------------------------------------------- data


class EpochSampler(torch.utils.data.Sampler[int]):
    """A shuffle whose order is a function of (seed, epoch): a resumed run, and every process of
    a distributed run, sees the same permutation without sharing generator state."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle, self.epoch = size, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=g).tolist())

    def __len__(self) -> int:
        return self.size


def load_dataset(path: str, processor: Any, cfg: TrainConfig) -> Any:
    from vlmod.data import DataError, LlavaDataset

    try:
        return LlavaDataset(
            path, processor, cfg.image_root, strict=cfg.strict, num_frames=cfg.num_frames, cache=cfg.cache_data
        )
    except DataError as e:
        raise TrainError(str(e)) from None


# ----------------------------------------------------------------------------- metrics


def routed_counts(trace: Any, parts: Sequence[Any]) -> Tensor:
    """[routable tokens processed, routable tokens] over every MoD layer of a traced forward,
    on the device: summed over steps and read at log time only."""
    from vlmod.eval import routable_counts

    return torch.stack(list(routable_counts(trace, parts).values())).sum(0)


@torch.no_grad()
def answer_token_share(batch: dict[str, Any], accelerator: Any) -> Tensor:
    """This process's share of the micro-batch's answer tokens over all processes (their global
    count / the number of processes), the `num_items_in_batch` that makes each process's loss a
    sum over tokens scaled so that DDP's mean of the processes' gradients is the gradient of the
    global per-token mean: what one process computes on the whole batch, whatever the answer
    lengths (each process's own token mean would weigh every process alike instead)."""
    local = answer_mask(batch["labels"]).sum()
    total = accelerator.reduce(local, reduction="sum")
    return total.clamp_min(1).float() / accelerator.num_processes


def _takes_loss_kwargs(model: nn.Module) -> bool:
    """Whether the model's loss takes `num_items_in_batch`, decided as transformers' Trainer does:
    the model's own `accepts_loss_kwargs` where it says (Qwen3-VL says False), else whether its
    forward takes **kwargs. A model that does not keeps its per-process mean."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA
    declared = getattr(base, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    try:
        params = inspect.signature(base.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@torch.no_grad()
def validation_loss(model: nn.Module, loader: Any, accelerator: Any, compute: Any = nullcontext) -> float:
    """Mean answer loss over `loader` (all processes): per-sample mean NLL of the answer tokens,
    as `vlmod eval` reports it (no router aux term). `compute`: the forward's autocast context."""
    from vlmod.eval import answer_losses

    model.eval()
    total = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device)
    for batch in loader:
        with compute():
            logits = model(**batch).logits
        losses = answer_losses(logits, batch["labels"])
        total += losses.sum()
        count += losses.numel()
    model.train()
    total, count = accelerator.reduce(total), accelerator.reduce(count)
    return float(total / count.clamp_min(1))


def _sharded(accelerator: Any) -> bool:
    """Whether parameters or optimizer state are split over processes (FSDP, DeepSpeed, ...)."""
    return accelerator.distributed_type.value in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def _check_memory(model: nn.Module, dataset: Any, cfg: TrainConfig, dtype: torch.dtype, accelerator: Any) -> Any:
    """Estimate the run's peak memory from its first micro-batch and refuse, in one line, a run
    that cannot fit this process's device (`vlmod.train_memory`); sharded runs (FSDP, ZeRO) hold
    less than one process's estimate, so they are not refused."""
    from vlmod import train_memory

    first = dataset.collate([dataset[i] for i in range(min(cfg.batch_size, len(dataset)))])
    ids = first["input_ids"]
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, dtype)
    needed = train_memory.estimate(
        model, ids.numel(), longest=ids.shape[1], compute_dtype=compute, gradient_checkpointing=cfg.gradient_checkpointing
    )
    if not _sharded(accelerator):
        train_memory.check_fits(needed, accelerator.device, TrainError)
    return needed


# ----------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    """What a run did: optimizer steps, the last logged losses, where the model went."""

    step: int
    loss: float | None
    val_loss: float | None
    routed_fraction: float | None
    model_dir: Path
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    main_process: bool = True


def step_capacities(cfg: TrainConfig, converted: dict[str, float], step: int, total_steps: int) -> dict[str, float]:
    """Each MoD part's mean capacity for optimizer step `step` (empty: leave them as they are): the
    step's draw from `cfg.capacities` (seeded by step, so a resumed run draws the same), raised
    toward 1.0 during `cfg.capacity_warmup`."""
    if cfg.capacities:
        draw = cfg.capacities[random.Random(cfg.seed * 1_000_003 + step).randrange(len(cfg.capacities))]
        targets = dict.fromkeys(converted, draw)
    elif cfg.capacity_warmup:
        targets = dict(converted)
    else:
        return {}
    warmup = cfg.capacity_warmup if cfg.capacity_warmup >= 1 else cfg.capacity_warmup * total_steps
    left = max(0.0, 1.0 - step / warmup) if warmup else 0.0  # share of the warm-up still to go
    return {name: c + (1.0 - c) * left for name, c in targets.items()}


def _make_accelerator(cfg: TrainConfig, precision: str) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import ProjectConfiguration

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != precision and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
        # accelerate keeps one process-wide state and refuses another precision in the same process
        # (a second run in a notebook, a recipe's next stage); one process has nothing else to keep.
        AcceleratorState._reset_state()
    project = ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs"))
    return Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=precision,
        log_with=cfg.report_to or None,
        project_config=project,
    )


def _check_launch(accelerator: Any) -> None:
    """Refuse a launch that accelerate did not turn into the distributed run it asked for, rather
    than train N independent copies that overwrite one output folder (or run FSDP as DDP)."""
    import accelerate
    from accelerate.utils import DistributedType

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    kind = accelerator.distributed_type
    if world > 1 and accelerator.num_processes != world:
        raise TrainError(
            f"launched as {world} processes, but accelerate {accelerate.__version__} made this a run of "
            f"{accelerator.num_processes} ({kind.value}): with no GPU here, set ACCELERATE_USE_CPU=true (DDP over gloo), "
            "e.g. ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/finetune.py ..."
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and kind != DistributedType.FSDP:
        # accelerate/state.py turns only GPU-like multi-device types into FSDP, never MULTI_CPU
        # (and `accelerate launch --cpu` runs FSDP configs as one plain process).
        raise TrainError(
            f"the accelerate config asks for FSDP, but accelerate {accelerate.__version__} runs this launch as "
            f"{kind.value} with {accelerator.num_processes} process(es): it sets FSDP up on GPUs (and other "
            "accelerators) only, not on CPU; on CPU use DDP over gloo "
            "(ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/finetune.py ...)"
        )


def _check_lora_sharding(cfg: TrainConfig, accelerator: Any) -> None:
    """LoRA is merged into the weights at save time, which needs whole parameters: refuse the
    setups that shard them (FSDP, ZeRO-3) instead of saving a broken model."""
    from accelerate.utils import DistributedType

    if cfg.trainable != "lora":
        return
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    if accelerator.distributed_type == DistributedType.FSDP or (ds is not None and ds.zero_stage == 3):
        raise TrainError(
            "trainable: lora with FSDP or DeepSpeed ZeRO-3 shards the weights the adapters are merged into; "
            "use configs/accelerate/multi_gpu.yaml or zero2.yaml for LoRA"
        )


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    router, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _is_router(name):
            router.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": router, "weight_decay": 0.0, "lr": cfg.router_lr or cfg.lr},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr)


def train(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """Run `cfg` (see the module doc) and return what it did."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from vlmod.routing.api import set_capacity
    from vlmod.routing.trace import find_parts, trace_routing

    start = time.perf_counter()
    for path in (cfg.data, cfg.val_data):
        if path is not None and not Path(path).expanduser().is_file():
            raise TrainError(f"data file {path} does not exist")
    check_output_dir_owner(cfg)
    resume_from = resolve_resume(cfg)
    frozen_dtype = weights_dtype(cfg)
    accelerator = _make_accelerator(cfg, mixed_precision(cfg, frozen_dtype))
    _check_launch(accelerator)
    _check_lora_sharding(cfg, accelerator)
    set_seed(cfg.seed)
    model, processor = load_model(cfg, frozen_dtype)
    teacher = None
    if cfg.distill_from is not None:
        from vlmod.distill import Teacher

        teacher = Teacher.load(cfg.distill_from, accelerator.device, TrainError)
    train_set = load_dataset(cfg.data, processor, cfg)
    val_set = load_dataset(cfg.val_data, processor, cfg) if cfg.val_data else None
    if cfg.gradient_checkpointing:
        # transformers 5.24 renamed it activation_checkpointing_enable (the old name deprecated).
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.trainable == "lora":
        model = add_lora(model, cfg)
    groups = set_trainable(model, cfg.trainable, cfg.train_vision_tower)
    if not groups:
        raise TrainError(f"trainable: {cfg.trainable} leaves no parameter to train in this model")
    parts = find_parts(model)
    needed = _check_memory(model, train_set, cfg, frozen_dtype, accelerator)
    cast_trainable(model, torch.float32)  # master weights: updates too small for bfloat16 still add up
    # accelerate autocasts the forward for bf16 (and for fp16 on a GPU); fp16 on CPU it leaves alone.
    low_precision = frozen_dtype != torch.float32 and not accelerator.native_amp
    compute = partial(torch.autocast, accelerator.device.type, dtype=frozen_dtype) if low_precision else nullcontext

    loader = torch.utils.data.DataLoader(
        train_set, batch_size=cfg.batch_size, sampler=EpochSampler(len(train_set), cfg.seed), collate_fn=train_set.collate,
        num_workers=cfg.num_workers, drop_last=len(train_set) >= cfg.batch_size,
    )
    val_loader = None
    if val_set is not None:
        val_loader = torch.utils.data.DataLoader(
            val_set, batch_size=cfg.batch_size, collate_fn=val_set.collate, num_workers=cfg.num_workers
        )
    optimizer = _optimizer(model, cfg)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # After prepare: `len(loader)` is per process, and DeepSpeed may have set the accumulation.
    # The last partial accumulation of an epoch steps the optimizer too, hence the ceil.
    steps_per_epoch = math.ceil(len(loader) / accelerator.gradient_accumulation_steps)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    warmup = int(cfg.warmup) if cfg.warmup >= 1 else int(cfg.warmup * total_steps)
    # A prepared scheduler steps once per process per optimizer step (accelerate's convention).
    scheduler = accelerator.prepare(get_scheduler(
        {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.scheduler],
        optimizer,
        num_warmup_steps=warmup * accelerator.num_processes,
        num_training_steps=total_steps * accelerator.num_processes,
    ))
    if val_loader is not None:
        val_loader = accelerator.prepare(val_loader)

    step, epoch, batch_in_epoch = 0, 0, 0
    damaged: list[str] = []
    for checkpoint in resume_from:
        try:
            state = load_checkpoint(accelerator, checkpoint)
        except DamagedCheckpoint as e:
            if cfg.resume != "latest":
                raise TrainError(f"resume: {e}; resume from another checkpoint, or start over with --overwrite") from None
            damaged.append(str(e))
            accelerator.print(f"warning: {e}; trying the next older checkpoint")
            continue
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        newest = " (the newest intact checkpoint)" if damaged else ""
        accelerator.print(f"resumed from {checkpoint}{newest}: step {step}, epoch {epoch}, batch {batch_in_epoch}")
        break
    else:
        if resume_from:
            raise TrainError(
                f"resume: latest, but no checkpoint in {checkpoint_dir(cfg.output_dir)} is intact ({'; '.join(damaged)}); "
                "start over with --overwrite"
            )
    if accelerator.is_main_process:
        if cfg.overwrite:
            clear_output_dir(Path(cfg.output_dir))
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(cfg.output_dir) / RUN_FILE, {"settings": run_settings(cfg)})
    if cfg.report_to:
        accelerator.init_trackers("vlmod-finetune", config={k: str(v) for k, v in cfg.to_dict().items()})
    accelerator.print(
        f"weights: frozen in {str(frozen_dtype).removeprefix('torch.')}, trainable in float32 (master weights), "
        f"forward {'in float32' if frozen_dtype == torch.float32 and cfg.mixed_precision == 'no' else 'under autocast'}; "
        f"estimated peak {needed.describe()}"
    )
    accelerator.print(
        f"training {', '.join(f'{k} {v:,}' for k, v in groups.items())} parameters; "
        f"{len(train_set)} samples, {total_steps} steps of {cfg.batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes}"
    )

    bar = tqdm(total=total_steps, initial=step, desc="finetune", unit="step", disable=not (progress and accelerator.is_local_main_process))
    history: list[dict[str, float]] = []
    loss_sum = torch.zeros((), device=accelerator.device)
    micro = 0
    routed = torch.zeros(2, dtype=torch.long, device=accelerator.device)
    last: dict[str, float] = {}
    val_loss = None
    converted = {p.name: p.config.capacity for p in parts}
    if (cfg.capacities or cfg.capacity_warmup) and not parts:
        key = "capacities" if cfg.capacities else "capacity_warmup"
        raise TrainError(f"{key}: the model has no MoD layers; convert it (or give mod:) first")
    model.train()
    per_token = accelerator.num_processes > 1 and _takes_loss_kwargs(accelerator.unwrap_model(model))
    while step < total_steps:
        loader.set_epoch(epoch)  # the prepared loader passes its epoch on to the sampler (and a skip-loader)
        epoch_loader = accelerator.skip_first_batches(loader, batch_in_epoch) if batch_in_epoch else loader
        for batch in epoch_loader:
            for name, capacity in step_capacities(cfg, converted, step, total_steps).items():
                set_capacity(accelerator.unwrap_model(model), capacity, part=name)
            with accelerator.accumulate(model):
                token_share = answer_token_share(batch, accelerator) if per_token else None
                extra = {} if token_share is None else {"num_items_in_batch": token_share}
                if parts:
                    with trace_routing(model) as trace, compute():
                        out = model(**batch, **extra)
                    routed += routed_counts(trace, parts).to(routed.device)
                else:
                    with compute():
                        out = model(**batch, **extra)
                loss = out.loss
                if teacher is not None:
                    loss = loss + cfg.distill_weight * teacher.loss(out.logits, batch, token_share)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            batch_in_epoch += 1
            loss_sum += loss.detach().float()
            micro += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if step % max(cfg.log_steps, 1) == 0 or step == total_steps:
                mean_loss = float(accelerator.reduce(loss_sum, reduction="mean")) / micro
                if not math.isfinite(mean_loss):
                    raise TrainError(f"the loss became {mean_loss} by step {step}: lower lr, or use mixed_precision: no")
                last = {"step": step, "loss": mean_loss, "lr": scheduler.get_last_lr()[0]}
                done, total = accelerator.reduce(routed, reduction="sum").tolist()
                if total:
                    last["skip_rate"] = 1.0 - done / total
                history.append(last)
                bar.set_postfix({k: f"{v:.3g}" for k, v in last.items() if k != "step"})
                if cfg.report_to:
                    accelerator.log({f"train/{k}": v for k, v in last.items() if k != "step"}, step=step)
                loss_sum.zero_()
                routed.zero_()
                micro = 0
            if val_loader is not None and cfg.eval_steps and (step % cfg.eval_steps == 0 or step == total_steps):
                val_loss = validation_loss(model, val_loader, accelerator, compute)
                history.append({"step": step, "val_loss": val_loss})
                bar.write(f"step {step}: validation loss {val_loss:.4f}")
                if cfg.report_to:
                    accelerator.log({"val/loss": val_loss}, step=step)
            if cfg.save_steps and step % cfg.save_steps == 0 and step < total_steps:
                save_checkpoint(accelerator, cfg, {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch})
            if step >= total_steps:
                break
        else:
            epoch += 1
            batch_in_epoch = 0
    bar.close()
    for name, capacity in converted.items() if cfg.capacities or cfg.capacity_warmup else ():
        set_capacity(accelerator.unwrap_model(model), capacity, part=name)
    if not _sharded(accelerator):
        cast_trainable(accelerator.unwrap_model(model), frozen_dtype)  # saved in the checkpoint's dtype
    out_dir = save_model(accelerator, model, processor, Path(cfg.output_dir) / "model")
    if accelerator.is_main_process:
        write_json(Path(cfg.output_dir) / "train_log.json", {"config": cfg.to_dict(), "history": history})
    if cfg.report_to:
        accelerator.end_training()
    return TrainResult(
        step=step,
        loss=last.get("loss"),
        val_loss=val_loss,
        routed_fraction=None if "skip_rate" not in last else 1.0 - last["skip_rate"],
        model_dir=out_dir,
        seconds=time.perf_counter() - start,
        history=history,
        main_process=accelerator.is_main_process,
    )


# ----------------------------------------------------------------------------- command line

def add_finetune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `scripts/finetune.py` and `vlmod finetune`: a YAML config plus overrides."""
    add_config_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_finetune)
    return parser


def run_finetune(args: argparse.Namespace) -> int:
    """Build the config, train, say where the model went; bad input is one `error:` line."""
    try:
        cfg = config_from_args(args)
        result = train(cfg, progress=not args.no_progress)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not result.main_process:
        return 0
    summary = f"{result.step} steps in {result.seconds:.0f} s"
    if result.loss is not None:
        summary += f", loss {result.loss:.4f}"
    if result.val_loss is not None:
        summary += f", validation loss {result.val_loss:.4f}"
    if result.routed_fraction is not None:
        summary += f", routed fraction {result.routed_fraction:.3f}"
    print(f"{summary}; model saved to {result.model_dir}")
    return 0


__all__ = [
    "TRAINABLE",
    "EpochSampler",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "add_finetune_arguments",
    "config_from_args",
    "latest_checkpoint",
    "run_finetune",
    "set_trainable",
    "train",
]
