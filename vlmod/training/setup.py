"""What a fine-tuning run holds before its first step (`prepare`): the launch checked, the model
loaded (converted by `mod:`, LoRA added, its trainable parameters chosen and kept in float32 master
weights), the data, the optimizer and scheduler, everything passed through Accelerate.

The weights that do not train stay in the checkpoint's dtype (`dtype: auto`); a bfloat16 /
float16 model then runs its forward under autocast in that dtype (`Run.compute`). The run's
peak memory is estimated from its first micro-batch and a run that cannot fit is refused
(`vlmod.training.memory`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmod.api import apply_mod
from vlmod.data import DataError, LlavaDataset
from vlmod.errors import TrainError
from vlmod.io.adapters import peft_quietly
from vlmod.io.hf import max_positions
from vlmod.routing.trace import find_parts
from vlmod.training import memory
from vlmod.training.checkpoints import check_output_dir_owner, resolve_resume
from vlmod.training.config import TrainConfig
from vlmod.training.distill import Teacher
from vlmod.training.fsdp import largest_unit_bytes, set_layer_classes, shard_on_cpu
from vlmod.training.launch import check_launch, check_lora_sharding, make_accelerator
from vlmod.training.logits import answer_logits_inputs

# ----------------------------------------------------------------------------- model


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # mixed_precision: the forward's dtype


def weights_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the frozen weights: `dtype:` of the config, "auto" being the checkpoint's own
    (read from its config, before any weight loads), except that a float16 checkpoint (llava-hf's
    are) loads in bfloat16 for `mixed_precision: bf16`: bfloat16 autocast cannot run float16
    weights (`check_precision`). What trains is float32 whatever this is."""
    from vlmod.io.hf import checkpoint_dtype, load_config, torch_dtype

    dtype = torch_dtype(cfg.dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        stored = checkpoint_dtype(load_config(cfg.model))
    except (OSError, ValueError) as e:
        raise TrainError(str(e)) from None
    return torch.bfloat16 if stored == torch.float16 and cfg.mixed_precision == "bf16" else stored


def check_precision(frozen: torch.dtype, accelerator: Any) -> None:
    """Refuse, before the model loads, frozen weights in the other 16-bit dtype than the autocast
    accelerate runs the forward under (`dtype: float16` with `mixed_precision: bf16`): torch's
    autocast stops at the first op that meets both ("Unexpected floating ScalarType")."""
    autocast = AUTOCAST_DTYPES.get(accelerator.mixed_precision) if accelerator.native_amp else None
    if autocast is None or frozen in (torch.float32, autocast):
        return
    have, want = (str(d).removeprefix("torch.") for d in (frozen, autocast))
    raise TrainError(
        f"dtype {have} with mixed_precision {accelerator.mixed_precision}: the forward runs under {want} autocast, "
        f"which cannot run {have} weights on {accelerator.device.type}; set dtype to {want} or float32, or "
        "mixed_precision to no (--dtype / --mixed-precision)"
    )


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
    from vlmod.io.hf import load_vlm

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
            if changes["aux_loss"] == "attention":
                try:
                    part.check_attention_router()
                except ValueError as e:
                    raise TrainError(f"aux_loss attention: {e}") from None
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
            groups[group] += getattr(p, "ds_numel", p.numel())  # ZeRO-3 loads its parameters partitioned
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
        # peft_quietly: the FutureWarning every LoRA run printed (`bench train`, finetune); what
        # peft decides from that alias (an input-grad hook) `drop_input_grads` undoes anyway.
        with peft_quietly():
            # The adapters' random init from the run's seed alone, not from whatever drew random
            # numbers before (a DeepSpeed ZeRO-3 load does: its adapters started elsewhere than
            # one process's); the rest of the run's draws as they would be without LoRA.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
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


def load_dataset(path: str, processor: Any, cfg: TrainConfig, max_tokens: int | None = None) -> LlavaDataset:
    """The LLaVA-format set at `path` as `processor`'s model reads it; its errors as `TrainError`.
    `max_tokens`: the model's positions (a longer record is refused before training starts)."""
    try:
        return LlavaDataset(
            path, processor, cfg.image_root, strict=cfg.strict, num_frames=cfg.num_frames, cache=cfg.cache_data,
            max_tokens=max_tokens,
        )
    except DataError as e:
        raise TrainError(str(e)) from None


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over what trains: weight decay on matrices only, the routers at `router_lr`."""
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


def sharded(accelerator: Any) -> bool:
    """Whether parameters or optimizer state are split over processes (FSDP, DeepSpeed, ...)."""
    return accelerator.distributed_type.value in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def estimate_memory(model: nn.Module, dataset: Any, cfg: TrainConfig, dtype: torch.dtype, precision: str) -> Any:
    """`vlmod.training.memory.estimate` of one process's peak, from the first micro-batch of
    `dataset`, the forward in `precision`'s autocast dtype (`dtype` without one)."""
    first = dataset.collate([dataset[i] for i in range(min(cfg.batch_size, len(dataset)))])
    ids = first["input_ids"]
    keep = answer_logits_inputs(model, first).get("logits_to_keep")
    return memory.estimate(
        model, ids.numel(), longest=ids.shape[1], compute_dtype=AUTOCAST_DTYPES.get(precision, dtype),
        gradient_checkpointing=cfg.gradient_checkpointing, logit_rows=None if keep is None else ids.shape[0] * keep.numel(),
    )


def check_memory(model: nn.Module, dataset: Any, cfg: TrainConfig, dtype: torch.dtype, accelerator: Any) -> Any:
    """Estimate the run's peak memory from its first micro-batch and refuse, in one line, a run
    that cannot fit this process's device (`vlmod.training.memory`); sharded runs (FSDP, ZeRO) hold
    less than one process's estimate, so they are not refused."""
    needed = estimate_memory(model, dataset, cfg, dtype, accelerator.mixed_precision)
    if not sharded(accelerator):
        plan = memory.describe_plan(memory.plan(needed, largest_unit_bytes(model)))
        memory.check_fits(needed, accelerator.device, TrainError, plan=plan)
    return needed


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int, accelerator: Any) -> Any:
    """The learning-rate schedule over `total_steps` optimizer steps, prepared: a prepared scheduler
    steps once per process per optimizer step (accelerate's convention), except under DeepSpeed,
    whose engine steps it once per optimizer step (accelerate's `step` is then a no-op: measured,
    a ZeRO-3 run of two processes went through the schedule at half the rate until this)."""
    from accelerate.utils import DistributedType
    from transformers import get_scheduler

    per_step = 1 if accelerator.distributed_type == DistributedType.DEEPSPEED else accelerator.num_processes
    warmup = int(cfg.warmup) if cfg.warmup >= 1 else int(cfg.warmup * total_steps)
    return accelerator.prepare(get_scheduler(
        {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.scheduler],
        optimizer,
        num_warmup_steps=warmup * per_step,
        num_training_steps=total_steps * per_step,
    ))


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (no KV cache while training)."""
    # transformers 5.24 renamed it activation_checkpointing_enable (the old name deprecated).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def drop_input_grads(model: nn.Module) -> None:
    """Undo the hook transformers (and peft, wrapping a checkpointed model) put on the input
    embeddings so they require grad: reentrant checkpointing needs it, the non-reentrant kind used
    here does not, and left on it makes every step's backward cross the frozen vision tower and
    every frozen layer below the lowest trained one (+36% FLOPs in a router-only step)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "_require_grads_hook", None) is not None:
        base.disable_input_require_grads()


