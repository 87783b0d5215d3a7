"""Router kinds on real (tiny) models: counts and protection for every kind, inverted vs learned,
the attention router against the upstream attention map, capacity-1 identity, set_router."""

from __future__ import annotations

import copy
import functools
import json
import math

import numpy as np
import open_clip
import pytest
import timm
import torch
from helpers.inputs import anyres_inputs, chat_prompt
from PIL import Image
from torch import nn

import vlmod
from vlmod import TokenType
from vlmod.config import ROUTERS
from vlmod.models import tiny
from vlmod.routing.layer import LayerRouting

# ---------------------------------------------------------------------------- models and inputs


@functools.cache
def _llava(family: str, attn: str) -> tuple[nn.Module, object]:
    return tiny.build(family, attn_implementation=attn)


def _llava_inputs(family: str) -> dict:
    return anyres_inputs(_llava(family, "eager")[1], family)


@functools.cache
def _timm_vit() -> nn.Module:
    torch.manual_seed(0)
    # Two register tokens + CLS: three prefix (query) tokens, 16 patches.
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10, depth=4, reg_tokens=2
    ).eval()


@functools.cache
def _open_clip_vit() -> nn.Module:
    torch.manual_seed(0)
    return open_clip.create_model("ViT-B-16", pretrained=None, force_image_size=64).visual.eval()


@functools.cache
def _hf_vit(kind: str) -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

    config_cls, model_cls = {"clip": (CLIPVisionConfig, CLIPVisionModel), "siglip": (SiglipVisionConfig, SiglipVisionModel)}[kind]
    config = config_cls(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, image_size=32, patch_size=8
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return model_cls(config).eval()


def _pixels(size: int) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def _randomise_routers(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mod_router" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) if name.endswith("weight") else 0 * p)


def _k(capacity: float, n: int) -> int:
    return math.ceil(round(capacity * n, 9)) if n else 0


@pytest.fixture
def spy_keys(monkeypatch):
    """{layer_idx: selection keys [B, L]} of the MoD layers of the next forwards."""
    seen: dict[int, torch.Tensor] = {}
    original = LayerRouting.keys

    def keys(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen[self.layer_idx] = out.detach()
        return out

    monkeypatch.setattr(LayerRouting, "keys", keys)
    return seen


# ---------------------------------------------------------------------------- every kind: k and protection


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("capacity", [0.5, 0.3])
def test_llava_every_router_selects_k_routable_and_every_protected_token(router, capacity):
    model, _ = _llava("llava_next", "sdpa")
    inputs = _llava_inputs("llava_next")
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=capacity, layers="all", router=router, seed=0))
    _randomise_routers(mod)
    with torch.no_grad(), vlmod.trace_routing(mod) as trace:
        logits = mod(**inputs).logits
    assert torch.isfinite(logits).all()
    types = trace.token_types
    image = types == int(TokenType.IMAGE)
    padding = types == int(TokenType.PADDING)
    protected = ~image & ~padding
    assert padding.any() and len(set(image.sum(1).tolist())) == 3  # a real padded, ragged batch
    for layer, processed in trace.processed.items():
        for b in range(types.shape[0]):
            assert int((processed[b] & image[b]).sum()) == _k(capacity, int(image[b].sum())), (router, layer, b)
        assert processed[protected].all(), (router, layer)
        assert not processed[padding].any(), (router, layer)


@pytest.mark.parametrize("router", ROUTERS)
def test_vit_every_router_selects_k_patches_and_every_prefix_token(router):
    model = vlmod.apply_mod(copy.deepcopy(_timm_vit()), vlmod.MoDConfig(capacity=0.25, layers="all", router=router, seed=0))
    _randomise_routers(model)
    with torch.no_grad(), vlmod.trace_routing(model) as trace:
        model(_pixels(64))
    for processed in trace.processed.values():
        assert processed[:, :3].all()
        assert processed[:, 3:].sum(1).tolist() == [4, 4]


def test_inverted_is_the_complement_of_learned():
    """Same weights, same input to the first MoD layer, even image counts, capacity 0.5."""
    model, _ = _llava("llava_next", "sdpa")
    inputs = _llava_inputs("llava_next")
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5, layers=[2]))
    _randomise_routers(mod)
    processed = {}
    for kind in ("learned", "inverted"):
        with torch.no_grad(), vlmod.use_router(mod, kind), vlmod.trace_routing(mod) as trace:
            mod(**inputs)
        processed[kind] = trace.processed[("language", 2)]
    image = trace.token_types == int(TokenType.IMAGE)
    assert (image.sum(1) % 2 == 0).all()
    learned, inverted = processed["learned"] & image, processed["inverted"] & image
    assert not (learned & inverted).any()
    assert torch.equal(learned | inverted, image)


