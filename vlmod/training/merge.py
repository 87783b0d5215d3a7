"""LoRA merged into the weights for saving, without a second copy of them in memory.

peft's `merge_and_unload` adds each adapter into its projection, and the merged projection is new
memory: at the save every LoRA-targeted weight exists twice, the checkpoint's mapped pages and an
anonymous merged copy (all seven projections of a 7B's 32 layers: 13 GB). Here each group of
merged projections (about `GROUP_BYTES`) is written to a scratch safetensors file and mapped back
before the next group is merged, so the merged weights are file pages like the frozen ones, and
memory holds one group at a time. The sums are peft's own (`get_delta_weight` added in place into
a copy of the weight, in the weight's dtype), so the saved model is bit for bit what
`merge_and_unload` gives. Under FSDP2 and ZeRO-3 the model's parameters are shards: the same sums
run on the gathered state dict instead (`merged_lora_state_dict`). And the adapters are saved as
adapters too (`save_adapter`, read back by `vlmod.io.adapters`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from vlmod.errors import TrainError
from vlmod.io.adapters import RECORD, TRAINED, peft_quietly
from vlmod.io.files import folder_written, write_json
from vlmod.training.memory import release_memory

GROUP_BYTES = 256 * 1024**2
PEFT_PREFIX = "base_model.model."  # what a peft model's state dict puts before the base model's keys


def _state_name(name: str) -> str:
    """A module or parameter name as the state dict says it (FSDP's activation checkpointing wraps
    each layer in a `_checkpoint_wrapped_module` the state dict does not show)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _mergeable(module: Any) -> bool:
    """A peft LoRA linear layer, not merged yet, whose merge is a plain weight update (no DoRA
    magnitude to rescale by)."""
    from peft.tuners.lora import Linear

    return (
        isinstance(module, Linear) and not module.merged
        and not any(module.use_dora.get(a, False) for a in module.active_adapters)
    )


def merge_lora_mapped(model: nn.Module, scratch: str | Path, group_bytes: int = GROUP_BYTES) -> nn.Module:
    """`model.merge_and_unload()` of a peft model, with the merged projections mapped from files
    under `scratch` (the caller removes the folder once the model is saved: a mapping outlives its
    file). A model with an adapter kind this does not know is merged by peft itself."""
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open
    from safetensors.torch import save_file

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    if not all(_mergeable(m) for _, m in layers):
        return model.merge_and_unload()
    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    group: dict[str, tuple[Any, torch.Tensor]] = {}
    size = files = 0

    def flush() -> None:
        nonlocal size, files
        if not group:
            return
        path = scratch / f"merged-{files:05d}.safetensors"
        save_file({name: weight for name, (_, weight) in group.items()}, str(path))
        with safe_open(str(path), framework="pt") as mapped:
            for name, (module, _) in group.items():
                module.get_base_layer().weight.data = mapped.get_tensor(name)
        group.clear()
        release_memory()  # glibc keeps freed blocks of this size in its heap unless asked
        size, files = 0, files + 1

    with torch.no_grad():
        for name, module in layers:
            merged = module.get_base_layer().weight.detach().clone()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    merged += module.get_delta_weight(adapter)
            group[name] = (module, merged)
            size += merged.numel() * merged.element_size()
            if size >= group_bytes:
                flush()
        flush()
    return model.unload()


def merged_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with each LoRA adapter merged into its projection, from the
    peft `model`'s gathered full state dict `state` (FSDP2: the parameters in `model` are shards,
    which `merge_lora_mapped` cannot merge). The delta is peft's own `get_delta_weight`, run on
    the gathered adapter weights, added into a copy of the weight in its dtype as peft's merge
    does: the saved model is what one process saves."""
    from peft.tuners.lora import LoraLayer

    merged = dict(state)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if not hasattr(module, "fan_in_fan_out") or any(module.use_dora.get(a, False) for a in module.lora_A):
                raise TrainError(f"LoRA under FSDP merges linear adapters only; {name} is {type(module).__name__}")
            name = _state_name(name)  # as the state dict's keys say it
            weight = merged[f"{name}.base_layer.weight"].clone()
            for adapter in module.active_adapters:
                if adapter not in module.lora_A:
                    continue
                gathered = SimpleNamespace(  # the module's settings, the gathered weights
                    lora_A={adapter: SimpleNamespace(weight=merged.pop(f"{name}.lora_A.{adapter}.weight"))},
                    lora_B={adapter: SimpleNamespace(weight=merged.pop(f"{name}.lora_B.{adapter}.weight"))},
                    fan_in_fan_out=module.fan_in_fan_out, scaling=module.scaling,
                )
                weight += type(module).get_delta_weight(gathered, adapter)
            merged[f"{name}.base_layer.weight"] = weight
    out = {}
    for key, value in merged.items():
        if ".lora_" in key:
            continue  # an inactive adapter
        out[key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = value
    return out


def save_adapter(model: nn.Module, state_dict: dict[str, torch.Tensor], out: Path) -> Path:
    """The run's adapters as a folder `vlmod.load_pretrained` reads (`vlmod.io.adapters`): peft's
    adapter files, the other trained parameters, the base and conversion they belong to. `model`:
    the peft model; `state_dict`: its full state dict as the merged model is saved from (gathered
    under FSDP2 / ZeRO-3, in the saved dtype), read before any merge. Written to `out.tmp`, then
    renamed."""
    from safetensors.torch import save_file

    trained = {_state_name(n) for n, p in model.named_parameters() if p.requires_grad}
    others = {
        k.removeprefix(PEFT_PREFIX): v.contiguous() for k, v in state_dict.items() if k in trained and ".lora_" not in k
    }
    base = model.get_base_model()
    name = str(getattr(base, "name_or_path", "") or base.config._name_or_path)
    local = Path(name).expanduser()
    record = {"base": str(local.resolve()) if local.is_dir() else name,  # a folder from anywhere; a hub id as it is
              "vlmod": getattr(base.config, "vlmod", None), "trained": sorted(others)}
    with folder_written(out) as tmp:
        with peft_quietly():
            model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
        save_file(others, str(tmp / TRAINED))
        write_json(tmp / RECORD, record)
    return out


__all__ = ["GROUP_BYTES", "PEFT_PREFIX", "merge_lora_mapped", "merged_lora_state_dict", "save_adapter"]
