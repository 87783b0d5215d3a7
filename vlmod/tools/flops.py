"""Analytic FLOPs of transformer blocks, computed from token counts.

Why analytic: MoD changes how many tokens each layer runs, not what a layer does, so the
compute of a converted model follows from the per-layer token counts that
`vlmod.trace_routing` records. Counting from shapes gives the same number on every machine,
which makes "predicted speedup = dense FLOPs / MoD FLOPs" a fixed target to hold measured
speedups against (profiler FLOP counters miss fused SDPA kernels and differ between backends).

Conventions, shared by every function here so that dense and MoD numbers are comparable:

- A multiply-add counts as 2 FLOPs (the usual "2 * params * tokens" convention).
- Counted: every linear projection and the two attention matmuls (Q K^T and A V). Not counted:
  softmax, norms, activations, biases, residual adds, the MoD gate, gather and scatter. They are
  O(tokens * width) per layer against O(tokens * width^2) for the linears, under 1% of a ViT-B
  block, and they scale with the processed token count like the rest, so leaving them out does
  not move the speedup prediction.
- All counts are per sequence (per image for a ViT). Token counts may be fractional: a MoD layer's
  count is the batch mean of what the trace recorded.

`block_flops` is the one place the per-block arithmetic lives. It is general enough for a ViT
encoder block (`vit_flops`) and for a decoder layer of a LLaVA language backbone (grouped-query
attention, SwiGLU MLP, and a KV cache that makes the number of keys differ from the number of
queries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def linear_flops(n_tokens: float, d_in: int, d_out: int) -> float:
    """A `Linear(d_in, d_out)` applied to `n_tokens` tokens (bias ignored)."""
    return 2.0 * n_tokens * d_in * d_out


def attention_flops(
    n_query: float, n_key: float, dim: int, heads: int, kv_heads: int, head_dim: int
) -> float:
    """Self-attention of `n_query` new tokens over `n_key` keys: Q/K/V and output projections
    plus the score (Q K^T) and mixing (A V) matmuls.

    K and V are projected for the new tokens only (`n_query`): with a KV cache the other
    `n_key - n_query` keys were projected by an earlier forward, which is also why a MoD decoder
    layer that caches only its selected tokens gets cheaper attention at every later step.
    With grouped-query attention `kv_heads < heads` shrinks the K/V projections only; the score
    and mixing matmuls still run once per query head.
    """
    q_width = heads * head_dim
    kv_width = kv_heads * head_dim
    projections = (
        linear_flops(n_query, dim, q_width)  # Q
        + linear_flops(n_query, dim, 2 * kv_width)  # K and V
        + linear_flops(n_query, q_width, dim)  # output projection
    )
    scores = 2.0 * n_query * n_key * q_width  # Q K^T, all heads
    mixing = 2.0 * n_query * n_key * q_width  # softmax(QK^T) V, all heads
    return projections + scores + mixing


def mlp_flops(n_tokens: float, dim: int, mlp_hidden: int, gated_mlp: bool) -> float:
    """The block MLP: `dim -> mlp_hidden -> dim` (2 linears), or with a gated MLP (SwiGLU / GLU,
    as in Llama, Mistral, Qwen2) gate and up projections plus the down projection (3 linears)."""
    n_linears = 3 if gated_mlp else 2
    return n_linears * linear_flops(n_tokens, dim, mlp_hidden)


def block_flops(
    n_query: float,
    n_key: float,
    dim: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp_hidden: int,
    gated_mlp: bool,
) -> float:
    """FLOPs of one pre-norm transformer block (attention + MLP) for one sequence.

    n_query: tokens that run the block (all tokens of a dense layer, the selected ones of a MoD
        layer).
    n_key: keys each query attends to. Equal to `n_query` for a ViT block (selected tokens attend
        only to each other); the cached plus new length for a decoder step. For causal prefill
        pass the mean number of unmasked keys per query ((n + 1) / 2) to count only useful work,
        or `n` to count what a dense-mask kernel computes.
    dim: model width. heads / kv_heads / head_dim: attention geometry (kv_heads < heads for
        grouped-query attention; heads * head_dim may differ from dim).
    mlp_hidden: MLP hidden width (mlp_ratio * dim for a ViT, `intermediate_size` for Llama).
    gated_mlp: True for SwiGLU-style MLPs with a gate projection.
    """
    return attention_flops(n_query, n_key, dim, heads, kv_heads, head_dim) + mlp_flops(
        n_query, dim, mlp_hidden, gated_mlp
    )


def router_flops(n_tokens: float, dim: int) -> float:
    """The MoD router, `Linear(dim, 1)`, scores every token entering a MoD layer (selected or not):
    `dim` multiply-adds per token."""
    return linear_flops(n_tokens, dim, 1)


@dataclass(frozen=True)
class ViTDims:
    """The shapes of a ViT image encoder that its FLOPs depend on."""

    dim: int
    depth: int
    heads: int
    head_dim: int
    mlp_hidden: int
    num_patches: int
    num_prefix: int  # CLS / distillation / register tokens: always processed
    patch_dim: int  # in_chans * patch_h * patch_w: the patch embedding is Linear(patch_dim, dim)
    out_dim: int = 0  # output width of the final projection / classifier (0: none)
    gated_mlp: bool = False

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_patches

    @classmethod
    def from_model(cls, model: nn.Module) -> ViTDims:
        """Read the dimensions of a timm `VisionTransformer`, an open_clip `VisionTransformer` or
        an open_clip `CLIP` (its image tower)."""
        try:
            from timm.models.vision_transformer import VisionTransformer as TimmViT
        except ImportError:  # pragma: no cover - timm is a dependency
            TimmViT = ()  # noqa: N806
        if isinstance(model, TimmViT):
            return _timm_dims(model)
        visual = getattr(model, "visual", model)
        if hasattr(visual, "transformer") and hasattr(visual, "conv1"):
            return _open_clip_dims(visual)
        raise TypeError(
            f"cannot read ViT dimensions from a {type(model).__name__}; pass a vlmod.tools.flops.ViTDims "
            "or a timm / open_clip VisionTransformer"
        )


def _mlp_geometry(mlp: nn.Module, out_name: str) -> tuple[int, bool]:
    """(hidden width, gated) of a timm / open_clip MLP: the input width of its last linear; gated
    when its first linear is wider than that (timm GluMlp) or a separate gate exists (SwiGLU)."""
    out_linear = getattr(mlp, out_name)
    hidden = out_linear.in_features
    if hasattr(mlp, "fc1_g"):
        return hidden, True
    first = getattr(mlp, "fc1", None) or getattr(mlp, "c_fc", None)
    gated = first is not None and first.out_features == 2 * hidden
    return hidden, gated


def _timm_dims(model: nn.Module) -> ViTDims:
    block = model.blocks[0]
    attn = block.attn
    hidden, gated = _mlp_geometry(block.mlp, "fc2")
    proj = model.patch_embed.proj
    head = getattr(model, "head", None)
    return ViTDims(
        dim=model.embed_dim,
        depth=len(model.blocks),
        heads=attn.num_heads,
        head_dim=attn.head_dim,
        mlp_hidden=hidden,
        num_patches=model.patch_embed.num_patches,
        num_prefix=model.num_prefix_tokens,
        patch_dim=proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1],
        out_dim=head.out_features if isinstance(head, nn.Linear) else 0,
        gated_mlp=gated,
    )


def _open_clip_dims(visual: nn.Module) -> ViTDims:
    transformer = visual.transformer
    block = transformer.resblocks[0]
    heads = block.attn.num_heads
    hidden, gated = _mlp_geometry(block.mlp, "c_proj")
    conv = visual.conv1
    grid = visual.grid_size
    proj = getattr(visual, "proj", None)
    return ViTDims(
        dim=transformer.width,
        depth=len(transformer.resblocks),
        heads=heads,
        head_dim=transformer.width // heads,
        mlp_hidden=hidden,
        num_patches=grid[0] * grid[1],
        num_prefix=1,
        patch_dim=conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1],
        out_dim=proj.shape[1] if isinstance(proj, Tensor) else 0,
        gated_mlp=gated,
    )


def vit_block_flops(dims: ViTDims, n_tokens: float) -> float:
    """One ViT encoder block on `n_tokens` tokens that attend to each other."""
    return block_flops(
        n_tokens, n_tokens, dims.dim, dims.heads, dims.heads, dims.head_dim, dims.mlp_hidden, dims.gated_mlp
    )


def vit_flops(
    model_or_dims: nn.Module | ViTDims, processed_counts_per_layer: Mapping[int, float] | None = None
) -> float:
    """FLOPs per image of a ViT encoder: patch embedding, every block, the final projection.

    processed_counts_per_layer: {layer index: tokens processed per image} of the MoD layers (from
        `processed_counts(trace.processed)`); layers not named are dense and run all tokens. A MoD
        layer costs its block on the processed tokens plus its router on all tokens. None or {}
        gives the dense model.
    """
    dims = model_or_dims if isinstance(model_or_dims, ViTDims) else ViTDims.from_model(model_or_dims)
    counts = dict(processed_counts_per_layer or {})
    bad = [i for i in counts if not 0 <= i < dims.depth]
    if bad:
        raise ValueError(f"layer indices {bad} are out of range for a ViT with {dims.depth} blocks")
    n = dims.num_tokens
    total = linear_flops(dims.num_patches, dims.patch_dim, dims.dim)
    for layer in range(dims.depth):
        if layer in counts:
            total += vit_block_flops(dims, counts[layer]) + router_flops(n, dims.dim)
        else:
            total += vit_block_flops(dims, n)
    total += linear_flops(1, dims.dim, dims.out_dim)  # pooled token -> classes / embedding
    return total


def processed_counts(processed: Mapping[tuple[str, int], Tensor], part: str = "vision") -> dict[int, float]:
    """{layer index: mean tokens processed per sequence} of one part, from `trace.processed`
    ({(part, layer): BoolTensor[B, L]})."""
    return {
        layer: float(mask.sum(dim=1, dtype=torch.float64).mean())
        for (p, layer), mask in sorted(processed.items())
        if p == part
    }


@dataclass(frozen=True)
class DecoderDims:
    """The shapes of a LLaVA language backbone (Llama / Mistral / Qwen2) that FLOPs depend on."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab: int

    @classmethod
    def from_config(cls, config: object) -> DecoderDims:
        heads = config.num_attention_heads
        return cls(
            dim=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            mlp_hidden=config.intermediate_size,
            vocab=config.vocab_size,
        )


