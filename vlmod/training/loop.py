"""The training loop of a prepared run (`vlmod.training.setup.Run`): where it resumes, one optimizer
step after another (gradient accumulation, the capacity of each step, distillation), and what it
logs, validates and checkpoints on the way.

The loss of a multi-process run is the global per-token mean over answer tokens, whatever the
answer lengths on each process (`answer_token_share`); MoD runs also log their skip rate (the
share of routable tokens the MoD layers skipped).

What a step costs is recorded without adding a host sync: each optimizer step's wall time on the
host clock (data loading included; logging, validation and checkpoints left out) and the trained
tokens (attention-mask ones) summed on the device and read once, at the end. On an accelerator the
host runs ahead of the device, so a single step's time is when its work was queued; once the
queue is full the host waits on the device and the median step is the device's.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vlmod import api  # api.set_capacity looked up per call, so a wrapped one is seen
from vlmod.data.answers import answer_mask
from vlmod.errors import TrainError
from vlmod.evaluation.evaluate import answer_losses, routable_counts
from vlmod.routing.trace import trace_routing
from vlmod.training.checkpoints import DamagedCheckpoint, checkpoint_dir, load_checkpoint, save_checkpoint
from vlmod.training.config import TrainConfig
from vlmod.training.logits import answer_logits_inputs
from vlmod.training.setup import Run

# ----------------------------------------------------------------------------- per step


def routed_counts(trace: Any, parts: Sequence[Any]) -> Tensor:
    """[routable tokens processed, routable tokens] over every MoD layer of a traced forward,
    on the device: summed over steps and read at log time only."""
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


def takes_loss_kwargs(model: nn.Module) -> bool:
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
def validation_loss(model: nn.Module, loader: Any, accelerator: Any, compute: Any = nullcontext,
                    forward: Any = None) -> float:
    """Mean answer loss over `loader` (all processes): per-sample mean NLL of the answer tokens,
    as `vlmod eval` reports it (no router aux term). `compute`: the forward's autocast context;
    `forward`: what runs a batch (the model behind a reduction), `model` if None."""
    forward = forward or model
    model.eval()
    total = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device)
    for batch in loader:
        with compute():
            logits = forward(**batch).logits
        losses = answer_losses(logits, batch["labels"])
        total += losses.sum()
        count += losses.numel()
    model.train()
    total, count = accelerator.reduce(total), accelerator.reduce(count)
    return float(total / count.clamp_min(1))


def _drawn_point(cfg: TrainConfig, step: int) -> int:
    """The index into `cfg.capacities` (and a list `cfg.reduce_keep`) that optimizer step `step`
    trains at: seeded by step, so a resumed run draws the same."""
    assert cfg.capacities
    return random.Random(cfg.seed * 1_000_003 + step).randrange(len(cfg.capacities))


def step_keep(cfg: TrainConfig, step: int) -> float | None:
    """The pre-LLM reduction's kept fraction for step `step`: the keep paired with the step's
    capacity draw where `cfg.reduce_keep` is a list, the one keep otherwise; None: no reduction."""
    if isinstance(cfg.reduce_keep, (list, tuple)):
        return float(cfg.reduce_keep[_drawn_point(cfg, step)])
    return cfg.reduce_keep


def step_capacities(cfg: TrainConfig, converted: dict[str, float], step: int, total_steps: int) -> dict[str, float]:
    """Each MoD part's mean capacity for optimizer step `step` (empty: leave them as they are): the
    step's draw from `cfg.capacities` (`_drawn_point`), raised toward 1.0 during `cfg.capacity_warmup`."""
    if cfg.capacities:
        draw = cfg.capacities[_drawn_point(cfg, step)]
        targets = dict.fromkeys(converted, draw)
    elif cfg.capacity_warmup:
        targets = dict(converted)
    else:
        return {}
    warmup = cfg.capacity_warmup if cfg.capacity_warmup >= 1 else cfg.capacity_warmup * total_steps
    left = max(0.0, 1.0 - step / warmup) if warmup else 0.0  # share of the warm-up still to go
    return {name: c + (1.0 - c) * left for name, c in targets.items()}


# ----------------------------------------------------------------------------- the loop


