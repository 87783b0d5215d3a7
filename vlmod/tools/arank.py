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

Measuring them on a model (hooks, calibration batches, a checkpoint) is `vlmod.tools.calibrate`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vlmod.io.files import write_bytes_atomic, write_json

FORMAT = "vlmod.tools.arank/1"
EPS32 = float(torch.finfo(torch.float32).eps)
RANK_DEFINITION = (
    "numerical rank of each head's post-softmax attention map over real tokens (padding rows and "
    "columns removed): singular values in float32 (torch.linalg.svdvals) above "
    "sigma_max * n_real * eps(float32), the numpy/torch matrix_rank default tolerance; mean and std "
    "over heads and sequences; normalized = rank / n_real"
)


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


def check_selection(
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
        check_selection(self.num_layers, n, threshold, keep_first, keep_last)
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
        write_json(path, self.to_dict())
        return path

    @classmethod
    def from_json(cls, path: str | Path) -> LayerRanks:
        path = Path(path).expanduser()
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
        except RecursionError:
            raise ValueError(f"{path} is not a ranks JSON file (nested too deeply to read)") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a ranks JSON file (not UTF-8 text); give the ranks.json of `vlmod rank`") from None
        except OSError as e:
            raise ValueError(f"cannot read ranks file {path}: {e.strerror or e}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- reading them


def plot_ranks(ranks: LayerRanks, path: str | Path, suggested: Sequence[int] | None = None) -> Path:
    """A bar chart of the mean rank per layer (std as error bars), suggested layers marked.
    Needs matplotlib; uses its Agg canvas directly so no global backend is touched."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("plotting ranks needs matplotlib: pip install matplotlib") from None
    suggested = set((ranks.suggested or []) if suggested is None else suggested)
    layers = list(range(ranks.num_layers))
    colors = ["tab:orange" if i in suggested else "tab:blue" for i in layers]
    fig = Figure(figsize=(max(6.0, 0.3 * len(layers) + 2), 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(layers, ranks.mean, yerr=ranks.std, color=colors, capsize=2, ecolor="0.4")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention rank (mean over heads and samples)")
    mean_tokens = sum(ranks.tokens) / max(len(ranks.tokens), 1)
    ax.set_title(
        f"ARank, {ranks.part} part: {ranks.num_samples} sequences, {mean_tokens:.0f} tokens on average"
    )
    ax.axhline(mean_tokens, color="0.5", linestyle="--", linewidth=1)
    ax.set_xticks(layers)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(
        handles=[
            Patch(color="tab:orange", label="suggested for MoD"),
            Patch(color="tab:blue", label="kept dense"),
            ax.lines[-1],
        ],
        labels=["suggested for MoD", "kept dense", "mean real tokens (full rank)"],
        loc="lower right",
        fontsize=8,
    )
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    path = Path(path).expanduser()
    write_bytes_atomic(path, png.getvalue())  # a full disk leaves no 0-byte or half-written PNG
    return path


def format_ranks(ranks: LayerRanks) -> str:
    """A per-layer table; `*` marks the suggested layers."""
    chosen = set(ranks.suggested or [])
    lines = [f"{'layer':>5}  {'rank':>8}  {'std':>7}  {'rank/tokens':>11}"]
    for i in range(ranks.num_layers):
        mark = " *" if i in chosen else ""
        lines.append(
            f"{i:>5}  {ranks.mean[i]:>8.2f}  {ranks.std[i]:>7.2f}  {ranks.normalized[i]:>11.4f}{mark}"
        )
    lines.append(f"suggested layers (lowest rank first): {ranks.suggested or []}")
    return "\n".join(lines)


__all__ = ["FORMAT", "RANK_DEFINITION", "LayerRanks", "attention_ranks", "check_selection", "format_ranks", "plot_ranks"]
