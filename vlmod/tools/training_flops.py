"""Analytic FLOPs of one training step (forward + backward) of a LLaVA model, dense or MoD.

Built on the inference counts of `vlmod.tools.flops` and its conventions (a multiply-add is 2
FLOPs; linears and the two attention matmuls counted; norms, activations, gate, gather and
scatter not). A step is:

- **forward**: the vision tower and projector (the vision tower never trains here), every
  language layer (a MoD layer on its processed tokens, plus its router on every token and again
  on the selected ones, whose logits the gate takes with their gradient) and the LM head on the
  positions whose logits the step computes (`logits_to_keep` in the inputs: the answer positions,
  as `vlmod.training.logits` asks; else every position).
- **backward, input gradients**: through every language block the loss flows through on its way
  to something that trains: a linear costs its forward again, the attention matmuls twice their
  forward (Q K^T and A V both need the gradient of each of their inputs). A MoD layer's backward
  runs on its processed tokens only: the skipped ones ride the residual, whose gradient passes
  unchanged. Below the lowest trained parameter nothing runs backward (with only routers
  training, the gradient stops at the lowest MoD layer, whose block it never enters).
- **backward, weight gradients**: one more forward's worth of each linear that trains (`full`:
  every language linear and the LM head; `lora`: the adapters, whose forward, input and weight
  gradients are each 2 n r (d_in + d_out); `router`: the routers) and of the projector where it
  trains (`full`, `lora`, `projector`).
- **recompute** (gradient checkpointing): each language layer that runs backward runs its
  forward a second time, up to the last tensor its backward needs: torch's non-reentrant
  checkpoint stops there, so a dense layer skips its down_proj (nothing saves its output; a
  down_proj LoRA adapter runs after it, so under LoRA it reruns), while a MoD layer's block
  output is saved by the gate and the whole block reruns.

`trainable` names what trains as `vlmod.training.setup.set_trainable` chooses it: `full` (the
language model, projector and routers), `lora` (adapters, projector, routers), `router` (routers
only) and `projector` (the projector alone: the dense reference of a router-only MoD fine-tune,
the cheapest dense fine-tune whose gradient crosses the whole language model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from vlmod.tools.flops import (
    DecoderDims,
    decoder_layer_flops,
    generation_flops,
    linear_flops,
    processed_counts,
    router_flops,
)

TRAINABLE_FLOPS = ("full", "lora", "router", "projector")
# The projections peft wraps by default (vlmod.training.config.LORA_TARGETS).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _attention_matmuls(dims: DecoderDims, n_query: float, n_key: float) -> float:
    """The score and mixing matmuls of one layer (the part of a block with no weights)."""
    return 4.0 * n_query * n_key * dims.heads * dims.head_dim


def _lora_shapes(dims: DecoderDims) -> dict[str, tuple[int, int]]:
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    return {
        "q_proj": (dims.dim, q), "k_proj": (dims.dim, kv), "v_proj": (dims.dim, kv), "o_proj": (q, dims.dim),
        "gate_proj": (dims.dim, dims.mlp_hidden), "up_proj": (dims.dim, dims.mlp_hidden),
        "down_proj": (dims.mlp_hidden, dims.dim),
    }


def lora_layer_flops(dims: DecoderDims, n_tokens: float, rank: int, targets: Sequence[str] = LORA_TARGETS) -> float:
    """Forward FLOPs of one layer's LoRA adapters (x A then B) on `n_tokens` tokens."""
    shapes = _lora_shapes(dims)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; a Llama-style layer has {sorted(shapes)}")
    return sum(linear_flops(n_tokens, shapes[t][0], rank) + linear_flops(n_tokens, rank, shapes[t][1]) for t in targets)