def decoder_layer_flops(dims: DecoderDims, n_query: float, n_key: float) -> float:
    """One decoder layer: `n_query` new tokens attending over `n_key` keys (cache included)."""
    return block_flops(
        n_query, n_key, dims.dim, dims.heads, dims.kv_heads, dims.head_dim, dims.mlp_hidden, gated_mlp=True
    )


def language_prefill_flops(
    dims: DecoderDims,
    n_tokens: float,
    processed_counts_per_layer: Mapping[int, float] | None = None,
    causal: bool = False,
) -> float:
    """FLOPs of a prefill of `n_tokens` tokens through the language backbone (the LM head on the
    last token only, as in generation). MoD layers run their processed tokens, which attend to each
    other only, plus the router on every token.

    causal: count only the attention scores a causal kernel computes (each of n queries sees
    (n + 1) / 2 keys on average) instead of the full n x n square a dense-mask kernel computes.
    The prefill kernels used in practice (sdpa with is_causal, flash) skip the masked half, and
    attention shrinks quadratically under MoD while the linears shrink linearly, so the full-square
    count overstates MoD's gain wherever attention is a large share of a layer (at width 512 and
    ~1190 tokens, ~28% of the counted FLOPs; at width 4096, ~5%)."""
    counts = dict(processed_counts_per_layer or {})

    def keys(n: float) -> float:
        return (n + 1) / 2 if causal else n

    total = 0.0
    for layer in range(dims.layers):
        if layer in counts:
            n = counts[layer]
            total += decoder_layer_flops(dims, n, keys(n)) + router_flops(n_tokens, dims.dim)
        else:
            total += decoder_layer_flops(dims, n_tokens, keys(n_tokens))
    return total + linear_flops(1, dims.dim, dims.vocab)


