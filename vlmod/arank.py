"""ARank: rank the layers of a model part by the numerical rank of their attention maps.

Which layers to convert is the first decision of a MoD conversion. γ-MoD's answer: a layer
whose attention maps have low rank mixes tokens redundantly, so skipping tokens there costs
little. This module measures that properly on calibration data and turns it into a layer list.

Rank definition (what `attention_ranks` computes, and what every number here is built from):

* the map is one head's post-softmax attention matrix of one sequence, as the model computes
  it (its own dtype, then upcast to float32), restricted to the sequence's real tokens:
  padding rows and columns are removed (a causal map keeps its lower triangle);
* its singular values are computed in float32 on the model's device (`torch.linalg.svdvals`);
* its rank is the number of singular values above `sigma_max * n * eps(float32)`, with `n` the
  number of real tokens and `eps(float32) = 2**-23`: the default tolerance of
  `numpy.linalg.matrix_rank` and `torch.linalg.matrix_rank` on the real block.

Zeroing the padding rows and columns instead of cutting them out leaves the singular values of
the real block (plus zeros), so one batched `svdvals` over `[B, H, L, L]` serves a padded batch
with a per-sequence tolerance. A layer's rank is the mean over heads and sequences; its std is
over the same maps; the normalised rank (rank / real tokens) compares sequences of different
lengths. Ranks are measured on the dense model: a model with MoD layers is refused.

Maps are captured layer by layer by forward hooks that reduce each map to per-head ranks at
once, so at most one layer's maps exist at a time. Hugging Face attention runs "eager" while
calibrating (sdpa and flash attention return no weights), timm attention unfused, open_clip's
`nn.MultiheadAttention` with `need_weights=True`; the model's own settings come back afterwards,
also when a batch raises.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.config import MoDConfig

FORMAT = "vlmod.arank/1"
EPS32 = float(torch.finfo(torch.float32).eps)
RANK_DEFINITION = (
    "numerical rank of each head's post-softmax attention map over real tokens (padding rows and "
    "columns removed): singular values in float32 (torch.linalg.svdvals) above "
    "sigma_max * n_real * eps(float32), the numpy/torch matrix_rank default tolerance; mean and std "
    "over heads and sequences; normalized = rank / n_real"
)
EXIT_USAGE = 2


# ----------------------------------------------------------------------------- the metric


def attention_ranks(maps: Tensor, real: Tensor | None = None) -> Tensor:
    """Numerical rank of every head's attention map over the real tokens of its sequence.

    maps: `[B, H, L, L]` attention probabilities (any float dtype, any device).
    real: `[B, L]` bool (or 0/1) mask of real tokens; None: all tokens are real.
    Returns `[B, H]` int64 ranks (0 for a sequence without real tokens). See the module
    docstring for the definition.
    """
    if maps.dim() != 4 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"attention maps must be [B, H, L, L], got shape {tuple(maps.shape)}")
    batch, _, length, _ = maps.shape
    a = maps.detach().to(torch.float32)
    if real is None:
        n = torch.full((batch,), length, device=a.device, dtype=torch.float32)
    else:
        if tuple(real.shape) != (batch, length):
            raise ValueError(
                f"the real-token mask has shape {tuple(real.shape)}, the maps need {(batch, length)}"
            )
        real = real.to(device=a.device, dtype=torch.bool)
        pair = (real[:, :, None] & real[:, None, :]).unsqueeze(1)
        a = a.masked_fill(~pair, 0.0)
        n = real.sum(-1).to(torch.float32)
    s = torch.linalg.svdvals(a)  # [B, H, L], descending
    tol = s[..., :1] * (n * EPS32)[:, None, None]
    return (s > tol).sum(-1)


# ----------------------------------------------------------------------------- the result


def _check_selection(
    num_layers: int, n: int | None, threshold: float | None, keep_first: int, keep_last: int
) -> None:
    """Reject selection arguments that cannot mean anything for a part with `num_layers` layers."""
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive number of layers, got {n!r}")
        if n > num_layers:
            raise ValueError(f"n={n} layers asked for, but this part has only {num_layers} layers")
    if threshold is not None:
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not (0.0 < float(threshold) <= 1.0)
        ):
            raise ValueError(f"threshold is a normalised rank (rank / tokens) in (0, 1], got {threshold!r}")
    for name, value in (("keep_first", keep_first), ("keep_last", keep_last)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    free = num_layers - keep_first - keep_last
    if free < 1:
        raise ValueError(
            f"keep_first={keep_first} and keep_last={keep_last} keep all {num_layers} layers dense, so no layer "
            f"could be suggested; keep at most {num_layers - 1} layers in total"
        )
    if n is not None and n > free:
        raise ValueError(
            f"n={n} layers asked for, but only {free} of {num_layers} are left after keep_first={keep_first} "
            f"and keep_last={keep_last}"
        )


@dataclass
class LayerRanks:
    """Attention ranks of every layer of one model part, from one calibration run.

    mean / std: rank over all (sequence, head) maps of the layer; normalized / normalized_std:
    the same for rank / real tokens. tokens: the real-token count of every measured sequence
    (images or crops for a vision part, prompts for a language part). dense_layers: layers the
    family never converts (layer 0 of a LLaVA language model), which `select` never returns.
    suggested: the layers a tool chose with `select`, kept with the ranks when saved.
    """

    part: str
    mean: list[float]
    std: list[float]
    normalized: list[float]
    normalized_std: list[float]
    num_samples: int
    tokens: list[int]
    family: str = ""
    dense_layers: list[int] = field(default_factory=list)
    suggested: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lengths = {len(self.mean), len(self.std), len(self.normalized), len(self.normalized_std)}
        if len(lengths) != 1:
            raise ValueError("mean, std, normalized and normalized_std need one value per layer each")

    @property
    def num_layers(self) -> int:
        return len(self.mean)

    def select(
        self,
        n: int | None = None,
        threshold: float | None = None,
        keep_first: int = 0,
        keep_last: int = 0,
    ) -> list[int]:
        """The layers to convert, lowest normalised rank first (ties: lower mean rank, then index).

        n: how many (with a threshold, at most how many); None: every candidate.
        threshold: only layers whose normalised rank is <= threshold, in (0, 1].
        keep_first / keep_last: that many first / last layers stay dense. `dense_layers` are
        never returned either, so for a LLaVA language part keep_first is in effect at least 1:
        transformers sizes every layer's mask and positions from layer 0's KV cache.
        Without a threshold, asking for more layers than there are candidates is an error.
        """
        _check_selection(self.num_layers, n, threshold, keep_first, keep_last)
        count = self.num_layers
        protected = set(range(min(keep_first, count))) | set(range(max(count - keep_last, 0), count))
        protected |= set(self.dense_layers)
        candidates = [i for i in range(count) if i not in protected]
        if threshold is not None:
            candidates = [i for i in candidates if self.normalized[i] <= threshold]
        candidates.sort(key=lambda i: (self.normalized[i], self.mean[i], i))
        if n is not None:
            if threshold is None and n > len(candidates):
                kept = sorted(protected)
                raise ValueError(
                    f"n={n} layers asked for, but only {len(candidates)} of {count} can be converted "
                    f"(layers {kept} stay dense: keep_first={keep_first}, keep_last={keep_last}"
                    + (f", always-dense {sorted(self.dense_layers)}" if self.dense_layers else "")
                    + ")"
                )
            candidates = candidates[:n]
        return candidates

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "rank_definition": RANK_DEFINITION,
            "part": self.part,
            "family": self.family,
            "num_layers": self.num_layers,
            "num_samples": self.num_samples,
            "mean_tokens": sum(self.tokens) / len(self.tokens) if self.tokens else 0.0,
            "dense_layers": list(self.dense_layers),
            "suggested": None if self.suggested is None else list(self.suggested),
            "layers": [
                {
                    "layer": i,
                    "mean_rank": self.mean[i],
                    "std_rank": self.std[i],
                    "normalized_rank": self.normalized[i],
                    "normalized_std": self.normalized_std[i],
                }
                for i in range(self.num_layers)
            ],
            "tokens": list(self.tokens),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerRanks:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a vlmod ARank file (format {d.get('format')!r}, expected {FORMAT!r})")
        try:
            layers = sorted(d["layers"], key=lambda r: r["layer"])
            if [r["layer"] for r in layers] != list(range(len(layers))):
                raise ValueError("the layer indices are not 0..N-1")
            return cls(
                part=d["part"],
                mean=[float(r["mean_rank"]) for r in layers],
                std=[float(r["std_rank"]) for r in layers],
                normalized=[float(r["normalized_rank"]) for r in layers],
                normalized_std=[float(r["normalized_std"]) for r in layers],
                num_samples=int(d["num_samples"]),
                tokens=[int(t) for t in d["tokens"]],
                family=d.get("family", ""),
                dense_layers=[int(i) for i in d.get("dense_layers", [])],
                suggested=None if d.get("suggested") is None else [int(i) for i in d["suggested"]],
                meta=dict(d.get("meta") or {}),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed ARank data: missing or bad field {e}") from None

    def to_json(self, path: str | Path) -> Path:
        """Write the ranks as JSON, atomically (a temp file replaced into place), so a crash or a
        full disk never leaves a half-written file where a previous run's ranks were."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_json(cls, path: str | Path) -> LayerRanks:
        path = Path(path).expanduser()
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a ranks JSON file (not UTF-8 text); give the ranks.json of `vlmod rank`") from None
        except OSError as e:
            raise ValueError(f"cannot read ranks file {path}: {e.strerror or e}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- calibration


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

    from vlmod.plugins import find_plugin
    from vlmod.plugins.decoder import own_positions, vlm_plugin
    from vlmod.routing import mod_layers

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


__all__ = ["RANK_DEFINITION", "LayerRanks", "attention_ranks", "rank_layers"]