def language_training_flops(
    dims: DecoderDims,
    n_tokens: float,
    processed_counts_per_layer: Mapping[int, float] | None = None,
    trainable: str = "full",
    *,
    lora_rank: int = 16,
    lora_targets: Sequence[str] = LORA_TARGETS,
    causal: bool = False,
    gradient_checkpointing: bool = False,
    head_tokens: float | None = None,
) -> dict[str, float]:
    """FLOPs per sequence of one training step through the language backbone and LM head:
    {"forward", "backward", "recompute", "total"} (see the module doc).

    processed_counts_per_layer: {MoD layer: tokens it processes per sequence}; None / {}: dense.
    trainable: "full" | "lora" | "router" | "projector" (what trains below the LM head decides
        how deep the gradient goes; "projector" and "router" train no language weight).
    causal: count the attention a causal kernel computes ((n + 1) / 2 keys a query) instead of
        the full square (see `vlmod.tools.flops.language_prefill_flops`).
    head_tokens: positions the LM head runs on (None: all `n_tokens`).
    """
    if trainable not in TRAINABLE_FLOPS:
        raise ValueError(f"trainable must be one of {', '.join(TRAINABLE_FLOPS)}, got {trainable!r}")
    counts = dict(processed_counts_per_layer or {})
    bad = [i for i in counts if not 0 <= i < dims.layers]
    if bad:
        raise ValueError(f"layer indices {bad} are out of range for a language model with {dims.layers} layers")
    if trainable == "router" and not counts:
        raise ValueError("trainable 'router' needs MoD layers: a dense model has no router to train")
    # The lowest layer whose block the gradient enters: 0 when anything below the layers trains
    # (projector, embeddings); above the lowest router when only routers train.
    lowest = min(counts) + 1 if trainable == "router" else 0
    forward = backward = recompute = 0.0
    lora_last = trainable == "lora" and "down_proj" in lora_targets  # its adapter runs after down_proj
    for layer in range(dims.layers):
        n = counts.get(layer, n_tokens)
        keys = (n + 1) / 2 if causal else n
        block = decoder_layer_flops(dims, n, keys)
        matmuls = _attention_matmuls(dims, n, keys)
        forward += block
        # A MoD layer's router ranks every token and, in training, gives the gate the logits of
        # the selected ones again (with their gradient; vlmod.routing.layer).
        router = router_flops(n_tokens, dims.dim) + router_flops(n, dims.dim) if layer in counts else 0.0
        if layer in counts:
            forward += router
            if trainable != "projector":  # every mode but the dense reference trains the routers
                backward += router_flops(n, dims.dim)  # weight gradient, on the gated tokens
            if layer >= lowest:
                backward += router_flops(n, dims.dim)  # input gradient through the gate's logits
        lora = lora_layer_flops(dims, n, lora_rank, lora_targets) if trainable == "lora" else 0.0
        skipped_last = 0.0 if lora_last else -linear_flops(n, dims.mlp_hidden, dims.dim)
        forward += lora
        if layer < lowest:
            if gradient_checkpointing and layer in counts and trainable == "router" and layer == lowest - 1:
                # The lowest router's gradient unpacks the saved gate inputs: its layer reruns.
                recompute += block + router
            continue
        backward += (block - matmuls) + 2.0 * matmuls  # input gradients: linears once, matmuls twice
        backward += 2.0 * lora  # the adapters' input and weight gradients
        if trainable == "full":
            backward += block - matmuls  # weight gradients of every linear
        if gradient_checkpointing:
            recompute += block + lora + (router if layer in counts else skipped_last)
    head = linear_flops(n_tokens if head_tokens is None else head_tokens, dims.dim, dims.vocab)
    forward += head
    backward += head * (2.0 if trainable == "full" else 1.0)
    return {"forward": forward, "backward": backward, "recompute": recompute, "total": forward + backward + recompute}


