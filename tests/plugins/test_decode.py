"""The decode fast path: a decode step of a MoD model does no routing work and no host sync, and
computes what the general path computes."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.inputs import chat_prompt
from helpers.probes import ROUTING_OPS, CountOps, count_syncs
from PIL import Image

import vlmod
from vlmod.models import tiny
from vlmod.plugins.calls import CACHE, output_cache


def _inputs(processor, family: str, mixed: bool) -> dict:
    rng = np.random.RandomState(0)
    sizes = [(32, 32), (48, 64)] if mixed else [(32, 32), (32, 32)]
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]
    questions = ["what color", "how many objects are in the image ?"] if mixed else ["what color"] * 2
    prompts = [chat_prompt(processor, q) for q in questions]
    return dict(processor(images=images, text=prompts, return_tensors="pt", padding=True))


@pytest.fixture(scope="module")
def llava():
    model, processor = tiny.build("llava")
    return model.eval(), _inputs(processor, "llava", mixed=False)


def _decode_step(model, inputs: dict) -> tuple[dict, torch.Tensor]:
    """(the kwargs of the first decode step after a prefill of `inputs`, the prefill's logits)."""
    with torch.inference_mode():
        out = model(**inputs, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
    return dict(input_ids=token, attention_mask=mask, **{CACHE: output_cache(out)}, use_cache=True), out.logits


def _step_counts(model, inputs: dict) -> tuple[Counter, Counter, torch.Tensor]:
    step, _ = _decode_step(model, inputs)
    with torch.inference_mode(), count_syncs() as syncs, CountOps() as ops:
        logits = model(**step).logits
    return syncs, ops.ops, logits


@pytest.mark.parametrize("capacity", [0.5, 1.0])
def test_decode_step_does_no_routing_work_and_no_host_sync(llava, capacity: float):
    model, inputs = llava
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=capacity))
    n_mod = len(vlmod.mod_layers(mod))
    dense_syncs, dense_ops, _ = _step_counts(model, inputs)
    mod_syncs, mod_ops, _ = _step_counts(mod, inputs)
    assert mod_syncs == dense_syncs, (mod_syncs, dense_syncs)
    assert not ROUTING_OPS & {op for op, n in mod_ops.items() if n > dense_ops.get(op, 0)}, mod_ops - dense_ops
    # The only concatenations are the KV cache's own: no key positions joined per layer and step.
    assert mod_ops["cat"] == dense_ops["cat"]
    # Per MoD layer the router's logits (linear, already [B, 1, 1]), the gate (tanh, add) and the
    # gated residual (one lerp in float32); once per step the token types (16 ops).
    extra = sum(mod_ops.values()) - sum(dense_ops.values())
    assert extra <= 4 * n_mod + 16, (extra, mod_ops - dense_ops)


def test_prefill_syncs_at_most_once(llava):
    model, inputs = llava
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    with torch.inference_mode():
        with count_syncs() as dense:
            model(**inputs, use_cache=True)
        with count_syncs() as routed:
            mod(**inputs, use_cache=True)
    assert sum(routed.values()) - sum(dense.values()) <= 1, (routed, dense)


def test_capacity_one_generates_exactly_what_upstream_generates(llava):
    model, inputs = llava
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    with torch.inference_mode():
        a = model.generate(**inputs, **kwargs)
        b = mod.generate(**inputs, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("family", ["llava_next"])
def test_decode_with_filler_slots_sdpa_matches_eager(family: str):
    """Rows that processed different token counts leave filler slots in the MoD caches; a decode
    step then masks them by validity alone, under sdpa and eager alike."""
    eager_model, processor = tiny.build(family, attn_implementation="eager")
    sdpa_model, _ = tiny.build(family, attn_implementation="sdpa")
    sdpa_model.load_state_dict(eager_model.state_dict())
    inputs = _inputs(processor, family, mixed=True)
    config = vlmod.MoDConfig(capacity=0.5)
    eager = vlmod.apply_mod(eager_model, config)
    sdpa = vlmod.apply_mod(sdpa_model, config)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    with torch.inference_mode():
        a = eager.generate(**inputs, **kwargs)
        b = sdpa.generate(**inputs, **kwargs)
    slots = sdpa.model.language_model.__dict__["_vlmod_part"].adapter.cache_slots
    assert any(valid is not None for _, valid in slots.values()), "the batch left no filler slot to mask"
    assert torch.equal(a.sequences, b.sequences)
    assert torch.allclose(torch.stack(a.logits), torch.stack(b.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn, mixed", [("sdpa", False), ("sdpa", True), ("eager", True)])
def test_routing_bypassed_decodes_over_the_same_caches_without_the_gate(attn: str, mixed: bool):
    """The decode bound of `bench --decode-bound`: a fresh conversion (gate 1) decodes exactly like
    MoD with its router and gate bypassed, over caches of MoD's size and with its masks (a padded
    batch, eager attention); with a trained router only the decode steps differ (the bypass skips
    the gate there, and only there)."""
    from vlmod.bench.decode import kv_cache_bytes, routing_bypassed

    model, processor = tiny.build("llava", attn_implementation=attn)
    model.eval()
    inputs = _inputs(processor, "llava", mixed=mixed)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    with torch.inference_mode():
        a = mod.generate(**inputs, **kwargs)
        b = routing_bypassed(mod).generate(**inputs, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert kv_cache_bytes(a.past_key_values) == kv_cache_bytes(b.past_key_values)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    torch.nn.init.normal_(mod.model.language_model.mod_router.weight, std=0.5)
    with torch.inference_mode():
        a = mod.generate(**inputs, **kwargs)
        b = routing_bypassed(mod).generate(**inputs, **kwargs)
    assert torch.equal(a.logits[0], b.logits[0]) and not torch.equal(a.logits[1], b.logits[1])
