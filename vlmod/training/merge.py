"""LoRA merged into the weights for saving, without a second copy of them in memory.

peft's `merge_and_unload` adds each adapter into its projection, and the merged projection is new
memory: at the save every LoRA-targeted weight exists twice, the checkpoint's mapped pages and an
anonymous merged copy (all seven projections of a 7B's 32 layers: 13 GB). Here each group of
merged projections (about `GROUP_BYTES`) is written to a scratch safetensors file and mapped back
before the next group is merged, so the merged weights are file pages like the frozen ones, and
memory holds one group at a time. The sums are peft's own (`get_delta_weight` added in place into
a copy of the weight, in the weight's dtype), so the saved model is bit for bit what
`merge_and_unload` gives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmod.io.adapters import RECORD, TRAINED, peft_quietly
from vlmod.training.memory import release_memory

GROUP_BYTES = 256 * 1024**2


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


def save_adapter(model: nn.Module, state_dict: dict[str, torch.Tensor], out: Path) -> Path:
    """The run's adapters as a folder `vlmod.load_pretrained` reads (`vlmod.io.adapters`): peft's
    adapter files, the other trained parameters, the base and conversion they belong to. `model`:
    the peft model; `state_dict`: its full state dict as the merged model is saved from (gathered
    under FSDP2 / ZeRO-3, in the saved dtype), read before any merge. Written to `out.tmp`, then
    renamed."""
    from safetensors.torch import save_file

    prefix = "base_model.model."
    trained = {n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters() if p.requires_grad}
    others = {
        k.removeprefix(prefix): v.contiguous() for k, v in state_dict.items() if k in trained and ".lora_" not in k
    }
    base = model.get_base_model()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with peft_quietly():
            model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
        save_file(others, str(tmp / TRAINED))
        name = str(getattr(base, "name_or_path", "") or base.config._name_or_path)
        local = Path(name).expanduser()
        record = {"base": str(local.resolve()) if local.is_dir() else name,  # a folder from anywhere; a hub id as it is
                  "vlmod": getattr(base.config, "vlmod", None), "trained": sorted(others)}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


__all__ = ["GROUP_BYTES", "merge_lora_mapped", "save_adapter"]