# ----------------------------------------------------------------------------- the prepared run


@dataclass
class Run:
    """Everything a run's loop reads, prepared (`prepare`); `model`, `optimizer`, `loader`,
    `scheduler` and `val_loader` are Accelerate's wrappers."""

    cfg: TrainConfig
    accelerator: Any
    model: nn.Module
    processor: Any
    teacher: Any  # vlmod.training.distill.Teacher, or None
    train_size: int
    loader: Any
    val_loader: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    parts: list[Any]  # the MoD parts (vlmod.routing.trace.find_parts)
    groups: dict[str, int]  # trainable parameters per group (set_trainable)
    frozen_dtype: torch.dtype
    compute: Callable[[], AbstractContextManager[Any]]  # the forward's autocast context
    needed: Any  # vlmod.training.memory's estimate of the peak
    total_steps: int
    resume_from: list[Path]  # checkpoints to try, newest first (vlmod.training.checkpoints)
    reducer: nn.Module | None = None  # the model behind a pre-LLM reduction (reduce_keep), or None


def make_reducer(model: nn.Module, cfg: TrainConfig, accelerator: Any) -> nn.Module | None:
    """`model` behind the pre-LLM reduction `cfg` asks for (`vlmod.tools.reduction`), or None.
    The reduction calls the model's own modules, not a distributed wrapper's forward, so it
    trains in one process; a LoRA model is reduced through its base model (adapters included)."""
    if cfg.reduce_keep is None:
        return None
    from vlmod.tools.reduction import PreLLMReduction

    if accelerator.num_processes > 1:
        raise TrainError(f"reduce_keep trains in one process; this launch has {accelerator.num_processes}: "
                         "run it without accelerate launch / torchrun")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        # A list of keeps: the loop sets each step's (`vlmod.training.loop.step_keep`); the first until then.
        keeps = cfg.reduce_keep if isinstance(cfg.reduce_keep, (list, tuple)) else [cfg.reduce_keep]
        scorer = None
        if cfg.reduce_scorer is not None:
            from vlmod.tools.query_keep import load_query_scorer

            scorer = load_query_scorer(cfg.reduce_scorer).to(next(base.parameters()).device)
        return PreLLMReduction(base, keeps[0], cfg.reduce_scoring or "mean", cfg.reduce_contextual, cfg.reduce_pool,
                               cfg.reduce_merge, scorer)
    except ValueError as e:
        raise TrainError(f"reduce_keep: {e}") from None


