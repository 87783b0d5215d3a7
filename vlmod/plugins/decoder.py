"""The language part of a Hugging Face vision-language model (LLaVA, Qwen2.5-VL, Qwen3-VL,
InternVL, Gemma 3): what their plugins share.

Their decoder layers take one call (`hidden_states, attention_mask, position_ids, past_key_values,
position_embeddings`), the language model sits at `model.model.language_model` and the image /
video placeholder ids in the top-level config, so one `DecoderAdapter` serves them all; a family
file says only what differs.

Token types are computed above the language model, in a pre-hook of the top-level model (which
sees `input_ids`, `labels`, the 2D attention mask and the cache), so `generate()` runs
unchanged. Each MoD decoder layer then gets the gathered hidden states with their original
position ids and RoPE cos/sin, and a mask of its own: causal by original position over the
tokens this layer processed, this layer's cached tokens included. A MoD layer's KV cache holds
only the tokens it processed.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import vlmod.plugins.hf_vision as hf_vision
from vlmod.config import MoDConfig, TokenType
from vlmod.plugins.base import PartSpec
from vlmod.plugins.calls import ArgSlot, cache_name, cache_of
from vlmod.plugins.features import FEATURES_ATTR, VISION_TYPES, count_features, uncount_features
from vlmod.plugins.key_slots import SlotMasks, cached_length, compiled_layer
from vlmod.routing import masks
from vlmod.routing.attention import AttentionQK
from vlmod.routing.layer import MoDPart
from vlmod.routing.selection import Selection, TokenLayout, routable_mask

IGNORE_INDEX = -100
def padding_of(mask: Tensor | None, length: int) -> Tensor | None:
    """[B, length] bool: which of the call's `length` tokens are padding, from the attention mask
    it was given: the usual 2D one ([B, cached + length], 0 on padding), or the 4D one generate
    builds for a compileable cache ([B, 1, length, keys], bool or additive), whose last query (a
    real token under left padding) sees every real key. None without a mask."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask[:, -length:] == 0
    if mask.dim() == 4:
        last = mask[:, 0, -1, -length:]
        return ~last if last.dtype == torch.bool else last != 0
    return None


def language_part(
    model: nn.Module,
    config: MoDConfig,
    family: str,
    adapter: DecoderAdapter | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
    dense_layers: tuple[int, ...] = (0,),
) -> PartSpec:
    """The PartSpec of `model.model.language_model`. `layer_types`: the attention kinds the
    adapter can route (others are a ValueError naming the layer). `dense_layers`: layers whose
    KV cache transformers reads to size masks and default positions for every layer."""
    lm = model.model.language_model
    for i, layer in enumerate(lm.layers):
        kind = _layer_type(lm, i, layer)
        if kind not in layer_types:
            raise ValueError(
                f"{family} language layer {i} uses {kind}; vlmod routes {' and '.join(layer_types)} layers only"
            )
    return PartSpec(
        name="language",
        family=family,
        root=lm,
        entry=model,
        blocks=lm.layers,
        dim=lm.config.hidden_size,
        adapter=adapter or DecoderAdapter(model, type(lm.layers[0]), config),
        dense_layers=dense_layers,
    )


def _layer_type(lm: nn.Module, index: int, layer: nn.Module) -> str:
    types = getattr(lm.config, "layer_types", None)
    if types:
        return types[index]
    return getattr(layer, "attention_type", "full_attention")


def vision_part(model: nn.Module, config: MoDConfig, family: str, why_not: str | None = None) -> PartSpec:
    """The vision tower as a plain ViT (the Hugging Face vision plugin), or a ValueError saying
    why this family's tower cannot be routed."""
    tower = model.model.vision_tower if hasattr(model.model, "vision_tower") else model.model.visual
    if why_not is None and hf_vision.matches(tower):
        return hf_vision.part_spec(tower, "vision", config)
    reason = why_not or f"its vision tower is a {type(tower).__name__}, not a CLIP / SigLIP tower"
    raise ValueError(f"vlmod cannot route the {family} vision tower: {reason}; convert part='language'")


def check_part(model: nn.Module, part: str | None) -> str:
    part = part or "language"
    if part not in ("language", "vision"):
        raise ValueError(f"part must be 'language' or 'vision' for {type(model).__name__}, got {part!r}")
    return part


