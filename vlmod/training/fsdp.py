"""FSDP2 for vlmod's runs: what Accelerate's own FSDP2 preparation shards, on GPUs and on a CPU.

Accelerate shards a model with `fully_shard` one unit per layer class it is told to wrap, plus
the input embeddings, the tail (final norm + LM head) and the root (everything left: a MoD
part's shared router, the projector). vlmod adds two things to it:

- The layer classes come from the model (`layer_classes`): its `_no_split_modules` that it holds,
  and the MoD subclasses (`MoDLlamaDecoderLayer`) the conversion made of them. Accelerate finds a
  class by its exact name, so a model whose every decoder layer is converted has no
  `LlamaDecoderLayer` left and a hard-coded list fails; a config that names a class the model
  lacks is refused in one line naming the ones it has (`set_layer_classes`).
- FSDP2 runs on a CPU over gloo (`shard_on_cpu`): Accelerate 1.15 turns `ACCELERATE_USE_FSDP`
  into FSDP for GPU-like devices only (`AcceleratorState.__init__` checks the device kind, never
  MULTI_CPU), although torch's `fully_shard`, its collectives on gloo and distributed checkpoints
  all run there. `shard_on_cpu` takes the one branch Accelerate skips for MULTI_CPU (the
  distributed type set to FSDP, the plugin read from the same environment, its mixed precision
  set); everything after it (`prepare` -> `fsdp2_prepare_model`, sharded `save_state` /
  `load_state`, `get_state_dict`, `clip_grad_norm_`, `no_sync`) is Accelerate's own, unchanged.
  Calling `fsdp2_prepare_model` alone would shard the model but leave checkpoints, the gathered
  state dict and gradient clipping on their single-process paths, which read DTensor shards as
  whole weights.

And what sharding changes around it: LoRA merged from the gathered state dict rather than from
the model's shards (`vlmod.training.merge.merged_lora_state_dict`), and the plan of what a run needs per GPU under
DDP, FSDP2 and ZeRO-3 (`plan_run`, `vlmod finetune --plan`; the arithmetic in
`vlmod.training.memory.plan`), from the largest unit a process gathers (`largest_unit_bytes`).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from vlmod.errors import TrainError


def _fsdp_asked() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def shard_on_cpu(accelerator: Any) -> bool:
    """Make a CPU launch that asks for FSDP (`ACCELERATE_USE_FSDP=true`, `FSDP_VERSION=2`, with
    `ACCELERATE_USE_CPU=true` over gloo) the FSDP2 run it asked for (see the module doc); whether
    it did. FSDP1 on a CPU is refused: only FSDP2's `fully_shard` runs there."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if not _fsdp_asked() or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables `accelerate launch` sets
    if plugin.fsdp_version != 2:
        raise TrainError(
            f"FSDP version {plugin.fsdp_version} on a CPU: only FSDP2 shards over gloo; set fsdp_version: 2 "
            "(FSDP_VERSION=2)"
        )
    # accelerate/state.py, the branch it takes for MULTI_GPU and its kin, not for MULTI_CPU, and
    # its last line, which every later AcceleratorState() copies the type back from:
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = state.distributed_type
    return True


def _class_names(cls: type) -> set[str]:
    return {c.__name__ for c in cls.__mro__}


def layer_classes(model: nn.Module, wanted: list[str] | None = None) -> list[str]:
    """The names of the classes in `model` to shard one unit each: those of its modules that are,
    or derive from, a class `wanted` names (the model's `_no_split_modules` if None), MoD
    subclasses included. Names `wanted` lists that the model does not hold are left out."""
    if wanted is None:
        wanted = list(getattr(model, "_no_split_modules", None) or [])
    found: dict[str, None] = {}
    for module in model.modules():
        cls = type(module)
        if _class_names(cls) & set(wanted) and not getattr(cls, "__module__", "").startswith("torch.distributed"):
            found[cls.__name__] = None
    return list(found)


def set_layer_classes(accelerator: Any, model: nn.Module) -> list[str]:
    """Give the FSDP plugin the model's layer classes (`layer_classes`) before `prepare` shards it;
    the classes it will wrap. A config naming a class the model lacks is one error line."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or accelerator.distributed_type.value != "FSDP":
        return []
    named = plugin.transformer_cls_names_to_wrap
    ours = layer_classes(model)
    if named:
        missing = [n for n in named if not layer_classes(model, [n])]
        if missing:
            raise TrainError(
                f"the accelerate config wraps {', '.join(missing)}, which this {type(model).__name__} does not "
                f"hold; its layer classes are {', '.join(ours) or 'none'}: name those in "
                "fsdp_transformer_layer_cls_to_wrap, or leave it out (vlmod then wraps the model's own)"
            )
        ours = layer_classes(model, list(named))
    plugin.transformer_cls_names_to_wrap = ours
    return ours


def largest_unit_bytes(model: nn.Module) -> int:
    """The whole weights of the largest layer FSDP2 shards as one unit (`layer_classes`), what a
    process gathers at a time; trainable ones counted as the float32 master weights they become."""
    classes = set(layer_classes(model))
    sizes = [
        sum(p.numel() * (4 if p.requires_grad else p.element_size()) for p in m.parameters())
        for m in model.modules() if type(m).__name__ in classes
    ]
    return max(sizes, default=0)


def plan_run(cfg: Any) -> str:
    """What the run `cfg` (a TrainConfig) needs per GPU on 1, 2, 4 and 8 GPUs under DDP, FSDP2 and
    ZeRO-3, with and without CPU offload (`vlmod.training.memory.plan`), from the estimate the
    one-process refusal uses: the model loaded and converted as the run would, what trains
    chosen, the first micro-batch read; nothing trains and nothing is written."""
    from vlmod.io.hf import max_positions
    from vlmod.training import memory, setup

    frozen = setup.weights_dtype(cfg)
    model, processor = setup.load_model(cfg, frozen)
    data = setup.load_dataset(cfg.data, processor, cfg, max_positions(model))
    if cfg.trainable == "lora":
        model = setup.add_lora(model, cfg)
    setup.set_trainable(model, cfg.trainable, cfg.train_vision_tower)
    needed = setup.estimate_memory(model, data, cfg, frozen, setup.mixed_precision(cfg, frozen))
    table = memory.plan(needed, largest_unit_bytes(model))
    counts = next(iter(table.values())).keys()
    lines = [
        f"one process: {needed.describe()}",
        f"GiB per GPU (batch_size {cfg.batch_size} a process){'':<3}" + "".join(f"{n:>7} GPU{'s' if n > 1 else ' '}" for n in counts),
    ]
    lines += [f"{engine:<40}" + "".join(f"{b / memory.GIB:>12.1f}" for b in row.values()) for engine, row in table.items()]
    return "\n".join(lines)


__all__ = ["largest_unit_bytes", "layer_classes", "plan_run", "set_layer_classes", "shard_on_cpu"]