def _side(size: object) -> int:
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def hf_vision_dims(vision_config: object, num_patches: int | None = None) -> ViTDims:
    """ViTDims of a Hugging Face vision tower from its config: CLIP / SigLIP, InternViT (one class
    token), or a packed tower (Qwen) given the `num_patches` of one picture."""
    patch = _side(vision_config.patch_size)
    heads = getattr(vision_config, "num_attention_heads", None) or vision_config.num_heads
    if num_patches is None:
        num_patches = (_side(vision_config.image_size) // patch) ** 2
    channels = getattr(vision_config, "num_channels", None) or getattr(vision_config, "in_channels", 3)
    return ViTDims(
        dim=vision_config.hidden_size,
        depth=getattr(vision_config, "depth", None) or vision_config.num_hidden_layers,
        heads=heads,
        head_dim=vision_config.hidden_size // heads,
        mlp_hidden=vision_config.intermediate_size,
        num_patches=num_patches,
        num_prefix=1 if vision_config.model_type in ("clip_vision_model", "internvl_vision") else 0,
        patch_dim=channels * patch * patch * getattr(vision_config, "temporal_patch_size", 1),
    )


def vision_images(inputs: Mapping[str, object]) -> int:
    """How many pictures (images, anyres tiles, video frames) the vision tower encodes for a batch
    of processor outputs."""
    n = 0
    for key in ("pixel_values", "pixel_values_videos"):
        value = inputs.get(key)
        if isinstance(value, Tensor):
            n += value.shape[0] * (value.shape[1] if value.dim() == 5 else 1)
    return n


def frame_pooling_flops(model: nn.Module, inputs: Mapping[str, object]) -> float:
    """FLOPs of a learned frame pooling (LLaVA-NeXT-Video's `spatial_pool_mode="conv"`, a
    stride x stride convolution per frame) over a batch's video frames; 0 for the parameter-free
    average and max pools."""
    pool = getattr(getattr(getattr(model, "model", model), "vision_resampler", None), "pool", None)
    videos = inputs.get("pixel_values_videos")
    if not isinstance(pool, nn.Conv2d) or not isinstance(videos, Tensor):
        return 0.0
    cfg = model.config.vision_config
    side = _side(cfg.image_size) // _side(cfg.patch_size) // pool.stride[0]
    frames = videos.shape[0] * (videos.shape[1] if videos.dim() == 5 else 1)
    kernel = pool.in_channels * pool.kernel_size[0] * pool.kernel_size[1]
    return frames * linear_flops(side * side, kernel, pool.out_channels)


def generation_flops(model: nn.Module, inputs: Mapping[str, object], trace: object | None) -> dict[str, float]:
    """Prefill FLOPs per sequence of a LLaVA model on a batch of processor outputs: the vision
    tower (every picture, and a learned frame pooling) and the language backbone, counted as a dense-mask kernel computes
    attention ("language", "total") and as a causal kernel does ("language_causal",
    "total_causal"; see `language_prefill_flops`). `trace`: a `RoutingTrace` of that prefill for a
    MoD model, None for a dense one."""
    from vlmod.plugins import tower_patches

    batch = inputs["input_ids"].shape[0]
    processed = trace.processed if trace is not None else {}
    packed = tower_patches(model, inputs)
    if packed is None:  # every picture (image, tile, frame) the same patch grid
        vision = vit_flops(hf_vision_dims(model.config.vision_config), processed_counts(processed, "vision"))
        vision *= vision_images(inputs) / batch
    else:  # a packed tower (Qwen): each picture its own number of patches, never routed
        vision = sum(vit_flops(hf_vision_dims(model.config.vision_config, n)) for n in packed) / batch
    vision += frame_pooling_flops(model, inputs) / batch
    tokens = float(inputs["attention_mask"].sum(1, dtype=torch.float64).mean())
    dims = DecoderDims.from_config(model.config.text_config)
    counts = processed_counts(processed, "language")
    language = language_prefill_flops(dims, tokens, counts)
    causal = language_prefill_flops(dims, tokens, counts, causal=True)
    return {
        "vision": vision,
        "language": language,
        "total": vision + language,
        "language_causal": causal,
        "total_causal": vision + causal,
    }


def cls_attention_flops(dims: ViTDims, n_queries: int = 1) -> float:
    """Scoring a ViT's patches by the attention of its `n_queries` prefix (CLS) tokens in one layer,
    as pre-LLM reduction does: the query projection of those tokens, the key projection of every
    token, and the score matmul (per image)."""
    n = dims.num_tokens
    width = dims.heads * dims.head_dim
    return linear_flops(n_queries, dims.dim, width) + linear_flops(n, dims.dim, width) + 2.0 * n_queries * n * width


def attention_router_flops(dims: DecoderDims, n_tokens: float, n_queries: float) -> float:
    """The training-free attention router at one MoD decoder layer (`vlmod.routing.attention`):
    the key projection of every token, the query projection of the `n_queries` instruction tokens,
    and their scores over every key (per sequence)."""
    q_width = dims.heads * dims.head_dim
    kv_width = dims.kv_heads * dims.head_dim
    return (
        linear_flops(n_tokens, dims.dim, kv_width)
        + linear_flops(n_queries, dims.dim, q_width)
        + 2.0 * n_queries * n_tokens * q_width
    )
