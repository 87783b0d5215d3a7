"""LLaVA families against the unmodified transformers model (the oracle)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.inputs import anyres_inputs

import vlmod
from vlmod import TokenType
from vlmod.models import tiny
from vlmod.plugins import llava
from vlmod.plugins.calls import output_cache

FAMILIES = list(llava.VARIANTS)  # the registry's LLaVA variants


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    model, processor = tiny.build(request.param)
    return request.param, model, processor, anyres_inputs(processor, request.param)


def _rel_err(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    a, b = a[mask], b[mask]
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _counts(model, inputs):
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    image = (ids == model.config.image_token_id) & mask
    return image.sum(1), (mask & ~image).sum(1)


def test_capacity_one_matches_upstream(family_model):
    family, model, _, inputs = family_model
    ref = copy.deepcopy(model)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    assert len(vlmod.mod_layers(mod)) == model.config.text_config.num_hidden_layers - 1
    with torch.no_grad():
        expected = ref(**inputs).logits
        got = mod(**inputs).logits
    assert _rel_err(got, expected, inputs["attention_mask"].bool()) <= 1e-5
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(**inputs, **gen), mod.generate(**inputs, **gen))


def test_capacity_half_counts_and_cache(family_model):
    family, model, _, inputs = family_model
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    n_image, n_text = _counts(model, inputs)
    expected = n_text + torch.ceil(n_image * 0.5).long()
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        out = mod(**inputs, use_cache=True)
        dense_logits = model(**inputs).logits
    types = trace.token_types
    assert types.shape == inputs["input_ids"].shape
    assert set(vlmod.mod_layers(mod)) == {("language", 1), ("language", 3)}
    for (part, layer), processed in trace.processed.items():
        assert torch.equal(processed.sum(1), expected), (part, layer)
        instruction = types == TokenType.INSTRUCTION
        assert processed[instruction].all()
        assert not processed[types == TokenType.PADDING].any()
        cache_len = output_cache(out).get_seq_length(layer)
        assert cache_len == int(expected.max())
    assert output_cache(out).get_seq_length(0) == inputs["input_ids"].shape[1]
    assert not torch.allclose(out.logits, dense_logits)


def test_generate_cache_matches_full_forward(family_model):
    """Decode steps through the routed cache give the logits of one full forward over the result."""
    family, model, _, inputs = family_model
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    new = 4
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        gen = mod.generate(
            **inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            # A random model may pick a media placeholder, which the full forward would then expect
            # pixels for.
            suppress_tokens=[t for t in (model.config.image_token_id, getattr(model.config, "video_token_id", None))
                             if t is not None],
            output_logits=True, return_dict_in_generate=True,
        )
    n_image, n_text = _counts(model, inputs)
    expected = n_text + torch.ceil(n_image * 0.5).long()
    for key, processed in trace.processed.items():
        assert processed.shape[1] == inputs["input_ids"].shape[1] + new - 1
        assert torch.equal(processed.sum(1), expected + new - 1), key
        # The layer's KV cache: one slot per processed token of the longest row; the other rows'
        # extra slots are filler that no query attends to.
        assert output_cache(gen).get_seq_length(key[1]) == int(expected.max()) + new - 1
        _, valid = mod.model.language_model.__dict__["_vlmod_part"].adapter.cache_slots[key[1]]
        if valid is not None:
            assert torch.equal(valid.sum(1), expected + new - 1)
    full = {**inputs, "input_ids": gen.sequences[:, :-1]}
    full["attention_mask"] = torch.cat(
        [inputs["attention_mask"], torch.ones(3, new - 1, dtype=inputs["attention_mask"].dtype)], dim=1
    )
    with torch.no_grad():
        logits = mod(**full).logits
    steps = torch.stack(gen.logits, dim=1)
    assert torch.allclose(logits[:, -new:], steps, atol=1e-4, rtol=1e-4)


def test_padding_does_not_change_real_tokens(family_model):
    family, model, processor, inputs = family_model
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    with torch.no_grad():
        batched = mod(**inputs).logits
    mask = inputs["attention_mask"].bool()
    row = 0
    single = {k: v[row : row + 1] for k, v in inputs.items() if k not in ("pixel_values", "image_sizes", "batch_num_images")}
    keep = mask[row]
    single["input_ids"] = single["input_ids"][:, keep]
    single["attention_mask"] = single["attention_mask"][:, keep]
    images = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_sizes", "batch_num_images")}
    for k, v in images.items():
        single[k] = v[row : row + 1]
    with torch.no_grad():
        alone = mod(**single).logits[0]
    assert torch.allclose(batched[row][keep], alone, atol=1e-5, rtol=1e-4)


def test_hidden_states_and_vision_part(family_model):
    family, model, _, inputs = family_model
    mod = copy.deepcopy(model)
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=0.5))
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=0.5, layers=[1]), part="vision")
    parts = {p for p, _ in vlmod.mod_layers(mod)}
    assert parts == {"language", "vision"}
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        out = mod(**inputs, output_hidden_states=True)
    n_layers = model.config.text_config.num_hidden_layers
    assert len(out.hidden_states) == n_layers + 1
    assert all(h.shape == out.hidden_states[0].shape for h in out.hidden_states)
    vision = trace.processed[("vision", 1)]
    prefix = 1 if family != "llava_onevision" else 0
    n_patches = vision.shape[1] - prefix
    assert (vision.sum(1) == prefix + math.ceil(0.5 * n_patches)).all()


def test_training_loss_aux_and_checkpointing():
    model, processor = tiny.build("llava")
    inputs = anyres_inputs(processor, "llava")
    labels = inputs["input_ids"].clone()
    labels[:, :-3] = -100
    cfg = vlmod.MoDConfig(capacity=0.5, routable=("image", "response"), aux_loss="bce", aux_loss_weight=0.5)
    vlmod.apply_mod(model, cfg)
    model.train()
    with vlmod.trace_routing(model) as trace:
        out = model(**inputs, labels=labels)
    types = trace.token_types
    assert (types[:, -3:] == TokenType.RESPONSE).all()
    aux = vlmod.router_aux_loss(model)
    assert aux is not None and aux.requires_grad
    lm_loss = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )
    assert out.loss.item() == pytest.approx(lm_loss.item() + 0.5 * aux.item(), rel=1e-5)
    out.loss.backward()
    router = model.model.language_model.mod_router
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0

    model.zero_grad()
    model.activation_checkpointing_enable()
    out_ckpt = model(**inputs, labels=labels)
    assert torch.allclose(out_ckpt.loss, out.loss, atol=1e-6)
    out_ckpt.loss.backward()
    assert router.weight.grad.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients():
    """A MoD language model trained with gradient checkpointing gets every gradient it gets without
    (the recomputed forward routes the same tokens), routers and gates included."""

    def step(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model, processor = tiny.build("llava")
        vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="all"))
        with torch.no_grad():
            model.model.language_model.mod_router.weight.normal_(0.0, 0.5)
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
        inputs = anyres_inputs(processor, "llava")
        labels = inputs["input_ids"].clone()
        labels[:, :-3] = -100
        out = model(**inputs, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_a, grads_a = step(False)
    loss_b, grads_b = step(True)
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert sorted(grads_a) == sorted(grads_b)
    assert grads_a["model.language_model.mod_router.weight"].abs().sum() > 0
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], atol=1e-6, rtol=1e-4), name


def test_response_routing_at_decode_uses_the_causal_predictor():
    model, processor = tiny.build("llava")
    inputs = anyres_inputs(processor, "llava")
    cfg = vlmod.MoDConfig(capacity=0.5, routable=("image", "response"), aux_loss="bce")
    vlmod.apply_mod(model, cfg)
    router = model.model.language_model.mod_router
    with torch.no_grad():
        router.bias.fill_(-5.0)  # predictor says "skip" for every token
    with vlmod.trace_routing(model) as trace, torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    prompt_len = inputs["input_ids"].shape[1]
    for processed in trace.processed.values():
        assert not processed[:, prompt_len:].any()

    model2, _ = tiny.build("llava")
    vlmod.apply_mod(model2, vlmod.MoDConfig(capacity=0.5, routable=("image", "response")))
    with vlmod.trace_routing(model2) as trace, torch.no_grad():
        model2.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    for processed in trace.processed.values():
        assert processed[:, prompt_len:].all()


def test_eager_attention_matches_upstream():
    model, processor = tiny.build("llava", attn_implementation="eager")
    inputs = anyres_inputs(processor, "llava")
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    with torch.no_grad():
        assert _rel_err(mod(**inputs).logits, model(**inputs).logits, inputs["attention_mask"].bool()) <= 1e-5
    sdpa_model, _ = tiny.build("llava", attn_implementation="sdpa")
    sdpa = vlmod.apply_mod(sdpa_model, vlmod.MoDConfig(capacity=0.5))
    eager = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    with torch.no_grad():
        a, b = sdpa(**inputs).logits, eager(**inputs).logits
    assert _rel_err(a, b, inputs["attention_mask"].bool()) <= 1e-4


def test_save_and_load_round_trip(tmp_path):
    from transformers import LlavaNextForConditionalGeneration

    model, processor = tiny.build("llava_next")
    inputs = anyres_inputs(processor, "llava_next")
    plain_dir = tmp_path / "plain"
    model.save_pretrained(plain_dir)
    assert vlmod.mod_layers(vlmod.load_pretrained(plain_dir)) == {}

    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, capacity_schedule="cosine", layers=[1, 2, 3]))
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1]), part="vision")
    with torch.no_grad():
        model.model.language_model.mod_router.weight.normal_()
        expected = model(**inputs).logits
    out = tmp_path / "mod"
    model.save_pretrained(out)
    loaded = vlmod.load_pretrained(out)
    assert type(loaded) is type(model)
    assert vlmod.mod_layers(loaded) == vlmod.mod_layers(model)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, expected)
    dense = LlavaNextForConditionalGeneration.from_pretrained(out)
    assert vlmod.mod_layers(dense) == {}
    assert "mod_router.weight" not in " ".join(dense.state_dict())


def test_errors():
    model, _ = tiny.build("llava")
    with pytest.raises(ValueError, match="must stay dense"):
        vlmod.apply_mod(model, vlmod.MoDConfig(layers=[0, 1]))
    with pytest.raises(ValueError, match="out of range"):
        vlmod.apply_mod(model, vlmod.MoDConfig(layers=[9]))
    with pytest.raises(ValueError, match="part must be"):
        vlmod.apply_mod(model, vlmod.MoDConfig(), part="audio")
    vlmod.apply_mod(model, vlmod.MoDConfig())
    with pytest.raises(ValueError, match="already converted"):
        vlmod.apply_mod(model, vlmod.MoDConfig())
    with pytest.raises(TypeError, match="LlavaForConditionalGeneration"):
        vlmod.apply_mod(torch.nn.Linear(2, 2), vlmod.MoDConfig())
    with pytest.raises(RuntimeError, match="top-level model"):
        model.model.language_model(inputs_embeds=torch.randn(1, 5, 64))
