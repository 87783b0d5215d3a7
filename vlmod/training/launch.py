"""The run's Accelerator and the checks that it is the launch asked for: the number of processes,
the engine a config names (FSDP, DeepSpeed) actually set up, LoRA only where its adapters can be
merged, and DeepSpeed's processes joined over gloo on a machine without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from vlmod.errors import TrainError
from vlmod.training.config import TrainConfig


def make_accelerator(cfg: TrainConfig, precision: str) -> Any:
    """The run's Accelerator: its gradient accumulation, mixed precision, trackers and log folder."""
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
        kwargs_handlers=_deepspeed_on_cpu(),
    )


def _deepspeed_on_cpu() -> list[Any]:
    """A DeepSpeed launch of several processes on a machine without a GPU: gloo, named. Accelerate
    picks a backend only for GPU-like devices (or MULTI_CPU, where it drops DeepSpeed), so without
    one it runs each process alone; named, it lets DeepSpeed join the processes over gloo (its CPU
    accelerator's backend) and counts them."""
    from accelerate.utils import InitProcessGroupKwargs

    several = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    cpu = os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true"
    if several and deepspeed and not cpu and not torch.cuda.is_available():
        return [InitProcessGroupKwargs(backend="gloo")]
    return []


def check_launch(accelerator: Any) -> None:
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
    # An engine the config asks for (the variable `accelerate launch` sets) that accelerate did not
    # set up: accelerate/state.py makes FSDP only of GPU-like multi-device types, never MULTI_CPU
    # (and `accelerate launch --cpu` runs FSDP configs as one plain process); with
    # ACCELERATE_USE_CPU=true it drops a DeepSpeed config and runs DDP over gloo. Either way the
    # sharded run asked for would silently be an unsharded one.
    for variable, engine, why in (
        ("ACCELERATE_USE_FSDP", DistributedType.FSDP,
         ": it sets FSDP up on GPUs (and other accelerators) only, not on CPU, where vlmod runs FSDP2 over gloo in "
         "several processes (ACCELERATE_USE_CPU=true FSDP_VERSION=2 torchrun --nproc_per_node 2 scripts/finetune.py ...)"),
        ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED,
         ", without DeepSpeed (it does not run DeepSpeed with ACCELERATE_USE_CPU=true); on a CPU launch it without "
         "ACCELERATE_USE_CPU (or --cpu): vlmod then runs DeepSpeed over gloo (docs/finetune.md)"),
    ):
        if os.environ.get(variable, "false").lower() == "true" and kind != engine:
            name = "FSDP" if engine == DistributedType.FSDP else "DeepSpeed"
            raise TrainError(
                f"the accelerate config asks for {name}, but accelerate {accelerate.__version__} runs this launch as "
                f"{kind.value} with {accelerator.num_processes} process(es){why}"
            )


def check_lora_sharding(cfg: TrainConfig, accelerator: Any) -> None:
    """LoRA is merged into the weights at save time, which needs whole parameters: FSDP2 and ZeRO-3
    merge them from the gathered state dict (`vlmod.training.merge.merged_lora_state_dict`); refuse
    FSDP version 1, whose flat parameters vlmod does not gather, instead of saving a broken model."""
    from accelerate.utils import DistributedType

    if cfg.trainable != "lora":
        return
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise TrainError(
            "trainable: lora with FSDP version 1 shards the weights the adapters are merged into; use "
            "configs/accelerate/fsdp.yaml (FSDP2), zero3.yaml, multi_gpu.yaml or zero2.yaml for LoRA"
        )


__all__ = ["check_launch", "check_lora_sharding", "make_accelerator"]
