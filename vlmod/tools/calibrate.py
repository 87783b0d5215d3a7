"""Measure ARank on a model: run calibration batches through it and reduce each layer's attention
maps to per-head ranks (`vlmod.tools.arank` defines the rank).

Maps are captured layer by layer by forward hooks that reduce each map to per-head ranks at
once, so at most one layer's maps exist at a time. Hugging Face attention runs "eager" while
calibrating (sdpa and flash attention return no weights), timm attention unfused, open_clip's
`nn.MultiheadAttention` with `need_weights=True`; the model's own settings come back afterwards,
also when a batch raises. `rank_checkpoint` does it for a checkpoint and a data file.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.config import MoDConfig
from vlmod.data.calibration import calibration_batches, calibration_samples
from vlmod.errors import InputError
from vlmod.tools.arank import LayerRanks, attention_ranks


class RankInputError(InputError):
    """Bad input to `vlmod rank` (model, data, selection flags): one `error:` line, exit 2."""


class _Recorder:
    """Per-layer ranks and real-token counts of the measured sequences (kept on the CPU: tiny)."""

    def __init__(self, num_layers: int):
        self.ranks: list[list[Tensor]] = [[] for _ in range(num_layers)]
        self.tokens: list[list[Tensor]] = [[] for _ in range(num_layers)]
        self.real: Tensor | None = None  # [B, L] real-token mask of the current batch, or None

    def record(self, layer: int, maps: Tensor | None) -> None:
        if maps is None:
            raise RuntimeError(
                f"attention layer {layer} returned no attention weights although vlmod switched it to "
                "eager attention; its attention implementation does not expose its maps"
            )
        real = self.real
        if real is not None and real.shape[-1] != maps.shape[-1]:
            raise RuntimeError(
                f"layer {layer} attends over {maps.shape[-1]} tokens but the attention mask covers "
                f"{real.shape[-1]}; pass the batch's full 2D attention_mask"
            )
        ranks = attention_ranks(maps, real)
        if real is None:
            n = torch.full((maps.shape[0],), maps.shape[-1], dtype=torch.long)
        else:
            n = real.sum(-1).cpu()
        keep = n > 0
        self.ranks[layer].append(ranks.cpu()[keep])
        self.tokens[layer].append(n[keep])


class _StopForward(Exception):
    """Raised after the last block of a part when nothing downstream is needed (the LLaVA
    language model behind a vision-tower calibration)."""


def _set_attn_implementation(config: Any, value: str | None) -> None:
    # Only this config: the public setter recurses into sub-configs, which must keep their own.
    if "_attn_implementation_internal" in vars(config):
        config._attn_implementation_internal = value
    else:
        config._attn_implementation = value


def _use_eager(root: nn.Module, undo: list[Callable[[], None]]) -> None:
    """Switch every config the part's modules read to eager attention; queue the restore.

    Why not `model.set_attn_implementation("eager")`: it switches every sub-model (a language
    calibration would run the vision tower eager too) and restoring a mixed setup through it
    means rebuilding its dict form; the attention modules read `config._attn_implementation` at
    each call, so setting exactly those configs is enough and restores exactly.
    """
    from transformers import PretrainedConfig

    configs: dict[int, Any] = {}
    for module in root.modules():
        cfg = getattr(module, "config", None)
        if isinstance(cfg, PretrainedConfig):
            configs.setdefault(id(cfg), cfg)
    for cfg in configs.values():
        previous = cfg._attn_implementation
        undo.append(partial(_set_attn_implementation, cfg, previous))
        _set_attn_implementation(cfg, "eager")


def _hf_hook(recorder: _Recorder, layer: int, _module: nn.Module, _args: Any, output: Any) -> None:
    recorder.record(layer, output[1] if isinstance(output, tuple) and len(output) > 1 else None)


def _timm_hook(recorder: _Recorder, layer: int, _module: nn.Module, _args: Any, output: Tensor) -> None:
    recorder.record(layer, output)


def _mha_pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {**kwargs, "need_weights": True, "average_attn_weights": False}


def _instrument(spec: Any, recorder: _Recorder, undo: list[Callable[[], None]]) -> None:
    """Hook every block's attention of the part so its maps reach `recorder`, per family."""
    blocks = spec.blocks
    hf_attn = [getattr(block, "self_attn", None) or getattr(block, "attention", None) for block in blocks]
    if all(isinstance(a, nn.Module) for a in hf_attn):  # Hugging Face layers: decoders, CLIP / SigLIP, InternViT
        _use_eager(spec.root, undo)
        for i, attn in enumerate(hf_attn):
            undo.append(attn.register_forward_hook(partial(_hf_hook, recorder, i)).remove)
    elif spec.family == "timm":
        for i, block in enumerate(blocks):
            attn = getattr(block, "attn", None)
            if attn is None or not hasattr(attn, "fused_attn") or not hasattr(attn, "attn_drop"):
                raise TypeError(
                    f"timm block {i} uses a {type(attn).__name__} attention; "
                    "ARank reads maps from timm's Attention (fused_attn + attn_drop)"
                )
            undo.append(partial(setattr, attn, "fused_attn", attn.fused_attn))
            attn.fused_attn = False
            undo.append(attn.attn_drop.register_forward_hook(partial(_timm_hook, recorder, i)).remove)
    elif spec.family == "open_clip":
        for i, block in enumerate(blocks):
            attn = getattr(block, "attn", None)
            if not isinstance(attn, nn.MultiheadAttention):
                raise TypeError(
                    f"open_clip block {i} uses a {type(attn).__name__}; ARank reads maps from "
                    "nn.MultiheadAttention"
                )
            undo.append(attn.register_forward_pre_hook(_mha_pre_hook, with_kwargs=True).remove)
            undo.append(attn.register_forward_hook(partial(_hf_hook, recorder, i)).remove)
    else:
        raise TypeError(f"ARank does not know how to read attention maps of the {spec.family} family")


