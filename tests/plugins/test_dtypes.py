"""bfloat16 and float16 on the CPU: a fresh conversion at capacity 1.0 is the unmodified model in
its own dtype (logits to the dtype's tolerance, the same greedy tokens), the router logits and the
gate offset are float32, and the tokens a block runs on keep the model's dtype (nothing upcast on
the way in or out)."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers.inputs import padded_batch

import vlmod
from vlmod.models import tiny
from vlmod.routing.router import Router, gate_offset, gated_decode_step, gated_residual

DTYPES = [torch.bfloat16, torch.float16]
GENERATE = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)


def _missing_cpu_kernels(dtype: torch.dtype) -> str | None:
    """Why this dtype cannot run the tiny models on this CPU, or None when it can."""
    x = torch.randn(1, 2, 4, 8).to(dtype)
    try:
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        F.gelu(F.layer_norm(F.linear(x, torch.ones(8, 8, dtype=dtype)), (8,)))
        F.conv2d(torch.randn(1, 3, 8, 8).to(dtype), torch.randn(4, 3, 4, 4).to(dtype), stride=4)
    except (RuntimeError, NotImplementedError) as exc:
        return f"{dtype} has no CPU kernel here: {str(exc).splitlines()[0]}"
    return None


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    reason = _missing_cpu_kernels(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def _tolerance(dtype: torch.dtype) -> float:
    # Padded rows are gathered (real tokens first), so the attention kernel sums the same terms
    # in another blocking: a rounding of the dtype apart, never more.
    return 2 * torch.finfo(dtype).eps


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _inputs(processor, family: str, dtype: torch.dtype) -> dict:
    """The shared padded batch (left padding), its pixels in the model's dtype."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in padded_batch(processor, family).items()}


def _randomise_routers(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mod_router" in name and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 4 / math.sqrt(p.shape[1]))


@pytest.mark.parametrize("family", ["llava", "llava_next_video"])
def test_capacity_one_is_the_upstream_model_in_its_dtype(family, dtype):
    model, processor = tiny.build(family)
    model = model.to(dtype)
    inputs = _inputs(processor, family, dtype)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=1.0, layers="all"), part="vision")
    assert {p.dtype for p in mod.parameters()} == {dtype}  # routers made in the model's dtype
    with torch.inference_mode():
        expected = model(**inputs).logits
        got = mod(**inputs).logits
        assert got.dtype == expected.dtype == dtype
        real = inputs["attention_mask"].bool()
        assert _rel_err(got[real], expected[real]) <= _tolerance(dtype)
        assert torch.equal(mod.generate(**inputs, **GENERATE), model.generate(**inputs, **GENERATE))


def _vit(dtype: torch.dtype) -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=64).eval().to(dtype)


def test_vit_capacity_one_is_the_upstream_model_in_its_dtype(dtype):
    model = _vit(dtype)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    x = torch.randn(2, 3, 64, 64).to(dtype)
    with torch.inference_mode():
        expected, got = model(x), mod(x)
    assert got.dtype == dtype
    assert _rel_err(got, expected) <= _tolerance(dtype)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_vit_ranks_float32_router_logits_and_keeps_the_block_dtype(dtype):
    """At capacity 0.5 the top-k runs on float32 logits of the layer's input, the block runs on
    gathered tokens of the model's dtype and returns that dtype."""
    mod = vlmod.apply_mod(_vit(dtype), vlmod.MoDConfig(capacity=0.5, layers=[2, 5]))
    _randomise_routers(mod)
    seen: dict = {}
    for i in (2, 5):
        block = mod.blocks[i]
        block.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("in", i), a[0]))
        block.norm1.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("block", i), a[0]))
        block.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("out", i), out))
    x = torch.randn(2, 3, 64, 64).to(dtype)
    with torch.inference_mode(), vlmod.trace_routing(mod) as trace:
        mod(x)
    router = mod.mod_router
    for i in (2, 5):
        scores, processed = trace.scores[("vision", i)], trace.processed[("vision", i)]
        assert scores.dtype == torch.float32
        assert torch.equal(scores, F.linear(seen["in", i].float(), router.weight.float(), router.bias.float())[..., 0])
        patches, kept = scores[:, 1:], processed[:, 1:]
        assert kept.sum(1).tolist() == [8, 8]
        for b in range(2):
            assert patches[b][kept[b]].min() > patches[b][~kept[b]].max()
        assert seen["block", i].dtype == dtype and seen["block", i].shape[1] == 1 + 8  # gathered, not upcast
        assert seen["out", i].dtype == dtype