# ---------------------------------------------------------------------------- attention router oracle


@pytest.mark.parametrize(
    "row", [None, 0, 2, "labels"], ids=["padded-batch", "one-left-padded", "one", "one-with-an-answer"]
)
@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_attention_router_is_the_mean_eager_attention_from_instruction_tokens(family, row, spy_keys):
    """Keys at layer 2 = the dense model's own layer-2 attention map (eager), averaged over heads
    and instruction query rows; the selection is its top-k among image tokens. A padded batch reads
    its query count; a batch of one sizes its query slots from shapes, padding and answer tokens
    (labels given) as filler slots, with the same keys."""
    model, _ = _llava(family, "eager")
    inputs = _llava_inputs(family)
    if row is not None:
        inputs = {name: value[2 if row == "labels" else row :][:1] for name, value in inputs.items()}
    if row == "labels":
        inputs["labels"] = inputs["input_ids"].clone()
        inputs["labels"][:, :-3] = -100  # the last 3 tokens are the answer
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5, layers=[2], router="attention"))
    with torch.no_grad(), vlmod.trace_routing(mod) as trace:
        mod(**inputs)
        maps = model(**inputs, output_attentions=True).attentions[2]
    types, processed, keys = trace.token_types, trace.processed[("language", 2)], spy_keys[2]
    assert (row == "labels") == bool((types == int(TokenType.RESPONSE)).any())
    for b in range(types.shape[0]):
        query = types[b] == int(TokenType.INSTRUCTION)
        image = types[b] == int(TokenType.IMAGE)
        expected = maps[b][:, query].mean((0, 1))
        real = types[b] != int(TokenType.PADDING)
        torch.testing.assert_close(keys[b][real], expected[real], rtol=1e-4, atol=1e-6)
        k = _k(0.5, int(image.sum()))
        top = expected.masked_fill(~image, -1.0).topk(k).indices.sort().values
        assert torch.equal(top, (processed[b] & image).nonzero().flatten())


def _timm_map(model: nn.Module, x: torch.Tensor, layer: int) -> torch.Tensor:
    attn = model.blocks[layer].attn
    seen = {}
    attn.fused_attn = False
    handle = attn.attn_drop.register_forward_hook(lambda _m, _i, out: seen.setdefault("map", out))
    try:
        model(x)
    finally:
        handle.remove()
        attn.fused_attn = True
    return seen["map"]  # [B, H, L, L], softmax as timm computes it


def _open_clip_map(model: nn.Module, x: torch.Tensor, layer: int) -> torch.Tensor:
    block = model.transformer.resblocks[layer]
    seen = {}

    def grab(_m, args):
        h = block.ln_1(args[0])
        seen["map"] = block.attn(h, h, h, need_weights=True, average_attn_weights=False)[1]

    handle = block.register_forward_pre_hook(grab)
    try:
        model(x)
    finally:
        handle.remove()
    return seen["map"]


VIT_ORACLES = {
    "timm": (_timm_vit, 64, 3, lambda m, x, i: _timm_map(m, x, i)),
    "open_clip": (_open_clip_vit, 64, 1, lambda m, x, i: _open_clip_map(m, x, i)),
    "hf_clip": (lambda: _hf_vit("clip"), 32, 1, lambda m, x, i: m(pixel_values=x, output_attentions=True).attentions[i]),
}