@dataclass
class Position:
    """Where the loop stands: optimizer steps done, the epoch, micro-batches done in that epoch."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    history: list[dict[str, float]] = field(default_factory=list)  # what the run logged before it


@dataclass
class Steps:
    """What the loop did: the last step, the logged history (a resumed run's from its first step),
    the last log and validation loss, and what the steps this process ran cost: each one's wall
    seconds, the samples and tokens they trained and the positions the LM head ran on (all
    processes)."""

    step: int
    history: list[dict[str, float]] = field(default_factory=list)
    last: dict[str, float] = field(default_factory=dict)
    val_loss: float | None = None
    step_seconds: list[float] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    logit_rows: int = 0


def _saved_history(state: dict[str, Any], accelerator: Any) -> list[dict[str, float]]:
    """The loss history a checkpoint saved (none in a checkpoint from before it was saved)."""
    history = state.get("history", [])
    if isinstance(history, list) and all(isinstance(h, dict) and isinstance(h.get("step"), int) for h in history):
        return history
    accelerator.print("warning: the checkpoint's loss history is unreadable; train_log.json starts at the resumed step")
    return []


def resume_position(run: Run) -> Position:
    """The position of the run's newest intact checkpoint (its state loaded), or the start. With
    `resume: latest` a damaged checkpoint gives way to the next older one; a named one must load."""
    cfg, accelerator = run.cfg, run.accelerator
    damaged: list[str] = []
    for checkpoint in run.resume_from:
        try:
            state = load_checkpoint(accelerator, checkpoint)
        except DamagedCheckpoint as e:
            if cfg.resume != "latest":
                raise TrainError(f"resume: {e}; resume from another checkpoint, or start over with --overwrite") from None
            damaged.append(str(e))
            accelerator.print(f"warning: {e}; trying the next older checkpoint")
            continue
        position = Position(state["step"], state["epoch"], state["batch_in_epoch"], _saved_history(state, accelerator))
        newest = " (the newest intact checkpoint)" if damaged else ""
        accelerator.print(
            f"resumed from {checkpoint}{newest}: step {position.step}, epoch {position.epoch}, "
            f"batch {position.batch_in_epoch}"
        )
        return position
    if run.resume_from:
        raise TrainError(
            f"resume: latest, but no checkpoint in {checkpoint_dir(cfg.output_dir)} is intact ({'; '.join(damaged)}); "
            "start over with --overwrite"
        )
    return Position()


class _Tally:
    """Loss and routing summed on the device between two logs (read only at log time), and the
    trained tokens over the whole run (read at its end)."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.routed = torch.zeros(2, dtype=torch.long, device=device)
        self.micro = 0
        self.tokens = torch.zeros((), dtype=torch.long, device=device)
        self.samples = 0
        self.logit_rows = 0  # positions the LM head ran on, summed over rows (what its FLOPs count)

    def reset(self) -> None:
        self.loss.zero_()
        self.routed.zero_()
        self.micro = 0


def _micro_step(run: Run, batch: dict[str, Any], per_token: bool, tally: _Tally) -> Tensor:
    """Forward and backward of one micro-batch (the optimizer steps when accumulation is done)."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    with accelerator.accumulate(model):
        token_share = answer_token_share(batch, accelerator) if per_token else None
        # No KV cache: a training forward never decodes, and building one costs a copy per layer.
        extra = {"use_cache": False} if token_share is None else {"use_cache": False, "num_items_in_batch": token_share}
        # Logits only where the loss reads them; behind a reduction the model sees a shorter
        # sequence, and the reduction hands back every position's logits (zeros where it dropped).
        answers = answer_logits_inputs(model, batch) if run.reducer is None else {}
        extra.update(answers)
        forward = model if run.reducer is None else run.reducer
        if run.parts:
            with trace_routing(model) as trace, run.compute():
                out = forward(**batch, **extra)
            tally.routed += routed_counts(trace, run.parts).to(tally.routed.device)
        else:
            with run.compute():
                out = forward(**batch, **extra)
        loss = out.loss
        if run.teacher is not None:
            loss = loss + cfg.distill_weight * run.teacher.loss(out.logits, batch, answers, token_share)
        length = out.logits.shape[1] if run.reducer is None else run.reducer.last_length
        tally.logit_rows += out.logits.shape[0] * length
        accelerator.backward(loss)
        if accelerator.sync_gradients and cfg.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
    return loss


def _log(run: Run, step: int, tally: _Tally) -> dict[str, float]:
    """The mean loss since the last log (all processes), the learning rate and the skip rate."""
    accelerator = run.accelerator
    mean_loss = float(accelerator.reduce(tally.loss, reduction="mean")) / tally.micro
    if not math.isfinite(mean_loss):
        raise TrainError(f"the loss became {mean_loss} by step {step}: lower lr, or use mixed_precision: no")
    last = {"step": step, "loss": mean_loss, "lr": run.scheduler.get_last_lr()[0]}
    done, total = accelerator.reduce(tally.routed, reduction="sum").tolist()
    if total:
        last["skip_rate"] = 1.0 - done / total
    if run.cfg.report_to:
        accelerator.log({f"train/{k}": v for k, v in last.items() if k != "step"}, step=step)
    tally.reset()
    return last


def run_steps(run: Run, position: Position, progress: bool = True) -> Steps:
    """Train from `position` to the run's last step; each part's converted capacity is restored
    afterwards when steps ran at other capacities."""
    from tqdm.auto import tqdm

    cfg, accelerator, model, total_steps = run.cfg, run.accelerator, run.model, run.total_steps
    step, epoch, batch_in_epoch = position.step, position.epoch, position.batch_in_epoch
    bar = tqdm(total=total_steps, initial=step, desc="finetune", unit="step",
               disable=not (progress and accelerator.is_local_main_process))
    done = Steps(step=step, history=list(position.history))
    tally = _Tally(accelerator.device)
    converted = {p.name: p.config.capacity for p in run.parts}
    if (cfg.capacities or cfg.capacity_warmup) and not run.parts:
        key = "capacities" if cfg.capacities else "capacity_warmup"
        raise TrainError(f"{key}: the model has no MoD layers; convert it (or give mod:) first")
    model.train()
    per_token = accelerator.num_processes > 1 and takes_loss_kwargs(accelerator.unwrap_model(model))
    started = time.perf_counter()
    while step < total_steps:
        run.loader.set_epoch(epoch)  # the prepared loader passes its epoch on to the sampler (and a skip-loader)
        epoch_loader = accelerator.skip_first_batches(run.loader, batch_in_epoch) if batch_in_epoch else run.loader
        for batch in epoch_loader:
            for name, capacity in step_capacities(cfg, converted, step, total_steps).items():
                api.set_capacity(accelerator.unwrap_model(model), capacity, part=name)
            if run.reducer is not None:
                run.reducer.keep = step_keep(cfg, step)
            loss = _micro_step(run, batch, per_token, tally)
            batch_in_epoch += 1
            tally.loss += loss.detach().float()
            tally.micro += 1
            mask = batch.get("attention_mask")
            tally.tokens += mask.sum() if mask is not None else batch["input_ids"].numel()
            tally.samples += batch["input_ids"].shape[0]
            if not accelerator.sync_gradients:
                continue
            step += 1
            done.step_seconds.append(time.perf_counter() - started)
            bar.update(1)
            if step % max(cfg.log_steps, 1) == 0 or step == total_steps:
                done.last = _log(run, step, tally)
                done.history.append(done.last)
                bar.set_postfix({k: f"{v:.3g}" for k, v in done.last.items() if k != "step"})
            if run.val_loader is not None and cfg.eval_steps and (step % cfg.eval_steps == 0 or step == total_steps):
                done.val_loss = validation_loss(model, run.val_loader, accelerator, run.compute, run.reducer)
                done.history.append({"step": step, "val_loss": done.val_loss})
                bar.write(f"step {step}: validation loss {done.val_loss:.4f}")
                if cfg.report_to:
                    accelerator.log({"val/loss": done.val_loss}, step=step)
            if cfg.save_steps and step % cfg.save_steps == 0 and step < total_steps:
                save_checkpoint(accelerator, cfg, {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                                                   "history": done.history})
            if step >= total_steps:
                break
            started = time.perf_counter()
        else:
            epoch += 1
            batch_in_epoch = 0
    bar.close()
    for name, capacity in converted.items() if cfg.capacities or cfg.capacity_warmup else ():
        api.set_capacity(accelerator.unwrap_model(model), capacity, part=name)
    done.step = step
    done.tokens = int(accelerator.reduce(tally.tokens, reduction="sum"))
    done.samples = int(accelerator.reduce(torch.tensor(tally.samples, device=accelerator.device), reduction="sum"))
    done.logit_rows = int(accelerator.reduce(torch.tensor(tally.logit_rows, device=accelerator.device), reduction="sum"))
    return done


__all__ = [
    "Position",
    "Steps",
    "answer_token_share",
    "resume_position",
    "routed_counts",
    "run_steps",
    "step_capacities",
    "step_keep",
    "takes_loss_kwargs",
    "validation_loss",
]
