"""What a recipe's training stage cost: its median step time, tokens a second and training FLOPs,
from the run's `train_log.json` (the loop records each step's wall time and the tokens it
trained, `vlmod.training.loop`).

Training FLOPs are analytic, per sample, at the run's mean trained tokens per sample (attention-
mask ones; padding is not counted, as `vlmod eval` counts prefill): the language model's forward
and backward as `vlmod.tools.training_flops` counts them (a MoD layer forward and backward on its
processed tokens, the LM head on the positions the loop ran it on: the answer positions, as
`vlmod.training.logits` keeps them, from the log's `logit_rows`; every position in a log from
before), plus what that module leaves to its caller here:

- the vision tower: its forward, and where it trains (`train_vision_tower`, the dense stages from
  scratch) two more (input and weight gradients), as the projector's input gradient then too;
- a distilled stage's teacher: one dense forward (tower, projector, language model) per sample;
- capacities drawn per step (`capacities`, `capacity_warmup`): each step at its own draw, as the
  loop draws them (`vlmod.training.loop.step_capacities`);
- a run behind a pre-LLM reduction (`reduce_keep`): the language model trains on the kept vision
  tokens only (each step at its keep, `vlmod.training.loop.step_keep`), the teacher on all; the
  reduction's own ranking (the tower's last block's attention) is not counted.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmod.routing.schedule import capacity_to_k, layer_capacities
from vlmod.tools.flops import DecoderDims, generation_flops
from vlmod.tools.training_flops import language_training_flops, media_tokens, projector_flops
from vlmod.training.stability import SPIKE_FACTOR, describe_spikes, loss_spikes, warmup_steps

# TrainConfig.trainable -> what `language_training_flops` counts ("language" trains the same linears as "full").
_MODES = {"full": "full", "language": "full", "lora": "lora", "router": "router"}


@dataclass(frozen=True)
class SampleShape:
    """What one training sample's FLOPs depend on: the language model's shape, the tokens a sample
    trains (`tokens`, of which `media` are vision tokens, the routable ones), and the forward
    FLOPs of the vision tower (with any frame pooling) and of the projector per sample, and the
    projector's backward where it trains (`vlmod.tools.training_flops.projector_flops`)."""

    dims: DecoderDims
    tokens: float
    media: float
    vision: float
    projector: float
    projector_backward: float  # its weight gradients and the input gradients above its first linear
    head_tokens: float | None = None  # positions the LM head runs on per sample (None: every token)


@dataclass(frozen=True)
class Routing:
    """The MoD layers of a run's language model: their indices, mean capacity and schedule."""

    layers: tuple[int, ...]
    capacity: float
    schedule: str | None = None

    def processed(self, shape: SampleShape, capacity: float | None = None, keep: float = 1.0) -> dict[int, float]:
        """Tokens each MoD layer runs per sample at mean `capacity` (the routing's own by
        default): every text token plus k of the vision tokens (whole slots, as the engine) that
        a pre-LLM reduction keeping `keep` of them lets in."""
        caps = layer_capacities(self.capacity if capacity is None else capacity, self.layers, shape.dims.layers,
                                self.schedule)
        text = shape.tokens - shape.media
        if float(shape.media).is_integer():  # whole slots, as the reduction keeps and the engine routes them
            kept = capacity_to_k(keep, int(shape.media))
            return {i: text + capacity_to_k(c, kept) for i, c in caps.items()}
        return {i: text + c * shape.media * keep for i, c in caps.items()}


def sample_flops(shape: SampleShape, routing: Routing | None = None, capacity: float | None = None,
                 trainable: str = "full", train_vision_tower: bool = False, distill: bool = False,
                 gradient_checkpointing: bool = False, lora_rank: int = 16, keep: float = 1.0) -> float:
    """Training FLOPs of one sample in one step (see the module doc); `routing` None: dense;
    `keep`: the kept share of the vision tokens behind a pre-LLM reduction."""
    counts = routing.processed(shape, capacity, keep) if routing is not None else {}
    mode = _MODES[trainable]
    tokens = shape.tokens - shape.media * (1.0 - keep)
    language = language_training_flops(shape.dims, tokens, counts, mode, lora_rank=lora_rank,
                                       gradient_checkpointing=gradient_checkpointing,
                                       head_tokens=shape.head_tokens)["total"]
    tower = shape.vision * (3.0 if train_vision_tower else 1.0)
    if mode == "router":
        projector = shape.projector
    elif train_vision_tower:  # every linear's input gradient too: the tower below it trains
        projector = 3.0 * shape.projector
    else:
        projector = shape.projector + shape.projector_backward
    teacher = 0.0
    if distill:
        teacher = shape.vision + shape.projector + language_training_flops(
            shape.dims, shape.tokens, {}, "full", head_tokens=shape.head_tokens)["forward"]
    return language + tower + projector + teacher


def sample_shape(model: Any, processor: Any, data: str | Path, num_frames: int, tokens: float,
                 head_tokens: float | None = None, limit: int = 8) -> SampleShape:
    """The SampleShape of `model` on the first `limit` records of `data`, at `tokens` trained
    tokens and `head_tokens` LM head positions per sample (what the run measured)."""
    from vlmod.data import LlavaDataset, load_records

    records = load_records(Path(data))[:limit]
    ds = LlavaDataset(records, processor, Path(data).parent, num_frames=num_frames)
    batch = ds.collate([ds[i] for i in range(len(ds.records))])
    n_media = media_tokens(model, batch)
    projector = projector_flops(model, n_media, trains=True)
    return SampleShape(
        dims=DecoderDims.from_config(model.config.text_config), tokens=tokens, media=n_media,
        vision=generation_flops(model, batch, None)["vision"], projector=projector["forward"],
        projector_backward=projector["backward"], head_tokens=head_tokens,
    )