def test_llava_blocks_receive_and_return_the_model_dtype(dtype):
    """Language and vision MoD layers at capacity 0.5 with non-zero routers (gate != 1): what the
    upstream block receives and what the layer returns keep the model's dtype; scores are float32;
    a training step gives the routers a gradient in their own dtype."""
    model, processor = tiny.build("llava")
    model = model.to(dtype)
    inputs = _inputs(processor, "llava", dtype)
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1, 3]))
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[0]), part="vision")
    _randomise_routers(model)
    blocks = {
        ("language", i): (model.model.language_model.layers[i], "input_layernorm") for i in (1, 3)
    } | {("vision", 0): (model.model.vision_tower.encoder.layers[0], "layer_norm1")}
    seen: dict = {}
    for key, (block, first) in blocks.items():
        getattr(block, first).register_forward_pre_hook(lambda m, a, key=key: seen.__setitem__(("block", key), a[0]))
        block.register_forward_pre_hook(
            lambda m, a, kw, key=key: seen.__setitem__(("in", key), a[0] if a else kw["hidden_states"]), with_kwargs=True
        )
        block.register_forward_hook(
            lambda m, a, out, key=key: seen.__setitem__(("out", key), out[0] if isinstance(out, tuple) else out)
        )
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    with vlmod.trace_routing(model) as trace:
        out = model(**inputs, labels=labels)
    for key in blocks:
        assert trace.scores[key].dtype == torch.float32
        assert seen["block", key].dtype == dtype, key
        assert seen["block", key].shape[1] < seen["in", key].shape[1], key  # the gathered tokens
        assert seen["out", key].dtype == dtype, key
    assert out.logits.dtype == dtype
    out.loss.backward()
    for name, p in model.named_parameters():
        if "mod_router" in name and name.endswith("weight"):
            assert p.grad is not None and p.grad.dtype == dtype and p.grad.abs().sum() > 0, name


def test_router_logits_are_float32_from_low_precision_weights_and_under_autocast():
    torch.manual_seed(0)
    router = Router(64, dtype=torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.fill_(0.3)
    x = torch.randn(2, 7, 64).to(torch.bfloat16)
    expected = F.linear(x.float(), router.weight.float(), router.bias.float())[..., 0]
    assert torch.equal(router(x), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(router(x), expected)
        assert torch.equal(Router(64)(x.float()), torch.zeros(2, 7))  # an fp32 router too
    # Logits that differ below bfloat16's resolution (64 vs 64 + 2^-7) would tie in bfloat16; in
    # float32 the second token ranks first.
    with torch.no_grad():
        router.weight.fill_(1.0)
        router.bias.zero_()
    x = torch.ones(1, 2, 64, dtype=torch.bfloat16)
    x[0, 1, 0] = 1 + 2**-7
    logits = router(x)
    assert logits[0, 1] > logits[0, 0] and logits[0].argmax() == 1
    assert logits.to(torch.bfloat16)[0, 0] == logits.to(torch.bfloat16)[0, 1]


@pytest.mark.parametrize("kind, alpha", [("tanh", 0.2), ("sigmoid", 0.2)])
def test_gate_offset_is_float32_and_keeps_small_gates(kind, alpha, dtype):
    x = torch.tensor([[[-7.0, 3.0, 0.5, -1.0]]]).to(dtype)
    y = torch.tensor([[[1.0, -2.0, 0.25, 4.0]]]).to(dtype)
    # A gate 1 + 0.0035 (tanh) or 1 + 0.00875 (sigmoid): in bfloat16, g itself would round to 1.
    r = torch.tensor([[0.0175]], dtype=dtype)
    offset = gate_offset(r, kind, alpha)
    assert offset.dtype == torch.float32
    out = gated_residual(x, y, r, kind, alpha)
    assert out.dtype == dtype
    g = 1 + (alpha * math.tanh(0.0175) if kind == "tanh" else math.tanh(0.5 * 0.0175))
    ref = x.double() + g * (y.double() - x.double())
    ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(2**-6)
    assert ((out.double() - ref).abs() <= ulp).all(), (out, ref)
    # g == 1 (a fresh router) gives y bit for bit, in the dtype of y
    assert torch.equal(gated_residual(x, y, torch.zeros(1, 1, dtype=dtype), kind, alpha), y)


@pytest.mark.parametrize("kind", ["tanh", "sigmoid", "none"])
def test_decode_step_gate_is_the_general_gate(kind, dtype):
    """The decode step's gate (float32 + tanh in four ops; anything else through the helpers) gives
    the numbers of router.logits + gated_residual, bit for bit, also under autocast."""
    torch.manual_seed(0)
    router = Router(16).to(dtype)
    torch.nn.init.normal_(router.weight)
    x, y = torch.randn(3, 1, 16).to(dtype), torch.randn(3, 1, 16).to(dtype)
    logits = router.logits(x)
    out, step_logits = gated_decode_step(router, x, y, kind, 0.2)
    assert torch.equal(step_logits, logits) and step_logits.shape == (3, 1, 1)
    assert torch.equal(out, gated_residual(x, y, logits, kind, 0.2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_autocast, logits_autocast = gated_decode_step(router, x, y, kind, 0.2)
    assert logits_autocast.dtype == torch.float32 and torch.equal(logits_autocast, logits)
    assert torch.equal(out_autocast, out)