@dataclass
class _Batch:
    """What the current forward's MoD layers share."""

    layout: TokenLayout
    past: int = 0  # tokens cached before this forward: positions[b, i] = past + i
    # The layout's padding and routable count are settled at the first MoD layer, from the mask
    # transformers hands it (a batch of one, budgets from shapes: no host sync).
    settle: bool = False
    compiled: bool = False  # a decode step on a compiled cache (`vlmod.compile`)
    # RoPE (cos, sin) of this forward joined into one tensor, by id of cos (Gemma 3 has two).
    rope: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    masks: dict[tuple, Any] = field(default_factory=dict)  # masks shared by this forward's layers
    _positions: Tensor | None = None

    @property
    def positions(self) -> Tensor:
        """[B, L] absolute index in the (padded) sequence: orders keys causally (one arange per
        forward, on first use)."""
        if self._positions is None:
            batch, length = self.layout.shape
            device = self.layout.routable.device
            self._positions = torch.arange(self.past, self.past + length, device=device).expand(batch, length)
        return self._positions


class DecoderAdapter(SlotMasks):
    """Calls a decoder layer of a vision-language model on the routed tokens."""

    def __init__(self, model: nn.Module, layer_cls: type, config: MoDConfig):
        self.model = model
        self.config = config
        self.text_config = model.model.language_model.config
        self.image_token_id = getattr(model.config, "image_token_id", None)
        self.video_token_id = getattr(model.config, "video_token_id", None)
        fwd = layer_cls.forward
        self.mask_arg = ArgSlot(fwd, "attention_mask")
        self.position_ids_arg = ArgSlot(fwd, "position_ids")
        self.rope_arg = ArgSlot(fwd, "position_embeddings")
        self.cache_arg = ArgSlot(fwd, cache_name(fwd))
        self.entry_params = [
            p for p in inspect.signature(type(model).forward).parameters if p != "self"
        ]
        self.batch: _Batch | None = None
        # Per MoD layer: absolute positions and validity of the slots in its KV cache.
        self.cache_slots: dict[int, Any] = {}
        self.capacities: dict[int, float] = {}  # of the MoD layers, set by each forward

    def install(self) -> None:
        """Called by `apply_mod` once the part is converted (and `uninstall` by `remove_mod`)."""
        count_features(self.model.model)

    def uninstall(self) -> None:
        uncount_features(self.model.model)

    # -- token types, once per forward -------------------------------------------------------

    def token_types(self, kwargs: dict, past_length: int) -> Tensor:
        input_ids = kwargs.get("input_ids")
        embeds = kwargs.get("inputs_embeds")
        if input_ids is not None:
            is_image = input_ids == self.image_token_id
            is_video = input_ids == self.video_token_id if self.video_token_id is not None else None
            ref = input_ids
        elif embeds is not None:
            table = self.model.get_input_embeddings()
            is_image = self._matches_token(embeds, table, self.image_token_id)
            is_video = self._matches_token(embeds, table, self.video_token_id)
            ref = embeds[..., 0]
        else:
            raise ValueError("the model was called with neither input_ids nor inputs_embeds")
        batch, length = ref.shape
        text = TokenType.RESPONSE if past_length > 0 else TokenType.INSTRUCTION
        types = torch.full((batch, length), int(text), dtype=torch.long, device=ref.device)
        labels = kwargs.get("labels")
        if labels is not None and past_length == 0:
            if labels.shape != (batch, length):
                raise ValueError(
                    f"labels have shape {tuple(labels.shape)} but the inputs have {(batch, length)}; "
                    "give one label per input token (-100 where no loss is wanted)"
                )
            types = torch.where(labels.to(ref.device) != IGNORE_INDEX, int(TokenType.RESPONSE), types)
        types = types.masked_fill(is_image, int(TokenType.IMAGE))
        if is_video is not None:
            types = types.masked_fill(is_video, int(TokenType.VIDEO))
        padding = padding_of(kwargs.get("attention_mask"), length)
        if padding is not None:
            types = types.masked_fill(padding.to(ref.device), int(TokenType.PADDING))
        return types

    @staticmethod
    def _matches_token(embeds: Tensor, table: nn.Module, token_id: int | None) -> Tensor | None:
        if token_id is None:
            return None
        # torch.full fills on the device; torch.tensor(token_id, device=...) would copy from the host.
        ref = table(torch.full((), token_id, dtype=torch.long, device=embeds.device)).to(embeds.dtype)
        return (embeds == ref).all(-1)

    def begin_forward(self, part: MoDPart, args: tuple, kwargs: dict) -> None:
        self.capacities = part.capacities
        if args:
            kwargs = {**dict(zip(self.entry_params, args, strict=False)), **kwargs}
        cache = cache_of(kwargs)
        input_ids = kwargs.get("input_ids")
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        query_length = ref.shape[1] if ref is not None else 0
        past_length = cached_length(cache, 0, query_length)
        if past_length is None:
            # A decode step on a compiled cache: nothing here may read the device-side length
            # (or branch on a number that changes every step, which would recompile).
            self.batch = _Batch(layout=self._decode_layout(kwargs, part.config.routable_types, 1), past=1, compiled=True)
            return
        routable = part.config.routable_types
        decoding = past_length > 0
        if decoding and TokenType.RESPONSE in routable and part.config.aux_loss != "bce":
            # A decode token cannot be ranked against tokens not yet generated: without the
            # causal predictor it always runs.
            routable = tuple(t for t in routable if t != TokenType.RESPONSE)
        threshold = decoding and TokenType.RESPONSE in routable
        tally = getattr(self.model.model, FEATURES_ATTR, None)
        if tally is not None:
            tally.reset()
        if input_ids is None or "token_types" in self.__dict__ or not set(routable) <= VISION_TYPES:
            # Text types are routable, or the types come from embeddings (or a caller's own rule):
            # the general path, with every type computed now and one host sync for the budgets.
            types = self.token_types(kwargs, past_length)
            if decoding and not threshold and types.shape[1] == 1:
                layout = TokenLayout.all_processed(types, routable_mask(types, routable))
            else:
                layout = TokenLayout.from_types(types, routable, () if threshold else part.capacities.values())
                layout.threshold = threshold
            self.batch = _Batch(layout=layout, past=past_length)
            return
        # Image / video tokens are the routable ones: they follow from the ids alone, and the
        # rest (types for a trace, padding, counts) is computed only if something asks for it.
        mask = kwargs.get("attention_mask")
        length = input_ids.shape[1]

        def types() -> Tensor:
            return self.token_types(kwargs, past_length)

        def padding() -> Tensor | None:
            found = padding_of(mask, length)
            return None if found is None else found.to(input_ids.device)

        if decoding and input_ids.shape[1] == 1:
            self.batch = _Batch(layout=self._decode_layout(kwargs, routable, past_length), past=past_length)
            return
        layout = TokenLayout(self._vision_tokens(input_ids, routable), types, padding=padding)
        settle = input_ids.shape[0] == 1 and not past_length
        if not settle:
            layout.prepare(part.capacities.values())  # one host sync, before the tower runs
        self.batch = _Batch(layout=layout, past=past_length, settle=settle)

    def _decode_layout(self, kwargs: dict, routable: tuple[TokenType, ...], past_length: int) -> TokenLayout:
        """A decode step of generate: one new, real token per row, which runs every layer; its types
        computed only if something (a trace) asks."""
        input_ids = kwargs["input_ids"]
        return TokenLayout.all_processed(
            lambda: self.token_types(kwargs, past_length),
            lambda: self._vision_tokens(input_ids, routable),
            tuple(input_ids.shape),
            input_ids.device,
        )

    def _vision_tokens(self, input_ids: Tensor, routable: tuple[TokenType, ...]) -> Tensor:
        """[B, L] bool: the image / video placeholders among `routable` types (an `==` each)."""
        hit = None
        for t, token_id in ((TokenType.IMAGE, self.image_token_id), (TokenType.VIDEO, self.video_token_id)):
            if t in routable and token_id is not None:
                is_t = input_ids == token_id
                hit = is_t if hit is None else hit | is_t
        return torch.zeros_like(input_ids, dtype=torch.bool) if hit is None else hit

    def _settle(self, part: MoDPart, args: tuple, kwargs: dict) -> None:
        """At the first MoD layer of a batch of one, its budgets from shapes (no host sync): the
        routable count is the number of vision features the model merged. transformers passes no
        mask exactly when the batch has no padding (sdpa, flash): then nothing more is needed.
        With a mask (eager, under torch.compile, or real padding) any padding runs as filler
        slots that nothing attends to (`TokenLayout.padding_as_filler`)."""
        batch = self.batch
        batch.settle = False
        tally = getattr(self.model.model, FEATURES_ATTR, None)
        if batch.past or tally is None or not tally.seen:
            return  # budgets by reading the types (one host sync)
        layout = batch.layout
        if self.mask_arg.get(args, kwargs) is None and self.text_config._attn_implementation != "eager":
            layout.no_padding()
        else:
            layout.padding_as_filler = True
        layout.routable_count = tally.routable(part.config.routable_types)

    def end_forward(self, part: MoDPart, output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if loss is not None and part.config.aux_loss and part.aux_losses:
            aux = torch.stack(list(part.aux_losses.values())).mean()
            output["loss"] = loss + part.config.aux_loss_weight * aux.to(loss.dtype)
        return output

    # -- per layer ---------------------------------------------------------------------------

    def hidden_states(self, args: tuple, kwargs: dict) -> Tensor:
        return args[0] if args else kwargs["hidden_states"]

    def layout(self, part: MoDPart, x: Tensor, args: tuple, kwargs: dict) -> TokenLayout:
        if self.batch is None or self.batch.layout.shape != tuple(x.shape[:2]):
            raise RuntimeError(
                "MoD language layers need the token types computed by the top-level model: call the "
                f"{type(self.model).__name__} itself (or generate), not its inner language model"
            )
        if self.batch.settle:
            self._settle(part, args, kwargs)
        return self.batch.layout

    def run(
        self, upstream: Callable, x_sel: Tensor, sel: Selection, args: tuple, kwargs: dict, layer_idx: int
    ) -> Tensor:
        if sel.index is None and self.batch.layout.every_token and not self.own_keys:
            return self._run_decode_step(upstream, x_sel, args, kwargs, layer_idx)
        args, kwargs = list(args), dict(kwargs)
        if args:
            args[0] = x_sel
        else:
            kwargs["hidden_states"] = x_sel
        if sel.index is not None:  # every token runs (a decode step): positions stay as they are
            # `gather` takes the [1, L] / [1, L, d] tensors shared by every row as they are.
            position_ids = self.position_ids_arg.get(args, kwargs)
            if position_ids is not None:
                self.position_ids_arg.set(args, kwargs, sel.gather(position_ids))
            rope = self.rope_arg.get(args, kwargs)
            if rope is not None:
                self.rope_arg.set(args, kwargs, self._gather_rope(rope, sel))
            # positions[b, i] = past + i: the selected ones are the index itself, shifted.
            past = self.batch.past
            query_pos = sel.index if past == 0 else sel.index + past
        else:
            query_pos = self.batch.positions
        cache = self.cache_arg.get(args, kwargs)
        if self.own_keys:
            mask = self._keys_then_mask(layer_idx, cache, query_pos, sel.valid, x_sel.dtype)
        else:
            mask = self._slot_mask(layer_idx, cache, query_pos, sel.valid, x_sel.dtype)
        self.mask_arg.set(args, kwargs, mask)
        return upstream(*args, **kwargs)

    def _gather_rope(self, rope: tuple[Tensor, Tensor], sel: Selection) -> tuple[Tensor, Tensor]:
        """RoPE (cos, sin) of the selected tokens: one gather of both, joined once per forward
        (every layer of a forward gets the same pair)."""
        if len(rope) != 2 or rope[0].shape != rope[1].shape or torch.compiler.is_compiling():
            # (Compiled, the gathers fuse anyway, and a cache keyed by tensor would be a guard.)
            return tuple(sel.gather(t) for t in rope)  # type: ignore[return-value]
        cos, sin = rope
        joined = self.batch.rope.get(id(cos))
        if joined is None or joined[0] is not cos:
            joined = self.batch.rope[id(cos)] = (cos, torch.cat([cos, sin], dim=-1))
        both = sel.gather(joined[1])
        d = cos.shape[-1]
        return both[..., :d], both[..., d:]

    def _run_decode_step(self, upstream: Callable, x: Tensor, args: tuple, kwargs: dict, layer_idx: int) -> Tensor:
        """A decode step of generate (one new token per row, which runs): the states, positions and
        RoPE are the block's own, and unless the cache holds filler slots (a batch whose rows
        processed different numbers of tokens) the one query sees every cached key, so no mask.
        Only the key-slot record grows, by a reference. This path runs per MoD layer and token, so
        it does no more than that: every operation here costs as much as a small tensor op."""
        cache = self.cache_arg.get(args, kwargs)
        if self.batch.compiled:
            # Layers of one capacity hold as many slots, valid alike: one mask for all of them.
            layer = compiled_layer(cache, layer_idx)
            key = ("compiled", self.capacities.get(layer_idx), layer.max_cache_len)
            mask = self._shared_mask(key, layer.decode_mask)
            if self.text_config._attn_implementation == "eager":
                mask = self._shared_mask((*key, "eager"), lambda: masks.additive(mask, x.dtype))
            args, kwargs = list(args), dict(kwargs)
            self.mask_arg.set(args, kwargs, mask)
            return upstream(*args, **kwargs)
        slots = self.cache_slots.get(layer_idx)
        if slots is None or cache.get_seq_length(layer_idx) != slots.length:
            # A cache vlmod did not fill in step: the general path (which says what went wrong).
            mask = self._slot_mask(layer_idx, cache, self.batch.positions, None, x.dtype)
        else:
            mask = self._decode_mask(slots, x.dtype) if slots.with_filler else None
            slots.append_range(self.batch.past, 1, x.shape[0], x.device)
        if mask is None and self.mask_arg.get(args, kwargs) is None:
            return upstream(*args, **kwargs)
        args, kwargs = list(args), dict(kwargs)
        self.mask_arg.set(args, kwargs, mask)
        return upstream(*args, **kwargs)

    def output(self, out: Tensor, args: tuple, kwargs: dict) -> Any:
        return out

    # -- the attention router: instruction tokens are the queries ------------------------------

    def check_attention_router(self, blocks: list[nn.Module]) -> None:
        for block in blocks:
            attn = getattr(block, "self_attn", None)
            needed = ("q_proj", "k_proj", "head_dim", "scaling")
            if not hasattr(block, "input_layernorm") or not all(hasattr(attn, a) for a in needed):
                raise ValueError(
                    f"the attention router cannot score a {type(block).__name__}: expected "
                    "input_layernorm -> self_attn with q_proj / k_proj"
                )
            if not callable(getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)):
                raise ValueError(f"the attention router found no apply_rotary_pos_emb next to {type(attn).__name__}")

    def attention_qk(
        self, block: nn.Module, x: Tensor, query_index: Tensor, args: tuple, kwargs: dict
    ) -> AttentionQK:
        """The decoder layer runs self_attn(input_layernorm(x)) with RoPE from the position
        embeddings it was given; the upstream module's own apply_rotary_pos_emb rotates q and k."""
        attn = block.self_attn
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        batch, length = x.shape[:2]
        t = query_index.shape[1]
        rope = self.rope_arg.get(args, kwargs)
        if rope is None:
            raise ValueError("the attention router needs the position embeddings (cos, sin) the layer receives")
        h = block.input_layernorm(x)
        rows = self._shared_mask(("attention rows", batch), lambda: torch.arange(batch, device=x.device).unsqueeze(1))
        q = attn.q_proj(h[rows, query_index]).view(batch, t, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, length, -1, attn.head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 / Gemma 3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        heads, kv_heads = q.shape[1], k.shape[1]
        groups = heads // kv_heads
        # Upstream's RoPE rotates a (q, k) pair at one set of positions; ours sit at two. So q, its
        # heads grouped by key head (transformers' repeat_kv order), and k go through it as one
        # sequence with cos / sin at each of its tokens' positions (built once a forward for every
        # layer given these embeddings): one call.
        cos, sin = self._shared_mask(("attention rope", id(rope[0]), id(query_index), groups),
                                     lambda: _joint_rope(rope, query_index, rows, groups))
        joint = torch.cat((q.reshape(batch, kv_heads, groups * t, attn.head_dim), k), dim=2)
        joint = rotate(joint, joint[:, :1], cos, sin)[0]  # the second: one key head's worth, discarded
        q = joint[:, :, : groups * t].unflatten(2, (groups, t))  # views of the one rotated tensor
        k = joint[:, :, groups * t :]
        return AttentionQK(q=q, k=k, scale=attn.scaling, causal=True)


def _joint_rope(rope: tuple[Tensor, Tensor], query_index: Tensor, rows: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """cos and sin [B, G * T + L, d] for the query tokens at `query_index` [B, T], repeated for the
    G query heads of a key head, then every token."""
    batch = query_index.shape[0]
    full = [r.expand(batch, *r.shape[1:]) for r in rope]
    return tuple(torch.cat((r[rows, query_index].repeat(1, groups, 1), r), dim=1) for r in full)