def _move(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else None)
    return value


def _batch_size(batch: Any) -> int:
    values = (
        batch.values()
        if isinstance(batch, Mapping)
        else batch
        if isinstance(batch, (list, tuple))
        else [batch]
    )
    for v in values:
        if isinstance(v, Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 1


def rank_layers(
    model: nn.Module,
    batches: Iterable[Any],
    part: str | None = None,
    progress: bool = True,
    *,
    total: int | None = None,
) -> LayerRanks:
    """Attention rank of every layer of `part` over the calibration `batches`.

    model: a dense model of a supported family (LLaVA: part "language" or "vision"; timm /
        open_clip / HF CLIP and SigLIP towers: "vision"). None: the family's default part.
    batches: model inputs, one per forward: dicts of processor outputs for LLaVA (keep the
        `attention_mask`: it says which tokens are padding), `{"pixel_values": x}` dicts or
        plain image tensors for ViTs.
    total: the number of samples expected, for the progress bar only.
    """
    from tqdm.auto import tqdm
    from transformers import PreTrainedModel

    from vlmod.api import mod_layers
    from vlmod.plugins import find_plugin, own_positions, vlm_plugin

    if isinstance(batches, (Mapping, Tensor)):
        raise TypeError("batches is an iterable of model inputs: wrap a single batch in a list")
    converted = mod_layers(model)
    if converted:
        raise ValueError(
            f"this model already has MoD layers ({sorted(converted)}); ARank measures the dense model: "
            "call vlmod.remove_mod(model) first, or rank the checkpoint before converting it"
        )
    spec = find_plugin(model).part_spec(model, part, MoDConfig())
    is_vlm = vlm_plugin(model) is not None  # a whole vision-language model of any family
    callee = model if is_vlm else spec.entry
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    recorder = _Recorder(len(spec.blocks))
    extra: dict[str, Any] = {}
    if is_vlm:
        extra["use_cache"] = False
        if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
            extra["logits_to_keep"] = 1  # the logits are not needed: skip the vocabulary projection

    def call(batch: Any) -> None:
        if isinstance(batch, Tensor):
            callee(_move(batch, device, dtype))
        elif isinstance(batch, (list, tuple)):
            callee(*(_move(v, device, dtype) for v in batch))
        elif not isinstance(batch, Mapping):
            raise TypeError(
                f"a calibration batch must be a dict, a tensor or a tuple, got {type(batch).__name__}"
            )
        elif is_vlm:
            inputs = {k: _move(v, device, dtype) for k, v in batch.items()}
            mask = inputs.get("attention_mask")
            if mask is not None and mask.dim() == 2:
                if spec.name == "language":
                    recorder.real = mask.bool()
                if "position_ids" not in inputs and not own_positions(model):
                    # Positions as generate() numbers them: a padded sequence gets the positions
                    # it would have alone.
                    inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)
            callee(**{**extra, **inputs})
        elif set(batch) == {"pixel_values"} and not isinstance(callee, PreTrainedModel):
            callee(_move(batch["pixel_values"], device, dtype))  # timm / open_clip take the tensor
        else:
            callee(**{k: _move(v, device, dtype) for k, v in batch.items()})

    modes = {m: m.training for m in model.modules()}
    undo: list[Callable[[], None]] = []
    bar = tqdm(total=total, unit="sample", desc=f"ARank {spec.name}", disable=not progress)
    try:
        model.eval()
        _instrument(spec, recorder, undo)
        if is_vlm and spec.name == "vision":

            def stop(*_: Any) -> None:
                raise _StopForward

            undo.append(spec.blocks[-1].register_forward_hook(stop).remove)
        with torch.inference_mode():
            for batch in batches:
                try:
                    call(batch)
                except _StopForward:
                    pass
                finally:
                    recorder.real = None
                bar.update(_batch_size(batch))
    finally:
        bar.close()
        for fn in reversed(undo):
            fn()
        for module, training in modes.items():
            module.training = training

    counts = {sum(len(r) for r in layer) for layer in recorder.ranks}
    if counts == {0}:
        raise ValueError("no calibration samples: `batches` yielded nothing (or only padding)")
    if len(counts) != 1:
        raise RuntimeError(
            f"layers measured different numbers of sequences ({sorted(counts)}); a layer was skipped"
        )
    mean, std, normalized, normalized_std = [], [], [], []
    for ranks, tokens in zip(recorder.ranks, recorder.tokens, strict=True):
        r = torch.cat(ranks).double()
        n = torch.cat(tokens).double()
        ratio = r / n[:, None]
        mean.append(r.mean().item())
        std.append(r.std(correction=0).item())
        normalized.append(ratio.mean().item())
        normalized_std.append(ratio.std(correction=0).item())
    return LayerRanks(
        part=spec.name,
        mean=mean,
        std=std,
        normalized=normalized,
        normalized_std=normalized_std,
        num_samples=counts.pop(),
        tokens=[int(t) for t in torch.cat(recorder.tokens[0]).tolist()],
        family=spec.family,
        dense_layers=sorted(spec.dense_layers),
    )


