"""The preallocated KV cache: generation identical to DynamicCache's, dense and MoD, with no
concatenation and no host sync in a decode step."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers.inputs import padded_batch
from helpers.probes import ROUTING_OPS, CountOps, count_syncs
from transformers import DynamicCache

import vlmod
from vlmod.models import tiny
from vlmod.plugins.calls import CACHE, output_cache
from vlmod.tools.cache import PreallocatedCache, PreallocatedLayer, generate_cache

NEW_TOKENS = 5
GENERATE = dict(
    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
    return_dict_in_generate=True,
)


@pytest.fixture(scope="module", params=["llava", "llava_next_video"])
def family(request: pytest.FixtureRequest):
    model, processor = tiny.build(request.param)
    return model.eval(), padded_batch(processor, request.param)


@pytest.mark.parametrize("capacity", [None, 0.5, 1.0])
def test_generate_matches_dynamic_cache(family, capacity: float | None):
    model, inputs = family
    if capacity is not None:
        model = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=capacity))
    cache = vlmod.preallocated_cache(model, NEW_TOKENS)
    with torch.inference_mode():
        a = model.generate(**inputs, **GENERATE)
        b = model.generate(**inputs, **GENERATE, **{CACHE: cache})
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-6), (x - y).abs().max()
    # Each layer holds what DynamicCache holds (MoD layers fewer tokens), in a buffer sized once.
    prompt = inputs["input_ids"].shape[1]
    for ours, theirs in zip(output_cache(b).layers, output_cache(a).layers, strict=True):
        assert isinstance(ours, PreallocatedLayer)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        filled = ours.get_seq_length()
        assert ours.capacity == filled + 1  # prefill + max_new_tokens; the last token is never cached
    if capacity == 0.5:
        assert min(layer.get_seq_length() for layer in cache.layers) < prompt + NEW_TOKENS - 1


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_decode_step_writes_in_place_without_host_sync(family, capacity: float | None):
    model, inputs = family
    if capacity is not None:
        model = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=capacity))
    counts = {}
    for name, cache in (("dynamic", DynamicCache(config=model.config)), ("prealloc", vlmod.preallocated_cache(model, 4))):
        with torch.inference_mode():
            out = model(**inputs, **{CACHE: cache}, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
            with count_syncs() as syncs, CountOps() as ops:
                model(input_ids=token, attention_mask=mask, **{CACHE: cache}, use_cache=True)
        counts[name] = syncs, ops.ops
    (dyn_syncs, dyn_ops), (pre_syncs, pre_ops) = counts["dynamic"], counts["prealloc"]
    assert pre_syncs == dyn_syncs, (pre_syncs, dyn_syncs)
    layers = model.config.text_config.num_hidden_layers
    # DynamicCache concatenates K and V of every layer; the preallocated cache copies into place.
    assert dyn_ops["cat"] - pre_ops["cat"] == 2 * layers, (dyn_ops["cat"], pre_ops["cat"])
    assert pre_ops["copy_"] - dyn_ops["copy_"] == 2 * layers
    assert not ROUTING_OPS & {op for op, n in pre_ops.items() if n > dyn_ops.get(op, 0)}


def test_grows_past_max_new_tokens_crops_and_resets(family):
    model, inputs = family
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    with torch.inference_mode():
        a = mod.generate(**inputs, **GENERATE)
        cache = vlmod.preallocated_cache(mod, 1)  # too small: grows once per layer, stays exact
        b = mod.generate(**inputs, **GENERATE, **{CACHE: cache})
    assert torch.equal(a.sequences, b.sequences)
    layer = cache.layers[1]
    n = layer.get_seq_length()
    kept = layer.keys[..., : n - 2, :].clone()
    cache.crop(-2)
    assert layer.get_seq_length() == n - 2 and torch.equal(layer.keys, kept)
    cache.reset()
    assert cache.get_seq_length(1) == 0 and layer.capacity > 0


def test_api_and_refusals():
    model, _ = tiny.build("llava")
    cache = vlmod.preallocated_cache(model, 8)
    assert isinstance(cache, PreallocatedCache) and isinstance(cache, DynamicCache)
    assert len(cache.layers) == model.config.text_config.num_hidden_layers
    assert cache.get_seq_length() == 0 and cache.allocated_bytes() == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        vlmod.preallocated_cache(model, -1)


@pytest.mark.skipif(CACHE == "past_key_values", reason="this transformers names the cache past_key_values only")
def test_a_mod_model_decodes_the_same_under_the_old_cache_name(family):
    """transformers 5.24 renamed `past_key_values` to `cache` and still takes the old name (with a
    warning): a MoD model's prefill and the forward after it route the same under either."""
    model, inputs = family
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    logits = {}
    for name in ("cache", "past_key_values"):
        cache = vlmod.preallocated_cache(mod, 2)
        with torch.inference_mode(), pytest.warns(FutureWarning) if name != CACHE else contextlib.nullcontext():
            out = mod(**inputs, **{name: cache}, use_cache=True, logits_to_keep=1)
            # Three tokens after the prompt: their mask over the cached keys needs the cached length.
            tokens = out.logits[:, -1].argmax(-1, keepdim=True).expand(-1, 3)
            mask = torch.cat([inputs["attention_mask"], torch.ones_like(tokens)], dim=1)
            step = mod(input_ids=tokens, attention_mask=mask, **{name: cache}, use_cache=True)
        # Every MoD layer's cache holds only what it routed, however the cache was passed.
        logits[name] = (out.logits, step.logits, [layer.get_seq_length() for layer in cache.layers])
    (a_pre, a_step, a_len), (b_pre, b_step, b_len) = logits.values()
    assert a_len == b_len and min(a_len) < max(a_len)
    assert torch.equal(a_pre, b_pre) and torch.equal(a_step, b_step)


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_beam_search_and_sampling_match_dynamic_cache(family, capacity: float | None):
    """Beam search reorders and sampling draws over the preallocated cache as over DynamicCache
    (the lmms-eval model generates with either, on vlmod's cache)."""
    model, inputs = family
    if capacity is not None:
        model = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=capacity))
    for extra in (dict(num_beams=3, do_sample=False), dict(do_sample=True, top_k=5)):
        settings = {**GENERATE, **extra}
        with torch.inference_mode():
            torch.manual_seed(0)
            plain = model.generate(**inputs, **settings)
            torch.manual_seed(0)
            ours = model.generate(**inputs, **settings, **generate_cache(model, NEW_TOKENS))
        assert torch.equal(plain.sequences, ours.sequences), extra
        assert torch.allclose(torch.stack(plain.logits), torch.stack(ours.logits), atol=1e-5), extra