@pytest.mark.parametrize("name", sorted(VIT_ORACLES))
def test_attention_router_in_vits_is_the_attention_prefix_tokens_pay(name, spy_keys):
    build, size, prefix, attention_map = VIT_ORACLES[name]
    x = _pixels(size)
    with torch.no_grad():
        maps = attention_map(build(), x, 1)
    mod = vlmod.apply_mod(copy.deepcopy(build()), vlmod.MoDConfig(capacity=0.5, layers=[1], router="attention"))
    with torch.no_grad(), vlmod.trace_routing(mod) as trace:
        out = mod(pixel_values=x) if name == "hf_clip" else mod(x)
    assert out is not None
    expected = maps[:, :, :prefix].mean((1, 2))
    torch.testing.assert_close(spy_keys[1], expected, rtol=1e-4, atol=1e-6)
    processed = trace.processed[("vision", 1)]
    n = expected.shape[1] - prefix
    top = expected[:, prefix:].topk(_k(0.5, n), dim=1).indices.sort(dim=1).values + prefix
    assert torch.equal(processed[:, prefix:].nonzero()[:, 1].view(2, -1) + prefix, top)


def test_attention_router_at_capacity_one_is_the_upstream_model(spy_keys):
    model, _ = _llava("llava_onevision", "sdpa")
    inputs = _llava_inputs("llava_onevision")
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all", router="attention"))
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=1.0, layers="all"), part="vision")  # SigLIP: learned
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, expected = mod(**inputs).logits[real], model(**inputs).logits[real]
    # The tolerance of test_llava's identity test: sdpa may take another kernel path with a mask.
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    # Nothing was ranked: the keys are the (zero) learned scores, no attention was computed.
    assert spy_keys and all(not k.any() for k in spy_keys.values())
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(mod.generate(**inputs, **gen), model.generate(**inputs, **gen))
    vit = vlmod.apply_mod(copy.deepcopy(_timm_vit()), vlmod.MoDConfig(capacity=1.0, layers="all", router="attention"))
    x = _pixels(64)
    with torch.no_grad():
        assert torch.equal(vit(x), _timm_vit()(x))


def test_attention_router_generates_and_decode_steps_run_every_token():
    model, _ = _llava("llava", "sdpa")
    inputs = _llava_inputs("llava")
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.25, router="attention"))
    with torch.no_grad(), vlmod.trace_routing(mod) as trace:
        out = mod.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    prefill, *decode = trace.steps
    assert len(decode) == 2 and all(p.all() for step in decode for p, _ in step.values())
    image = inputs["input_ids"] == model.config.image_token_id
    for processed, _ in prefill.values():
        assert (processed & image).sum(1).tolist() == [_k(0.25, int(n)) for n in image.sum(1)]


