"""Hugging Face persistence: a converted model saves with `save_pretrained` (MoD settings in
config.json under `vlmod`, routers in the normal safetensors) and loads with `load_pretrained`.

Every command loads checkpoints through here, so a checkpoint that cannot be used as it is gives
one `CheckpointError` naming the file and the fix, never a traceback from deep inside a loader:
a damaged (truncated) weights file, a malformed `vlmod` section, NaN weights. Router weights
missing from a converted checkpoint load as zero routers (every token scores the same) with a
warning, never as randomly initialised ones.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmod.config import DTYPES, MoDConfig
from vlmod.errors import InputError
from vlmod.io.safetensors_layout import damaged_safetensors


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded as it is; the message names the file and what to do."""

_CONFIG_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "subfolder")


def torch_dtype(name: str | torch.dtype | None) -> torch.dtype | str:
    """The `dtype=` for `from_pretrained` of a `--dtype` name: "auto" (or None) keeps the
    checkpoint's own dtype; a ValueError names the choices otherwise."""
    if name is None or name == "auto":
        return "auto"
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def checkpoint_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in (its config's `dtype`; float32 if unset)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def loading_kwargs(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> dict[str, Any]:
    """`from_pretrained` kwargs of a command's `--dtype` and `--device`: a CUDA device is a
    `device_map`, so the weights go straight to the GPU (no CPU copy first); CPU maps the file."""
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if device is not None and torch.device(device).type != "cpu":
        kwargs["device_map"] = str(device)
    return kwargs


def part_configs(settings: dict[str, Any], source: str = "config.json") -> dict[str, MoDConfig]:
    """{part: MoDConfig} from the `vlmod` entry of a config.json (`source`, for the message)."""
    if not isinstance(settings, dict):
        raise CheckpointError(
            f"{source}: 'vlmod' must map a part (language, vision) to its MoD settings, got a "
            f"{type(settings).__name__}; fix it, or convert the model again with `vlmod convert`"
        )
    configs = {}
    for part, d in settings.items():
        try:
            configs[part] = MoDConfig.from_dict(d)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"{source}: vlmod.{part}: {e}; fix that entry, or convert the model again with `vlmod convert`"
            ) from None
    return configs