def prepare(cfg: TrainConfig) -> Run:
    """Check the inputs and the launch, load the model and data, choose what trains, and prepare
    it all with Accelerate; nothing is written yet."""
    from accelerate.utils import set_seed

    for path in (cfg.data, cfg.val_data):
        if path is not None and not Path(path).expanduser().is_file():
            from vlmod.io.paths import not_found

            raise TrainError(f"data file {path} {not_found(path)}")
    check_output_dir_owner(cfg)
    resume_from = resolve_resume(cfg)
    frozen_dtype = weights_dtype(cfg)
    accelerator = make_accelerator(cfg, mixed_precision(cfg, frozen_dtype))
    check_precision(frozen_dtype, accelerator)
    shard_on_cpu(accelerator)
    check_launch(accelerator)
    check_lora_sharding(cfg, accelerator)
    set_seed(cfg.seed)
    model, processor = load_model(cfg, frozen_dtype)
    teacher = None
    if cfg.distill_from is not None:
        teacher = Teacher.load(cfg.distill_from, accelerator.device, TrainError)
    positions = max_positions(model)
    train_set = load_dataset(cfg.data, processor, cfg, positions)
    val_set = load_dataset(cfg.val_data, processor, cfg, positions) if cfg.val_data else None
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.trainable == "lora":
        model = add_lora(model, cfg)
    if cfg.gradient_checkpointing:
        drop_input_grads(model)
    groups = set_trainable(model, cfg.trainable, cfg.train_vision_tower)
    if not groups:
        raise TrainError(f"trainable: {cfg.trainable} leaves no parameter to train in this model")
    parts = find_parts(model)
    needed = check_memory(model, train_set, cfg, frozen_dtype, accelerator)
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
    optimizer = make_optimizer(model, cfg)
    reducer = make_reducer(model, cfg, accelerator)
    set_layer_classes(accelerator, model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # After prepare: `len(loader)` is per process, and DeepSpeed may have set the accumulation.
    # The last partial accumulation of an epoch steps the optimizer too, hence the ceil.
    steps_per_epoch = math.ceil(len(loader) / accelerator.gradient_accumulation_steps)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    scheduler = make_scheduler(cfg, optimizer, total_steps, accelerator)
    if val_loader is not None:
        val_loader = accelerator.prepare(val_loader)
    return Run(
        cfg=cfg, accelerator=accelerator, model=model, processor=processor, teacher=teacher,
        train_size=len(train_set), loader=loader, val_loader=val_loader, optimizer=optimizer, scheduler=scheduler,
        parts=parts, groups=groups, frozen_dtype=frozen_dtype, compute=compute, needed=needed,
        total_steps=total_steps, resume_from=resume_from, reducer=reducer,
    )


__all__ = [
    "AUTOCAST_DTYPES",
    "EpochSampler",
    "Run",
    "add_lora",
    "cast_trainable",
    "check_launch",
    "check_lora_sharding",
    "check_precision",
    "check_memory",
    "enable_gradient_checkpointing",
    "estimate_memory",
    "load_dataset",
    "load_model",
    "make_accelerator",
    "make_optimizer",
    "make_reducer",
    "make_scheduler",
    "mixed_precision",
    "prepare",
    "set_trainable",
    "sharded",
    "weights_dtype",
]
