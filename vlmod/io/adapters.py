"""A LoRA fine-tune saved as adapters (`output_dir/adapter`, next to the merged `output_dir/model`):
a few MB a run instead of a whole model, kept the way peft keeps adapters, plus what peft cannot
carry.

- `adapter_config.json`, `adapter_model.safetensors`: peft's own files (`PeftModel.from_pretrained`
  reads them), the LoRA matrices only.
- `trained.safetensors`: the other parameters a LoRA run trains (the MoD routers, the projector),
  under the base model's names.
- `vlmod_adapter.json` (`RECORD`): the base checkpoint the run started from and the MoD conversion
  it trained (a fine-tune may convert a dense checkpoint with `mod:`), so the adapters are put on
  the model they were trained on.

`vlmod.load_pretrained(output_dir/adapter)` rebuilds the merged model from these and the base:
the sums are peft's own merge, in the saved dtype, so it is bit for bit `output_dir/model`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

RECORD = "vlmod_adapter.json"
TRAINED = "trained.safetensors"


@contextmanager
def peft_quietly() -> Iterator[None]:
    """Around a call into peft: without the FutureWarning it prints on every wrap, save and load
    (it reads `is_gradient_checkpointing`, an alias transformers 5.24 deprecated); only that one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a folder of adapters a vlmod fine-tune saved."""
    return (Path(path).expanduser() / RECORD).is_file()


def load_adapter(path: str | Path, base: str | Path | None = None, **from_pretrained_kwargs: Any) -> nn.Module:
    """The merged model of the adapters at `path`, put on `base` (default: the checkpoint the run
    started from, as recorded), converted as the run converted it."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from vlmod.api import apply_mod
    from vlmod.io.hf import CheckpointError, load_pretrained, part_configs

    path = Path(path).expanduser()
    try:
        record = json.loads((path / RECORD).read_text(encoding="utf-8"))
        base = base or record["base"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{path / RECORD} cannot be read ({str(e).splitlines()[0][:120]}); use the merged model in "
            "the run's model/ folder instead"
        ) from None
    model = load_pretrained(base, **from_pretrained_kwargs)
    have = getattr(model.config, "vlmod", None) or {}
    for part, config in part_configs(record.get("vlmod") or {}, str(path / RECORD)).items():
        if part not in have:
            apply_mod(model, config, part=part)
        elif have[part] != record["vlmod"][part]:
            raise CheckpointError(
                f"{base} is converted ({part}: {have[part]}) unlike the model these adapters trained "
                f"({record['vlmod'][part]}); load them on the checkpoint the run started from ({record['base']})"
            )
    trained = load_file(str(path / TRAINED)) if (path / TRAINED).is_file() else {}
    unknown = sorted(set(trained) - set(model.state_dict()))
    if unknown:
        raise CheckpointError(
            f"{path / TRAINED} holds {unknown[0]}, which {base} lacks: these adapters were trained on another model"
        )
    model.load_state_dict(trained, strict=False)
    with peft_quietly():
        return PeftModel.from_pretrained(model, str(path)).merge_and_unload()


__all__ = ["RECORD", "TRAINED", "is_adapter", "load_adapter", "peft_quietly"]
