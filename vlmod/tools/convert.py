"""Convert a LLaVA checkpoint to MoD and save it with its processor and a report."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from vlmod.config import DTYPES, MoDConfig
from vlmod.errors import InputError
from vlmod.io.files import read_yaml_mapping, sole_writer
from vlmod.io.hf import checkpoint_dtype, load_config, model_class, torch_dtype
from vlmod.io.safetensors_layout import align_folder, damaged_safetensors
from vlmod.routing.schedule import capacity_to_k
from vlmod.tools.flops import DecoderDims, language_prefill_flops

REPORT = "vlmod_report.json"
# The largest weights file written; a 7B model in bfloat16 is three files, as on the hub.
MAX_SHARD_SIZE = "5GB"


class ConvertError(InputError):
    """Bad input to `convert` (or an --out it cannot write): the message says what is wrong and
    what to do; a command that converts (the recipe) reports it as its one `error:` line."""


@dataclass
class ConvertOptions:
    model: str
    out: str
    capacity: float = 0.5
    layers: str | list[int] = "every_other"
    routable: list[str] = field(default_factory=lambda: ["image", "video"])
    router: str = "learned"
    share_router: bool = True
    capacity_schedule: str | None = None
    aux_loss: str | None = None
    vision_capacity: float | None = None
    vision_layers: str | list[int] | None = None
    dtype: str = "auto"
    max_shard_size: str = MAX_SHARD_SIZE
    overwrite: bool = False
    prompt_tokens: int = 60

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ConvertOptions:
        data = read_yaml_mapping(path, ConvertError)
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConvertError(f"{path}: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        missing = {"model", "out"} - set(data)
        if missing:
            raise ConvertError(f"missing option(s) {sorted(missing)} (give them in {path} or as flags)")
        return cls(**data)

    def language_config(self) -> MoDConfig:
        return MoDConfig(
            capacity=self.capacity, layers=self.layers, routable=tuple(self.routable), router=self.router,
            share_router=self.share_router, capacity_schedule=self.capacity_schedule, aux_loss=self.aux_loss,
        )

    def vision_config(self) -> MoDConfig | None:
        if self.vision_capacity is None and self.vision_layers is None:
            return None
        return MoDConfig(
            capacity=self.vision_capacity if self.vision_capacity is not None else self.capacity,
            layers=self.vision_layers if self.vision_layers is not None else "every_other",
            router=self.router,
            share_router=self.share_router,
        )


def _check_out(out: Path, overwrite: bool, model: str) -> None:
    """--out must be writable and must not be, hold or sit inside --model: --overwrite replaces the
    whole folder, which would delete the model being converted (and anything beside it)."""
    from vlmod.io.paths import check_new_dir

    check_new_dir(out, "--out", inputs=[model], error=ConvertError, overwrite=overwrite, replaces=True)


def _remove_leftovers(out: Path) -> None:
    """Temp folders of an earlier convert to `out` that was killed mid-save (`.NAME.tmp-*`, and
    `.NAME.old-*` of a replace): only a convert to `out` writes those names, and it holds the lock on
    `out` (`sole_writer`) while it does, so any found now were left by a killed run."""
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.glob(f".{out.name}.tmp-*")) + sorted(out.parent.glob(f".{out.name}.old-*")):
        if path.is_dir():
            tqdm.write(f"removing {path}, left by an interrupted convert")
            shutil.rmtree(path, ignore_errors=True)


def _check_llava(config: Any, source: str) -> type:
    from vlmod.plugins import vlm_classes, vlm_families

    try:
        cls = model_class(config)
    except TypeError:
        cls = None
    if cls is None or not issubclass(cls, vlm_classes()):
        what = getattr(config, "model_type", type(config).__name__)
        arch = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise ConvertError(
            f"{source} is not a LLaVA checkpoint nor another supported vision-language model: it is a {what!r} "
            f"model ({arch}). "
            f"vlmod convert supports: {', '.join(vlm_families())}"
        )
    return cls


def _check_layers(config: MoDConfig, num_layers: int, part: str) -> None:
    """Layer errors before the weights are loaded (minutes for a 7B checkpoint)."""
    try:
        layers = config.resolve_layers(num_layers)
    except ValueError as err:
        raise ConvertError(f"{part} layers: {err}") from None
    if part == "language" and not isinstance(config.layers, str) and 0 in layers:
        raise ConvertError(
            "language layer 0 must stay dense: transformers sizes the causal mask and positions of "
            "every layer from layer 0's KV cache"
        )


def image_tokens(config: Any) -> int:
    """Image tokens of one image at the tower's base resolution (no anyres tiles); a 448 x 448
    image for dynamic-resolution towers (Qwen2.5-VL, Qwen3-VL)."""
    if getattr(config, "mm_tokens_per_image", None):  # Gemma 3: pooled to a fixed count
        return int(config.mm_tokens_per_image)
    if getattr(config, "model_type", None) == "internvl":  # pixel shuffle of one 448 px tile
        return int(config.image_seq_length)
    vision = config.vision_config
    if not hasattr(vision, "image_size") and hasattr(vision, "spatial_merge_size"):
        return (448 // (vision.patch_size * vision.spatial_merge_size)) ** 2
    n = (vision.image_size // vision.patch_size) ** 2
    if getattr(config, "vision_feature_select_strategy", "default") == "full" and vision.model_type == "clip_vision_model":
        n += 1
    return n


def predict(model: torch.nn.Module, prompt_tokens: int) -> dict[str, Any]:
    """Predicted language-model prefill FLOPs and KV-cache size, dense vs MoD, for one image and
    a prompt of `prompt_tokens` text tokens."""
    import vlmod

    config = model.config
    dims = DecoderDims.from_config(config.text_config)
    n_image = image_tokens(config)
    total = n_image + prompt_tokens
    counts = {
        i: prompt_tokens + capacity_to_k(c, n_image)
        for (part, i), c in vlmod.mod_layers(model).items()
        if part == "language"
    }
    dense_flops = language_prefill_flops(dims, total)
    mod_flops = language_prefill_flops(dims, total, counts)
    dense_kv = dims.layers * total
    mod_kv = sum(counts.get(i, total) for i in range(dims.layers))
    per_token = 2 * dims.kv_heads * dims.head_dim * torch.finfo(model.dtype).bits // 8
    return {
        "image_tokens": n_image,
        "prompt_tokens": prompt_tokens,
        "language_prefill_flops": {"dense": dense_flops, "mod": mod_flops},
        "predicted_speedup": dense_flops / mod_flops,
        "kv_cache_bytes": {"dense": dense_kv * per_token, "mod": mod_kv * per_token},
        "kv_cache_reduction": 1.0 - mod_kv / dense_kv,
    }


def convert(options: ConvertOptions) -> dict[str, Any]:
    """Load, convert, save (to a temporary directory renamed into place) and report. One convert
    writes a given --out at a time: a second one stops before loading anything."""
    out = Path(options.out).expanduser()
    _check_out(out, options.overwrite, options.model)
    if options.dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    _check_shard_size(options.max_shard_size)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConvertError(f"cannot write to {out.parent}: {err.strerror or err}") from None
    with sole_writer(out, ConvertError, "--out"):
        return _convert(options, out)


def _convert(options: ConvertOptions, out: Path) -> dict[str, Any]:
    import vlmod

    try:
        language = options.language_config()
        vision = options.vision_config()
    except ValueError as err:
        raise ConvertError(str(err)) from None
    try:
        config = load_config(options.model)
    except FileNotFoundError as err:
        raise ConvertError(str(err)) from None
    cls = _check_llava(config, options.model)
    _check_layers(language, config.text_config.num_hidden_layers, "language")
    if vision is not None:
        _check_layers(vision, config.vision_config.num_hidden_layers, "vision")
    steps = tqdm(total=4, desc="convert", unit="step")
    steps.set_postfix_str("loading")
    # The checkpoint's weights are mapped, not copied (in its own dtype unless --dtype casts):
    # converting only adds routers, and saving streams the mapped weights to the new files.
    model = cls.from_pretrained(options.model, dtype=torch_dtype(options.dtype))
    processor = _load_processor(options.model)
    steps.update()
    before = sum(p.numel() for p in model.parameters())
    steps.set_postfix_str("converting")
    try:
        vlmod.apply_mod(model, language, part="language")
        if vision is not None:
            vlmod.apply_mod(model, vision, part="vision")
    except ValueError as err:
        raise ConvertError(str(err)) from None
    steps.update()
    report = {
        "source": options.model,
        "model_class": cls.__name__,
        "dtype": str(model.dtype).removeprefix("torch."),
        "source_dtype": str(checkpoint_dtype(config)).removeprefix("torch."),
        "layers": {
            part: {str(i): c for (p, i), c in vlmod.mod_layers(model).items() if p == part}
            for part in ("language", "vision")
        },
        "settings": model.config.vlmod,
        "parameters": {"dense": before, "added": sum(p.numel() for p in model.parameters()) - before},
        "prediction": predict(model, options.prompt_tokens),
    }
    steps.set_postfix_str("saving")
    _save(model, processor, report, out, options.max_shard_size, steps)
    steps.update()
    steps.close()
    return report


def _save(model: Any, processor: Any, report: dict[str, Any], out: Path, max_shard_size: str | int, steps: Any) -> None:
    """Write the converted model to a temp folder beside `out`, check it, then move it into place:
    `out` is complete or as it was. The caller holds the lock on `out`."""
    try:
        _remove_leftovers(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:
        steps.close()
        raise ConvertError(f"cannot write to {out.parent}: {err.strerror or err}") from None
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        align_folder(tmp)  # so loading maps the weights and computes what was saved, bit for bit
        if processor is not None:
            processor.save_pretrained(tmp)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if damaged := damaged_safetensors(tmp):  # a full disk can leave a short file without an error
            raise OSError(errno.ENOSPC, f"{damaged} (is the disk full?)")
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; a saved model is the user's usual folder
        steps.update()
        _replace_dir(tmp, out)
    except (OSError, SafetensorError) as err:  # disk full, quota, permissions: nothing at --out has changed
        shutil.rmtree(tmp, ignore_errors=True)
        steps.close()  # ends the bar's line, so the error is a line of its own
        # A SafetensorError (the Rust writer's) has no strerror: its message is the reason.
        reason = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
        raise ConvertError(
            f"could not save the converted model to {out}: {reason} "
            f"({'unchanged' if out.exists() else 'not created'}); free space or choose another --out"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_shard_size(size: str | int) -> None:
    """A size > 0 save_pretrained reads: bytes, or digits with KB, MB, GB or TB (5GB, 500MB)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return
    match = re.fullmatch(r"\s*(\d+(\.\d+)?)\s*[KMGT]B\s*", str(size), flags=re.IGNORECASE)
    if match is None or not float(match.group(1)) > 0:
        raise ConvertError(f"--max-shard-size must be a size such as 5GB or 500MB, got {size!r}")


def _load_processor(source: str) -> Any:
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(source)
    except (OSError, ValueError, TypeError) as err:
        tqdm.write(f"warning: no processor saved: {source} has none that loads ({str(err).splitlines()[0]})")
        return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`; an old `target` is removed only after the move succeeded."""
    if not target.exists():
        new.rename(target)
        return
    backup = target.with_name(f".{target.name}.old-{new.name[-8:]}")
    target.rename(backup)
    try:
        new.rename(target)
    except BaseException:
        backup.rename(target)
        raise
    shutil.rmtree(backup, ignore_errors=True)