def _from_pretrained(cls: type, path: str | Path, kwargs: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """`cls.from_pretrained` with its loading info; a damaged weights file is a CheckpointError."""
    from safetensors import SafetensorError

    try:
        return cls.from_pretrained(path, output_loading_info=True, **kwargs)
    except (SafetensorError, EOFError) as e:
        where = damaged_safetensors(path) if Path(path).is_dir() else None
        raise CheckpointError(
            f"{path}: the weights are damaged ({where or str(e).splitlines()[0]}); copy or download the "
            "checkpoint again, or re-save it"
        ) from None
    except OSError as e:
        if "unable to load weights" in str(e).lower() or "truncated" in str(e).lower():
            raise CheckpointError(f"{path}: the weights could not be read ({str(e).splitlines()[0][:200]})") from None
        folder = Path(path).expanduser()
        if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
            raise CheckpointError(
                f"{path} has no weights file (model.safetensors); copy the whole checkpoint folder, or convert / "
                "save it again"
            ) from None
        raise


def max_positions(config: Any) -> int | None:
    """How many positions the language model of a model (or config) has, None when it does not
    say: a longer prompt is refused before any work."""
    config = getattr(config, "config", config)
    text = getattr(config, "text_config", None) or config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def vision_tower(model: nn.Module) -> nn.Module | None:
    """A LLaVA-family model's vision tower (`model.model.vision_tower`, or deeper down the `.model`
    chain of a wrapper such as the pre-LLM reduction), None where it has none."""
    inner: Any = model
    while inner is not None:
        tower = getattr(inner, "vision_tower", None)
        if isinstance(tower, nn.Module):
            return tower
        inner = getattr(inner, "model", None)
    return None


def patch_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Set `module.forward` to `forward` for a while; returns the call that puts back what was
    there (an instance forward set before, such as accelerate's hooks', or the class's)."""
    own = module.__dict__.get("forward")
    module.forward = forward

    def restore() -> None:
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = own

    return restore


def _zero_missing_routers(model: nn.Module, missing: list[str], path: str | Path) -> None:
    """Routers the checkpoint has no weights for start at zero (what a fresh conversion has), not
    at transformers' random init, and the user is told."""
    routers = [k for k in missing if "mod_router" in k.split(".")]
    if not routers:
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in routers:
            if name in params:
                params[name].zero_()
    warnings.warn(
        f"{path} has no weights for its MoD router(s) ({', '.join(routers[:2])}{', ...' if len(routers) > 2 else ''}); "
        "they load as zero routers: every routable token scores the same until the routers are fine-tuned",
        stacklevel=3,
    )


def _finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every value of `t` is finite, in slices: isfinite of a whole embedding matrix makes
    a float32-sized temporary (0.5 GB for a 7B model's), more than the check needs."""
    with torch.no_grad():
        return all(bool(torch.isfinite(part).all()) for part in t.detach().reshape(-1).split(chunk))


def check_finite(model: nn.Module, path: str | Path) -> None:
    """CheckpointError when any weight is NaN or infinite: such a model answers garbage, and an
    evaluation of it would report a meaningless 0%, not the breakage."""
    bad = [name for name, p in model.named_parameters() if p.is_floating_point() and not _finite(p)]
    if bad:
        raise CheckpointError(
            f"{path}: {len(bad)} weight tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); the checkpoint is broken (a diverged run?): use an earlier one"
        )


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
    if not local.exists() and not kwargs.get("local_files_only"):
        from vlmod.io.paths import check_hub_id, looks_like_hub_id

        if looks_like_hub_id(path):  # off the network: one line within seconds, not a retry loop
            check_hub_id(str(path), error=CheckpointError)
    if local.is_dir():
        try:
            json.loads((local / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(
                f"{local / 'config.json'} is not valid JSON ({str(err).splitlines()[0][:120]}); restore it from the "
                "original checkpoint"
            ) from None
    try:
        return AutoConfig.from_pretrained(str(local) if local.exists() else str(path), **kwargs)
    except ValueError as err:
        raise CheckpointError(f"{path}: config.json cannot be used: {str(err).splitlines()[0][:240]}") from None
    except OSError as err:
        raise FileNotFoundError(
            f"could not load a model config from {path!r}: not a local directory, and the hub "
            f"could not provide it ({str(err).splitlines()[0]})"
        ) from None


def load_pretrained(path: str | Path, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a checkpoint saved by `save_pretrained`, converted again exactly as it was saved.

    A plain (never converted) checkpoint loads as the dense model; a LoRA fine-tune's `adapter`
    folder as the merged model on the base it records (`vlmod.io.adapters`). The converted architecture is
    built first and transformers' own loading fills it, so key renames of the checkpoint format
    apply to the routers too. A checkpoint that cannot be used as it is raises CheckpointError
    (see the module doc).
    """
    from vlmod.api import apply_mod
    from vlmod.io.adapters import is_adapter, load_adapter

    if is_adapter(path) and not from_pretrained_kwargs.get("output_loading_info"):
        return load_adapter(path, **from_pretrained_kwargs)
    want_info = bool(from_pretrained_kwargs.pop("output_loading_info", False))
    config_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in _CONFIG_KWARGS}
    config = load_config(path, **config_kwargs)
    cls = model_class(config)
    settings = getattr(config, "vlmod", None)
    if not settings:
        model, info = _from_pretrained(cls, path, from_pretrained_kwargs)
        return (model, info) if want_info else model
    parts = part_configs(settings, f"{path}/config.json")

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        for part, part_config in parts.items():
            apply_mod(self, part_config, part=part)

    converted = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})
    try:
        model, info = _from_pretrained(converted, path, from_pretrained_kwargs)
    except ValueError as e:  # apply_mod refusing the saved settings (a layer out of range, ...)
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}/config.json: the vlmod settings do not fit this model: {str(e).splitlines()[0]}") from None
    model.__class__ = cls
    _zero_missing_routers(model, info.get("missing_keys", []), path)
    return (model, info) if want_info else model


def vlm_class(path: str | Path, error: type[Exception], purpose: str) -> type:
    """The vision-language model class of checkpoint `path` (a family a plugin in
    `vlmod.plugins.vlm_plugins` converts: LLaVA, Qwen2.5-VL, Qwen3-VL, InternVL, Gemma 3),
    reading only its config (so a command can check every checkpoint it was given before loading
    one); `error` with what is wrong otherwise. `purpose` completes the message: "{path} is a X
    checkpoint; {purpose} vision-language models of these families (...)"."""
    from vlmod.plugins import vlm_classes, vlm_families

    try:
        cls = model_class(load_config(path))
    except (FileNotFoundError, TypeError, CheckpointError) as e:
        raise error(str(e)) from None
    if not issubclass(cls, vlm_classes()):
        raise error(
            f"{path} is a {cls.__name__} checkpoint; {purpose} vision-language models of these families "
            f"({', '.join(vlm_families())})"
        )
    return cls


def load_vlm(
    path: str | Path, error: type[Exception], purpose: str, converted: bool = True, **from_pretrained_kwargs: Any
) -> tuple[nn.Module, Any]:
    """(model, processor) of a vision-language checkpoint of a supported family (`vlm_class`), with
    `error` for a checkpoint that is missing, of another family, or has no loadable processor.
    converted: load the MoD layers it was saved with (`load_pretrained`); False loads the dense
    model (routers ignored), as calibration wants."""
    from transformers import AutoProcessor

    try:
        cls = vlm_class(path, error, purpose)
    except CheckpointError as e:
        raise error(str(e)) from None
    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise error(f"could not load the processor of {path}: {str(e).splitlines()[0]}") from None
    try:
        if converted:
            model = load_pretrained(path, **from_pretrained_kwargs)
        else:
            model, _ = _from_pretrained(cls, path, from_pretrained_kwargs)
        check_finite(model, path)
    except CheckpointError as e:
        raise error(str(e)) from None
    return model, processor