def test_attention_scores_take_queries_grouped_by_key_head():
    """A plugin's queries [B, H, T, d] go through `by_key_head`; passed ungrouped they are a
    ValueError that says so, not a failed unpacking."""
    from vlmod.routing import AttentionQK, by_key_head, query_plan, received_attention

    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    plan = query_plan(torch.arange(3).expand(1, 3), None, torch.ones(1, 5, dtype=torch.bool), False, 4)
    keys = received_attention(AttentionQK(by_key_head(q, 2), k, 8**-0.5, False), plan)
    expected = ((q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 8**-0.5).softmax(-1).mean((1, 2))
    torch.testing.assert_close(keys, expected)
    with pytest.raises(ValueError, match="by_key_head"):
        received_attention(AttentionQK(q, k, 8**-0.5, False), plan)
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key heads"):
        by_key_head(q, 3)


def test_attention_router_is_a_value_error_without_query_tokens():
    siglip = copy.deepcopy(_hf_vit("siglip"))
    with pytest.raises(ValueError, match="prefix"):
        vlmod.apply_mod(siglip, vlmod.MoDConfig(router="attention"))
    vlmod.apply_mod(siglip, vlmod.MoDConfig())
    with pytest.raises(ValueError, match="prefix"):
        vlmod.set_router(siglip, "attention")
    assert vlmod.mod_layers(siglip)  # still converted, still learned
    with torch.no_grad():
        siglip(pixel_values=_pixels(32))


def test_attention_aux_loss_teaches_the_learned_router_the_attention_routers_choice():
    """aux_loss="attention": in training, each MoD layer's loss is the BCE of the learned router's
    logits against the tokens the attention router would run there (the first MoD layer sees the
    same input under either router, so its target is the attention router's own choice); the
    learned router still routes, gets a gradient from the aux loss, and evaluation adds nothing."""
    model, _ = _llava("llava", "sdpa")
    inputs = _llava_inputs("llava")
    labels = inputs["input_ids"].clone()
    labels[:, :-3] = -100
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.25, aux_loss="attention", aux_loss_weight=0.5))
    _randomise_routers(mod)
    first = min(i for _, i in vlmod.mod_layers(mod))
    mod.train()
    with vlmod.trace_routing(mod) as trace:
        out = mod(**inputs, labels=labels)
    part = next(iter(vlmod.routing.trace.find_parts(mod)))
    assert sorted(part.aux_losses) == sorted(i for _, i in vlmod.mod_layers(mod))
    scores, learned = trace.scores[("language", first)], trace.processed[("language", first)]
    aux, aux_first = vlmod.router_aux_loss(mod), part.aux_losses[first]
    with vlmod.use_router(mod, "attention"), vlmod.trace_routing(mod) as teacher, torch.no_grad():
        mod(**inputs, labels=labels)  # the same queries: response tokens are not among them
    target = teacher.processed[("language", first)]
    assert not torch.equal(target, learned)  # the layer routed by the learned router, not the teacher
    routable = trace.token_types == int(TokenType.IMAGE)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(scores, target.float(), reduction="none")
    torch.testing.assert_close(aux_first, bce[routable].mean())
    lm_loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert out.loss.item() == pytest.approx(lm_loss.item() + 0.5 * aux.item(), rel=1e-5)
    aux.backward()
    assert mod.model.language_model.mod_router.weight.grad.abs().sum() > 0
    mod.eval()
    with torch.no_grad():
        plain = mod(**inputs, labels=labels)
    assert vlmod.router_aux_loss(mod) is None  # no target in evaluation, and the training one is gone
    lm_loss = torch.nn.functional.cross_entropy(plain.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert plain.loss.item() == pytest.approx(lm_loss.item(), rel=1e-5)


def test_attention_aux_loss_needs_a_model_the_attention_router_scores():
    with pytest.raises(ValueError, match="prefix"):
        vlmod.apply_mod(copy.deepcopy(_hf_vit("siglip")), vlmod.MoDConfig(aux_loss="attention"))


# ---------------------------------------------------------------------------- set_router / use_router


def test_set_router_round_trip_keeps_weights(tmp_path):
    model, _ = _llava("llava", "sdpa")
    inputs = _llava_inputs("llava")
    cfg = vlmod.MoDConfig(capacity=0.5)
    mod = vlmod.apply_mod(copy.deepcopy(model), cfg)
    _randomise_routers(mod)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    with torch.no_grad():
        learned = mod(**inputs).logits
        assert vlmod.set_router(mod, "attention") is mod
        attention = mod(**inputs).logits
        assert mod.config.vlmod["language"]["router"] == "attention"
        with vlmod.use_router(mod, "random", part="language"):
            assert mod.config.vlmod["language"]["router"] == "random"
        assert mod.config.vlmod["language"]["router"] == "attention"
        vlmod.set_router(mod, "learned")
        again = mod(**inputs).logits
    assert cfg.router == "learned"  # the caller's config is not mutated
    assert not torch.equal(learned, attention)
    assert torch.equal(learned, again)
    after = mod.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # The kind is saved with the model and comes back with it.
    vlmod.set_router(mod, "attention")
    mod.save_pretrained(tmp_path)
    loaded = vlmod.load_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, attention)