def projector_flops(model: nn.Module, media_tokens: float, trains: bool = True) -> dict[str, float]:
    """FLOPs per sequence of a LLaVA projector's linears over `media_tokens` rows: {"forward",
    "backward"}. Where it trains, the backward is every linear's weight gradient and the input
    gradient of every linear but the first (the frozen vision tower below it needs none)."""
    root = getattr(model, "model", model)
    projector = getattr(root, "multi_modal_projector", None)
    linears = [m for m in projector.modules() if isinstance(m, nn.Linear)] if projector is not None else []
    each = [linear_flops(media_tokens, m.in_features, m.out_features) for m in linears]
    forward = sum(each)
    return {"forward": forward, "backward": 2.0 * forward - each[0] if trains and each else 0.0}


def media_tokens(model: nn.Module, inputs: Mapping[str, object]) -> float:
    """Image and video tokens per sequence of a collated batch, on average."""
    ids = inputs["input_ids"]
    media = torch.zeros_like(ids, dtype=torch.bool)
    for key in ("image_token_id", "video_token_id"):
        token = getattr(model.config, key, None)
        if token is not None:
            media |= ids == token
    return float(media.sum(1, dtype=torch.float64).mean())


def head_positions(keep: int | torch.Tensor | None, batch: int) -> float | None:
    """Positions per sequence the LM head runs on under transformers' `logits_to_keep` (None:
    every one): an int keeps the last `keep` (0: all), a 1D tensor those positions, a 2D integer
    tensor K positions a row, a 2D boolean mask its True ones (their mean over the rows)."""
    if keep is None or (isinstance(keep, int) and keep == 0):
        return None
    if isinstance(keep, int):
        return float(keep)
    if keep.dim() == 2 and keep.dtype == torch.bool:
        return float(keep.sum()) / batch
    return float(keep.shape[-1])


def training_flops(
    model: nn.Module,
    inputs: Mapping[str, object],
    trace: object | None = None,
    trainable: str = "full",
    *,
    lora_rank: int = 16,
    lora_targets: Sequence[str] = LORA_TARGETS,
    gradient_checkpointing: bool = False,
) -> dict[str, float]:
    """FLOPs per sequence of one training step of a LLaVA model on a collated batch: "vision"
    (the frozen tower's forward), "projector" (forward and, where it trains, backward),
    "forward", "backward", "recompute" and "total" (dense-mask attention) and "total_causal"
    (attention as a causal kernel computes it). `trace`: a `RoutingTrace` of a forward of this
    batch for a MoD model, None for a dense one. `inputs`: what the step's forward takes (its
    `logits_to_keep` decides where the LM head runs, `head_positions`). `model` may be wrapped by
    peft."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefill = generation_flops(base, inputs, trace)
    vision = prefill["vision"]
    projector = projector_flops(base, media_tokens(base, inputs), trains=trainable != "router")
    projector_step = projector["forward"] + projector["backward"]
    dims = DecoderDims.from_config(base.config.text_config)
    tokens = float(inputs["attention_mask"].sum(1, dtype=torch.float64).mean())
    counts = processed_counts(trace.processed if trace is not None else {}, "language")
    settings = dict(lora_rank=lora_rank, lora_targets=lora_targets, gradient_checkpointing=gradient_checkpointing)
    settings["head_tokens"] = head_positions(inputs.get("logits_to_keep"), inputs["input_ids"].shape[0])
    language = language_training_flops(dims, tokens, counts, trainable, **settings)
    causal = language_training_flops(dims, tokens, counts, trainable, causal=True, **settings)
    fixed = vision + projector_step
    return {
        "vision": vision,
        "projector": projector_step,
        "forward": vision + projector["forward"] + language["forward"],
        "backward": language["backward"] + projector["backward"],
        "recompute": language["recompute"],
        "total": fixed + language["total"],
        "total_causal": fixed + causal["total"],
    }


__all__ = [
    "LORA_TARGETS",
    "TRAINABLE_FLOPS",
    "language_training_flops",
    "head_positions",
    "media_tokens",
    "lora_layer_flops",
    "projector_flops",
    "training_flops",
]
