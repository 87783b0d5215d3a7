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

A run goes through stages: `prepare` (`vlmod.training.setup`: the launch, model, data, optimizer),
`resume_position` and `run_steps` (`vlmod.training.loop`), `start_output` and `finish` here.
Checkpoints, resuming and the run's ownership of its output folder: `vlmod.training.checkpoints`.
The final model is written with `save_pretrained` (and its processor) to `output_dir/model`:
`vlmod.load_pretrained` and `vlmod eval` load it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmod.errors import TrainError
from vlmod.io.files import write_json
from vlmod.training.checkpoints import RUN_FILE, clear_output_dir, latest_checkpoint, run_settings, save_model
from vlmod.training.config import TRAINABLE, TrainConfig
from vlmod.training.loop import Steps, resume_position, run_steps
from vlmod.training.setup import EpochSampler, Run, cast_trainable, prepare, set_trainable, sharded
from vlmod.training.stability import describe_spikes, loss_spikes, warmup_steps


@dataclass
class TrainResult:
    """What a run did: optimizer steps, the last logged losses, where the model went, and what
    its steps cost (`cost`, also in train_log.json). `start_step`: the checkpoint's step it resumed
    from (0 for a fresh run), so `step - start_step` steps ran in this process."""

    step: int
    loss: float | None
    val_loss: float | None
    routed_fraction: float | None
    model_dir: Path
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    main_process: bool = True
    cost: dict[str, Any] = field(default_factory=dict)
    start_step: int = 0


def step_cost(steps: Steps) -> dict[str, Any]:
    """What the steps this process ran cost: their count, each one's wall seconds and the median,
    the samples and tokens they trained and the positions the LM head ran on (all processes), and
    tokens a second over those steps."""
    seconds = steps.step_seconds
    total = sum(seconds)
    return {
        "steps_timed": len(seconds),
        "step_seconds_median": statistics.median(seconds) if seconds else None,
        "samples": steps.samples,
        "tokens": steps.tokens,
        "logit_rows": steps.logit_rows,
        "tokens_per_second": steps.tokens / total if total > 0 else None,
        "step_seconds": [round(t, 6) for t in seconds],
    }


def train(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """Run `cfg` (see the module doc) and return what it did: prepare the run, find where it
    resumes, take its output folder, train, save."""
    start = time.perf_counter()
    run = prepare(cfg)
    position = resume_position(run)
    start_output(run)
    with _sharing_tower(run):
        steps = run_steps(run, position, progress)
    cost = step_cost(steps)
    model_dir = finish(run, steps, cost)
    spikes = loss_spikes(steps.history, warmup_steps(cfg, steps.step))
    if spikes:
        run.accelerator.print(describe_spikes(spikes, f"fine-tune {cfg.output_dir}"))
    last = steps.last
    return TrainResult(
        step=steps.step,
        loss=last.get("loss"),
        val_loss=steps.val_loss,
        routed_fraction=None if "skip_rate" not in last else 1.0 - last["skip_rate"],
        model_dir=model_dir,
        seconds=time.perf_counter() - start,
        history=steps.history,
        main_process=run.accelerator.is_main_process,
        cost=cost,
        start_step=position.step,
    )


def _sharing_tower(run: Run) -> contextlib.AbstractContextManager:
    """The teacher's tower output from the student's where the two are the same frozen tower
    (`Teacher.sharing_tower`); not where the weights are sharded across processes."""
    if run.teacher is None or sharded(run.accelerator):
        return contextlib.nullcontext()
    return run.teacher.sharing_tower(run.accelerator.unwrap_model(run.model))


def start_output(run: Run) -> None:
    """Take the output folder (cleared with `overwrite`; the run's settings written, which a resume
    checks), start the trackers, and say what trains in which dtype."""
    cfg, accelerator, frozen = run.cfg, run.accelerator, run.frozen_dtype
    if accelerator.is_main_process:
        if cfg.overwrite:
            clear_output_dir(Path(cfg.output_dir))
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(cfg.output_dir) / RUN_FILE, {"settings": run_settings(cfg)})
    if cfg.report_to:
        accelerator.init_trackers("vlmod-finetune", config={k: str(v) for k, v in cfg.to_dict().items()})
    accelerator.print(
        f"weights: frozen in {str(frozen).removeprefix('torch.')}, trainable in float32 (master weights), "
        f"forward {'in float32' if frozen == torch.float32 and cfg.mixed_precision == 'no' else 'under autocast'}; "
        f"estimated peak {run.needed.describe()}"
    )
    batch = cfg.batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes
    accelerator.print(
        f"training {', '.join(f'{k} {v:,}' for k, v in run.groups.items())} parameters; "
        f"{run.train_size} samples, {run.total_steps} steps of {batch}"
    )


def finish(run: Run, steps: Steps, cost: dict[str, Any]) -> Path:
    """Save the model in the checkpoint's dtype (and its processor) to `output_dir/model`, and the
    log (the whole loss history, a resumed run's too, and the steps' `cost`) to `train_log.json`;
    where the model went."""
    cfg, accelerator = run.cfg, run.accelerator
    if not sharded(accelerator):
        cast_trainable(accelerator.unwrap_model(run.model), run.frozen_dtype)  # saved in the checkpoint's dtype
    cast = run.frozen_dtype if sharded(accelerator) else None  # shards: the gathered copy is cast instead
    out_dir = save_model(accelerator, run.model, run.processor, Path(cfg.output_dir) / "model", dtype=cast)
    if accelerator.is_main_process:
        write_json(Path(cfg.output_dir) / "train_log.json", {"config": cfg.to_dict(), "history": steps.history,
                                                                   "cost": cost})
    if cfg.report_to:
        accelerator.end_training()
    return out_dir


__all__ = [
    "TRAINABLE",
    "EpochSampler",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "latest_checkpoint",
    "set_trainable",
    "step_cost",
    "train",
]
