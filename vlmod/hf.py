"""Hugging Face persistence: a converted model saves with `save_pretrained` (MoD settings in
config.json under `vlmod`, routers in the normal safetensors) and loads with `load_pretrained`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vlmod.config import MoDConfig

_CONFIG_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "subfolder")


def part_configs(settings: dict[str, Any]) -> dict[str, MoDConfig]:
    """{part: MoDConfig} from the `vlmod` entry of a config.json."""
    return {part: MoDConfig.from_dict(d) for part, d in settings.items()}


def model_class(config: Any) -> type:
    """The model class a checkpoint's config names (its `architectures`)."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText._model_mapping[type(config)]
    except KeyError:
        raise TypeError(
            f"cannot tell which model class a {type(config).__name__} checkpoint is (no usable "
            "'architectures' in its config.json)"
        ) from None


def load_config(path: str | Path, **kwargs: Any) -> Any:
    """AutoConfig of a local directory or hub id, with errors that say what to do."""
    from transformers import AutoConfig

    local = Path(path).expanduser()
    if local.exists() and not (local / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    if not local.exists() and (str(path).startswith((".", "/", "~")) or str(path).count("/") > 1):
        raise FileNotFoundError(f"model path {path} does not exist")
    try:
        return AutoConfig.from_pretrained(str(local) if local.exists() else str(path), **kwargs)
    except OSError as err:
        raise FileNotFoundError(
            f"could not load a model config from {path!r}: not a local directory, and the hub "
            f"could not provide it ({str(err).splitlines()[0]})"
        ) from None


def load_pretrained(path: str | Path, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a checkpoint saved by `save_pretrained`, converted again exactly as it was saved.

    A plain (never converted) checkpoint loads as the dense model. The converted architecture is
    built first and transformers' own loading fills it, so key renames of the checkpoint format
    apply to the routers too.
    """
    from vlmod.routing.api import apply_mod

    config_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in _CONFIG_KWARGS}
    config = load_config(path, **config_kwargs)
    cls = model_class(config)
    settings = getattr(config, "vlmod", None)
    if not settings:
        return cls.from_pretrained(path, **from_pretrained_kwargs)
    parts = part_configs(settings)

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        for part, part_config in parts.items():
            apply_mod(self, part_config, part=part)

    converted = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})
    model = converted.from_pretrained(path, **from_pretrained_kwargs)
    model.__class__ = cls
    return model


def llava_class(path: str | Path, error: type[Exception], purpose: str) -> type:
    """The LLaVA model class of checkpoint `path`, reading only its config (so a command can check
    every checkpoint it was given before loading one); `error` with what is wrong otherwise.
    `purpose` completes the message: "{path} is a X checkpoint; {purpose} LLaVA models (...)"."""
    from vlmod.plugins import llava

    try:
        cls = model_class(load_config(path))
    except (FileNotFoundError, TypeError) as e:
        raise error(str(e)) from None
    if not issubclass(cls, llava._classes()):
        raise error(f"{path} is a {cls.__name__} checkpoint; {purpose} LLaVA models ({', '.join(llava.FAMILIES)})")
    return cls


def load_llava(
    path: str | Path, error: type[Exception], purpose: str, converted: bool = True, **from_pretrained_kwargs: Any
) -> tuple[nn.Module, Any]:
    """(model, processor) of a LLaVA checkpoint, with `error` for a checkpoint that is missing, not
    LLaVA, or has no loadable processor. converted: load the MoD layers it was saved with
    (`load_pretrained`); False loads the dense model (routers ignored), as calibration wants."""
    from transformers import AutoProcessor

    cls = llava_class(path, error, purpose)
    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise error(f"could not load the processor of {path}: {str(e).splitlines()[0]}") from None
    if converted:
        return load_pretrained(path, **from_pretrained_kwargs), processor
    return cls.from_pretrained(path, **from_pretrained_kwargs), processor