def load_model(path: str, device: torch.device, dtype: str) -> tuple[nn.Module, Any]:
    from vlmod.io.hf import load_vlm, loading_kwargs

    model, processor = load_vlm(
        path, RankInputError, "the rank command calibrates (for image encoders, call vlmod.tools.calibrate.rank_layers)",
        converted=False, **loading_kwargs(dtype, device),
    )
    return model.to(device).eval(), processor


def rank_checkpoint(
    model: str,
    data: str | Path,
    *,
    image_root: str | Path | None = None,
    prompt: str | None = None,
    num_samples: int = 64,
    batch_size: int = 4,
    part: str = "language",
    progress: bool = True,
    dtype: str = "auto",
) -> LayerRanks:
    """Load a LLaVA checkpoint (on the GPU when there is one, in its own dtype unless `dtype`
    names another) and rank its layers on DATA."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samples = calibration_samples(data, image_root=image_root, prompt=prompt)
    llava, processor = load_model(model, device, dtype)
    batches = calibration_batches(processor, samples, batch_size=batch_size, num_samples=num_samples)
    ranks = rank_layers(llava, batches, part=part, progress=progress, total=batches.total)
    del llava
    return ranks


__all__ = ["RankInputError", "load_model", "rank_checkpoint", "rank_layers"]