def test_vlmod_generation_decodes_on_the_preallocated_cache(family, monkeypatch):
    """eval's greedy generation hands generate a preallocated cache, and answers as plain generate."""
    from vlmod.evaluation.evaluate import greedy_generate

    model, inputs = family
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    caches = []
    original = mod.generate

    def spy(**kwargs):
        caches.append(kwargs.get(CACHE))
        return original(**kwargs)

    monkeypatch.setattr(mod, "generate", spy)
    with torch.inference_mode():
        ours = greedy_generate(mod, inputs, NEW_TOKENS)
        plain = original(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert isinstance(caches[0], PreallocatedCache)
    assert torch.equal(ours, plain[:, inputs["input_ids"].shape[1]:])


def test_a_checkpoint_that_names_its_cache_keeps_it(family):
    """generate refuses a cache beside a generation config's cache_implementation: vlmod then passes none."""
    from vlmod.evaluation.evaluate import greedy_generate

    model, inputs = family
    model = copy.deepcopy(model)
    assert CACHE in generate_cache(model, NEW_TOKENS)
    model.generation_config.cache_implementation = "dynamic"
    assert generate_cache(model, NEW_TOKENS) == {}
    with torch.inference_mode():
        assert greedy_generate(model, inputs, NEW_TOKENS).shape == (2, NEW_TOKENS)
