"""Packed selections on the CPU: a batch's processed tokens in one sequence with a materialised
block-diagonal mask compute what the padded path computes."""

from __future__ import annotations

import pytest
import timm
import torch
from helpers.inputs import anyres_inputs

import vlmod
from vlmod.models import tiny
from vlmod.routing.layer import upstream_class
from vlmod.routing.masks import additive, block_diagonal
from vlmod.tools.packing import Packing


def test_pack_unpack_and_the_block_diagonal_causal_mask():
    valid = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    p = Packing.of(valid, (3, 3))
    assert p.seqlens == [3, 1, 2] and p.total == 6
    assert p.cu_seqlens().tolist() == [0, 3, 4, 6] and p.cu_seqlens().dtype == torch.int32
    x = torch.arange(18.0).view(3, 3, 2)
    packed = p.pack(x)
    assert packed.shape == (1, 6, 2)
    assert packed[0, :, 0].tolist() == [0, 2, 4, 6, 12, 14]
    fill = torch.full_like(x, -1.0)
    back = p.unpack(packed, fill)
    assert torch.equal(back[valid], x[valid]) and (back[~valid] == -1).all()
    assert p.pack(torch.ones(1, 3, 2)).shape == (1, 6, 2)  # shared by every row (RoPE of one row)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(p.mask()[0, 0], expected)
    # by original positions (the same order here), and without causality: whole blocks
    positions = torch.tensor([[3, 5, 9], [7, 0, 0], [2, 4, 0]])
    assert torch.equal(p.mask(positions)[0, 0], expected)
    blocks = p.mask(causal=False)[0, 0]
    assert torch.equal(blocks, p.rows[:, None] == p.rows[None, :])
    # cached keys of each row before its queries: a decode step of rows 0 and 2 sees its own row only
    keys = block_diagonal(torch.tensor([0, 2]), p.rows, torch.tensor([10, 10]), p.pack(positions)[0])
    assert keys[0, 0].tolist() == [[True] * 3 + [False] * 3, [False] * 4 + [True] * 2]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_decoder_layer_matches_the_padded_path(attn):
    """The upstream decoder layer of a MoD layer, on the tokens the padded path gave it: packed
    into one sequence with a block-diagonal causal mask, every processed token comes out as it
    does padded."""
    model, processor = tiny.build("llava_next", attn_implementation=attn)
    # Anyres images of different sizes: rows keep different numbers of tokens, so the padded
    # selection has filler slots, the case packing removes.
    inputs = anyres_inputs(processor, "llava_next")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5))
    seen: dict = {}
    for i in (1, 3):
        block = model.model.language_model.layers[i]
        block.input_layernorm.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("x", i), a[0]))
        block.self_attn.register_forward_pre_hook(lambda m, a, kw, i=i: seen.__setitem__(("attn", i), kw), with_kwargs=True)
    with torch.no_grad(), vlmod.trace_routing(model) as trace:
        model(**inputs, use_cache=False)
    for i in (1, 3):
        block = model.model.language_model.layers[i]
        forward = upstream_class(type(block)).forward
        x, kw = seen["x", i], seen["attn", i]
        mask, rope = kw["attention_mask"], kw["position_embeddings"]
        counts = trace.processed[("language", i)].sum(1)
        assert counts.unique().numel() > 1  # rows of different lengths: filler slots in the padded path
        valid = torch.arange(x.shape[1])[None, :] < counts[:, None]  # processed slots come first
        with torch.no_grad():
            padded = forward(block, x, attention_mask=mask, position_embeddings=rope, use_cache=False)
            p = Packing.of(valid, tuple(x.shape[:2]))
            assert p.total == int(counts.sum()) < x.shape[0] * x.shape[1]
            packed_mask = p.mask() if attn == "sdpa" else additive(p.mask(), x.dtype)
            packed = forward(
                block, p.pack(x), attention_mask=packed_mask,
                position_embeddings=tuple(p.pack(t) for t in rope), use_cache=False,
            )
        got = p.unpack(packed, padded)
        if attn == "eager":  # the same sums in the same order: bit for bit
            assert torch.equal(got, padded), i
        else:  # sdpa's CPU kernel blocks a longer sequence differently: a few float32 roundings
            err = ((got - padded).abs().max() / padded[valid].abs().max()).item()
            assert err <= 1e-6, (i, err)


def test_packed_vit_block_matches_each_row_alone():
    """A ViT block (plain attention) on rows keeping different numbers of tokens (per-sample
    capacity): packed with a block-diagonal mask, each row is what the block gives that row alone."""
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=64).eval()
    block = vit.blocks[3]
    x = torch.randn(3, 17, vit.embed_dim)
    valid = torch.arange(17)[None, :] < torch.tensor([17, 9, 5])[:, None]
    p = Packing.of(valid, (3, 17))
    with torch.no_grad():
        packed = p.unpack(block(p.pack(x), attn_mask=p.mask(causal=False)[0]), torch.zeros_like(x))
        for b, n in enumerate(p.seqlens):
            alone = block(x[b : b + 1, :n])
            assert ((packed[b, :n] - alone[0]).abs().max() / alone.abs().max()).item() <= 1e-6