def routing_of(model: Any) -> Routing | None:
    """The language model's MoD layers (None: dense)."""
    from vlmod.routing.trace import find_parts

    part = next((p for p in find_parts(model) if p.name == "language"), None)
    if part is None:
        return None
    return Routing(tuple(sorted(part.capacities)), part.config.capacity, part.config.capacity_schedule)


def step_draws(cfg: Any, routing: Routing | None, steps: int) -> Counter[tuple[float | None, float]]:
    """How many of the run's `steps` ran at each (mean capacity, kept share of the vision tokens):
    capacity None is the routing's own, keep 1.0 no pre-LLM reduction."""
    from vlmod.training.loop import step_capacities, step_keep

    draws = []
    for step in range(steps):
        capacity = None
        if routing is not None:
            capacity = step_capacities(cfg, {"language": routing.capacity}, step, steps).get("language")
        keep = step_keep(cfg, step)
        draws.append((capacity, 1.0 if keep is None else keep))
    return Counter(draws)


def run_cost(run_dir: str | Path, data: str | Path | None = None) -> dict[str, Any] | None:
    """What the fine-tune in `run_dir` cost (its train_log.json, its saved model and the first
    records of its data, `data` where the folder moved since): steps, the median step in ms,
    tokens a second, training FLOPs in all and a step, and what the same steps would have cost
    dense (`dense_flops`: the model unconverted, the rest alike). None for a log written before
    the loop recorded costs."""
    from transformers import AutoProcessor

    from vlmod.io.hf import load_pretrained
    from vlmod.training.config import TrainConfig

    run_dir = Path(run_dir)
    log = json.loads((run_dir / "train_log.json").read_text())
    cost = log.get("cost")
    if not cost or not cost.get("samples"):
        return None
    cfg = TrainConfig.from_dict(log["config"])
    model, processor = load_pretrained(run_dir / "model"), AutoProcessor.from_pretrained(run_dir / "model")
    steps, samples = cost["steps_timed"], cost["samples"]
    head = cost["logit_rows"] / samples if cost.get("logit_rows") else None
    shape = sample_shape(model, processor, data or cfg.data, cfg.num_frames, cost["tokens"] / samples, head)
    routing = routing_of(model)
    common = dict(trainable=cfg.trainable, train_vision_tower=cfg.train_vision_tower, distill=bool(cfg.distill_from),
                  gradient_checkpointing=cfg.gradient_checkpointing, lora_rank=cfg.lora_r)
    draws = step_draws(cfg, routing, steps)
    per_sample = sum(n * sample_flops(shape, routing, c, keep=k, **common) for (c, k), n in draws.items()) / steps
    dense = sample_flops(shape, None, **common)
    return {
        "steps": steps,
        "step_ms_median": 1000 * cost["step_seconds_median"],
        "step_ms_spread": _spread(cost["step_seconds"]),
        "seconds": sum(cost["step_seconds"]),
        "tokens_per_second": cost["tokens_per_second"],
        "tokens_per_sample": shape.tokens,
        "head_tokens_per_sample": shape.head_tokens,
        "training_flops": per_sample * samples,
        "training_flops_per_step": per_sample * samples / steps,
        "dense_flops": dense * samples,
        "mod": routing is not None,
        "loss_spikes": loss_spikes(log.get("history", []), warmup_steps(log["config"], steps)),
    }


def _spread(seconds: list[float]) -> list[float]:
    """The 10th and 90th percentile step in ms."""
    if len(seconds) < 2:
        return [1000 * s for s in seconds * 2][:2]
    deciles = statistics.quantiles(seconds, n=10)
    return [1000 * deciles[0], 1000 * deciles[-1]]


def format_costs(costs: dict[str, dict[str, Any] | None]) -> list[str]:
    """The stage-cost table of results.md: a row a training stage, its step time, tokens a second
    and training FLOPs, and for a MoD stage the FLOPs it saved against the same steps dense."""
    lines = ["| training stage | steps | step ms (median, p10-p90) | tokens/s | training TFLOPs | GFLOPs a step "
             "| FLOPs against the same steps dense |", "|---|---|---|---|---|---|---|"]
    for stage, c in costs.items():
        if c is None:
            lines.append(f"| {stage} | not recorded (trained before the loop recorded step costs) | | | | | |")
            continue
        against = f"{c['training_flops'] / c['dense_flops']:.3f}x" if c["mod"] else "-"
        lo, hi = c["step_ms_spread"]
        lines.append(f"| {stage} | {c['steps']} | {c['step_ms_median']:.1f} ({lo:.1f}-{hi:.1f}) | "
                     f"{c['tokens_per_second']:,.0f} | {c['training_flops'] / 1e12:.4g} | "
                     f"{c['training_flops_per_step'] / 1e9:.2f} | {against} |")
    spiked = [describe_spikes(c["loss_spikes"], f"the {stage} stage") for stage, c in costs.items()
              if c and c.get("loss_spikes")]
    recorded = [c for c in costs.values() if c and "loss_spikes" in c]
    if spiked:
        lines += [""] + [f"- {line}" for line in spiked]
    elif recorded:
        lines += ["", f"No stage's logged loss rose above {SPIKE_FACTOR:g}x its running median after warm-up."]
    return lines


__all__ = ["Routing", "SampleShape", "format_costs", "routing_of", "run_cost", "sample_flops", "sample_shape",
           "step_draws"]