def test_use_router_restores_after_an_error_and_checks_its_arguments():
    vit = vlmod.apply_mod(copy.deepcopy(_timm_vit()), vlmod.MoDConfig(router="stride"))
    with pytest.raises(RuntimeError), vlmod.use_router(vit, "random"):
        raise RuntimeError("boom")
    assert vlmod.routing.trace.find_parts(vit)[0].config.router == "stride"
    with pytest.raises(ValueError, match="router must be one of"):
        vlmod.set_router(vit, "oracle")
    with pytest.raises(ValueError, match="no converted 'language' part"):
        vlmod.set_router(vit, "random", part="language")
    with pytest.raises(ValueError, match="no MoD layers"):
        vlmod.set_router(copy.deepcopy(_timm_vit()), "random")


# ---------------------------------------------------------------------------- training-free conversion


def test_convert_with_the_attention_router_is_usable_without_fine_tuning(llava_checkpoint, tmp_path, capsys):
    from transformers import AutoProcessor

    from vlmod.cli import main

    source = llava_checkpoint
    out = tmp_path / "mod"
    assert main([
        "convert", "--model", str(source), "--out", str(out), "--capacity", "0.5", "--router", "attention",
        "--vision-capacity", "0.5",
    ]) == 0
    report = json.loads((out / "vlmod_report.json").read_text())
    assert report["settings"]["language"]["router"] == "attention"
    assert report["settings"]["vision"]["router"] == "attention"  # the CLIP tower has a CLS token
    model = vlmod.load_pretrained(out)
    assert {p.config.router for p in vlmod.routing.trace.find_parts(model)} == {"attention"}
    processor = AutoProcessor.from_pretrained(out)
    text = chat_prompt(processor, "what color is the circle")
    image = Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype("uint8"))
    inputs = dict(processor(images=[image], text=[text], return_tensors="pt"))
    with torch.no_grad(), vlmod.trace_routing(model) as trace:
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3
    image_tokens = inputs["input_ids"] == model.config.image_token_id
    assert int((trace.steps[0][("language", 1)][0] & image_tokens).sum()) == 8  # half of 16 image tokens
    assert main(["convert", "--model", str(source), "--out", str(tmp_path / "x"), "--router", "oracle"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_fastv_ranks_once_and_every_later_layer_runs_the_first_layers_tokens():
    """FastV's rule: the first MoD layer of a forward ranks as the attention router does there, and
    every later MoD layer runs the same tokens, so a token dropped there stays dropped (the attention
    router ranks again at each layer, the recipe's stronger training-free baseline). The next
    forward, on other pictures, ranks again; at capacity 1.0 the model is the upstream one."""
    model, _ = _llava("llava", "eager")
    inputs = _llava_inputs("llava")
    other = {**inputs, "pixel_values": inputs["pixel_values"].flip(-1) * 2}
    config = functools.partial(vlmod.MoDConfig, capacity=0.25, layers=[1, 2, 3])
    attention = vlmod.apply_mod(copy.deepcopy(model), config(router="attention"))
    fastv = vlmod.apply_mod(copy.deepcopy(model), config(router="fastv"))
    for batch in (inputs, other):
        with torch.no_grad(), vlmod.trace_routing(attention) as a, vlmod.trace_routing(fastv) as f:
            attention(**batch)
            fastv(**batch)
        first, *later = sorted(f.processed)
        assert torch.equal(f.processed[first], a.processed[first])
        assert all(torch.equal(f.processed[layer], f.processed[first]) for layer in later)
        assert not all(torch.equal(a.processed[layer], a.processed[first]) for layer in later)
    dense = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all", router="fastv"))
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, expected = dense(**inputs).logits[real], model(**inputs).logits[real]
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5
