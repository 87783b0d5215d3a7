"""What a routed layer costs the host, counted (docs/engine.md, host cost): aten ops per routed
layer in a prefill and a decode step, host syncs against the dense model's, the attention call a
routed layer makes (no mask where plain causal attention is right), and the compiled decode step
(one graph, no recompile, the eager tokens)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.inputs import padded_batch

import vlmod
from vlmod.bench.ops import BUILD, host_cost, tiny_inputs
from vlmod.models import tiny
from vlmod.plugins import vlm_variants
from vlmod.plugins.calls import CACHE, output_cache
from vlmod.tools.cache import compiled_cache, generate_cache

# Gemma 3's routed layers need a mask by original position (image blocks seen both ways, sliding
# windows): its own budget below (docs/engine.md).
BUDGETED = [f for f in vlm_variants() if f != "gemma3"]
PREFILL_BUDGET, DECODE_BUDGET = 15, 4


@pytest.mark.parametrize("family", BUDGETED)
def test_a_routed_layer_stays_within_its_op_budget(family):
    row = host_cost(family)
    assert row.routed_layers >= 2
    assert row.prefill_per_layer <= PREFILL_BUDGET, (row.mod_prefill.by_op, row.dense_prefill.by_op)
    assert row.decode_per_layer <= DECODE_BUDGET, (row.mod_decode.by_op, row.dense_decode.by_op)


def test_gemma3_routed_layers_gather_one_mask_a_forward():
    """Before: each routed layer built its mask from positions (36 ops a routed layer in a prefill,
    16.5 in a decode step, with a sliding and a full-attention layer routed). Now a prefill gathers
    the selected rows and columns of one whole-sequence mask per layer kind, built once a forward,
    and a decode step masks a sliding layer by its window alone and a full layer not at all: 26 and
    7 (of which the image blocks, the two whole-sequence masks and the positions are once a forward);
    26.5 in a prefill since the counter sees the copies a `reshape` makes under inference mode."""
    row = host_cost("gemma3", layers="all")
    assert row.routed_layers == 2
    assert row.prefill_per_layer <= 26.5, (row.mod_prefill.by_op, row.dense_prefill.by_op)
    assert row.decode_per_layer <= 7, (row.mod_decode.by_op, row.dense_decode.by_op)


@pytest.mark.parametrize("family", vlm_variants())
def test_no_host_sync_the_dense_model_does_not_make(family):
    """A batch of one without padding: the budgets follow from the vision features' shape, and a
    decode step reads nothing (the syncs counted are the Python-level reads and syncing ops)."""
    row = host_cost(family)
    assert row.mod_prefill.syncs <= row.dense_prefill.syncs, (row.mod_prefill.by_sync, row.dense_prefill.by_sync)
    assert row.mod_decode.syncs <= row.dense_decode.syncs, (row.mod_decode.by_sync, row.dense_decode.by_sync)


def test_the_attention_router_reads_nothing_the_learned_router_does_not():
    """A batch of one without padding: the attention router sizes its query slots from shapes (every
    token that is not routable, the non-queries weighing 0), builds their mask and weights once a
    forward, and scores each routed layer of a prefill from its own q and k projections, rotated in
    one call of upstream's RoPE (docs/engine.md); a decode step has nothing to rank and costs what
    the learned router's does. A padded batch reads its query count once a forward."""
    learned, attention = host_cost("llava"), host_cost("llava", router="attention")
    assert attention.mod_prefill.syncs == learned.mod_prefill.syncs, attention.mod_prefill.by_sync
    assert attention.prefill_per_layer <= 55.5, (attention.mod_prefill.by_op, learned.mod_prefill.by_op)
    assert attention.mod_decode.ops == learned.mod_decode.ops and attention.mod_decode.syncs == 0


def test_fastv_scores_in_the_first_routed_layer_only():
    """FastV's rule ranks once a forward: the attention router's scoring in the first routed layer
    of a prefill, the others reusing its keys (the learned router's ops there), no host read the
    learned router does not make, and a decode step the learned router's."""
    learned, attention, fastv = (host_cost("llava", router=r) for r in ("learned", "attention", "fastv"))
    assert fastv.routed_layers == 2 and fastv.mod_prefill.syncs == learned.mod_prefill.syncs, fastv.mod_prefill.by_sync
    assert learned.mod_prefill.ops < fastv.mod_prefill.ops < attention.mod_prefill.ops
    # A third routed layer adds what it adds under the learned router: no scoring of its own.
    learned3, fastv3 = (host_cost("llava", layers="all", router=r) for r in ("learned", "fastv"))
    assert fastv3.routed_layers == 3
    assert fastv3.mod_prefill.ops - fastv.mod_prefill.ops == learned3.mod_prefill.ops - learned.mod_prefill.ops, (
        fastv3.mod_prefill.by_op, learned3.mod_prefill.by_op)
    assert fastv.mod_decode.ops == learned.mod_decode.ops and fastv.mod_decode.syncs == 0


class _AttentionCalls:
    """Every sdpa attention call of transformers' models: (query length, key length, attn_mask,
    is_causal as sdpa gets it: no mask and more than one query)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.calls: list[tuple[int, int, object, bool]] = []
        original = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def recording(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
            is_causal = attention_mask is None and query.shape[-2] > 1
            self.calls.append((query.shape[-2], key.shape[-2], attention_mask, is_causal))
            return original(module, query, key, value, attention_mask, **kwargs)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recording)

    def language(self, n_layers: int) -> list[tuple[int, int, object, bool]]:
        """The last forward's language-model calls (the tower's come first)."""
        return self.calls[-n_layers:]


def _prefill_and_step(mod, inputs: dict, calls: _AttentionCalls, layers: int) -> tuple[list, list]:
    """The language layers' attention calls of a prefill on vlmod's cache and of one decode step."""
    with torch.inference_mode():
        out = mod(**inputs, **generate_cache(mod, 2), use_cache=True, logits_to_keep=1)
        prefill = calls.language(layers)
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
        mod(input_ids=token, attention_mask=mask, **{CACHE: output_cache(out)}, use_cache=True)
    return prefill, calls.language(layers)


def _llava(capacity: float = 0.5):
    model, processor = tiny.build("llava")
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=capacity, layers="every_other"))
    return model, mod, processor


def test_routed_attention_runs_without_a_mask_where_it_is_plain_causal(monkeypatch):
    """Prefill of a batch of one: every routed layer calls sdpa with no mask and is_causal (flash
    eligible) on its gathered tokens; a decode step with no mask at all."""
    _, mod, processor = _llava()
    inputs = tiny_inputs("llava", processor)
    layers = mod.config.text_config.num_hidden_layers
    prefill, decode = _prefill_and_step(mod, inputs, _AttentionCalls(monkeypatch), layers)
    length = inputs["input_ids"].shape[1]
    routed = sorted(layer for _, layer in vlmod.mod_layers(mod))
    for layer, (n_query, _, attn_mask, is_causal) in enumerate(prefill):
        assert attn_mask is None and is_causal, layer
        assert (n_query < length) == (layer in routed)  # routed layers run on their gathered tokens
    for layer in routed:
        n_query, _, attn_mask, is_causal = decode[layer]
        assert n_query == 1 and attn_mask is None and not is_causal


def test_several_queries_after_a_cache_take_the_lower_right_causal_form(monkeypatch):
    """A second chunk of prompt after a cached first one: the routed layers pass sdpa's
    lower-right causal bias (no materialised mask), and the logits are those of one forward."""
    from torch.nn.attention.bias import CausalBias

    _, mod, processor = _llava(capacity=1.0)
    inputs = tiny_inputs("llava", processor)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    cut = ids.shape[1] - 4  # the last 4 tokens are text
    calls = _AttentionCalls(monkeypatch)
    with torch.inference_mode():
        whole = mod(**inputs).logits[:, cut:]
        first = mod(**{**inputs, "input_ids": ids[:, :cut], "attention_mask": mask[:, :cut]}, use_cache=True)
        second = mod(input_ids=ids[:, cut:], attention_mask=mask, **{CACHE: output_cache(first)}, use_cache=True)
    layers = mod.config.text_config.num_hidden_layers
    for layer, (n_query, n_key, attn_mask, _) in enumerate(calls.language(layers)):
        if ("language", layer) in vlmod.mod_layers(mod):
            assert isinstance(attn_mask, CausalBias) and (n_query, n_key) == (4, ids.shape[1]), layer
    torch.testing.assert_close(second.logits, whole, atol=1e-5, rtol=1e-5)


def test_a_padded_batch_builds_one_mask_per_forward(monkeypatch):
    """Rows with different token counts need masks (filler slots, padding); the routed layers of
    one capacity share one, built once per forward, in the prefill and in each decode step."""
    _, mod, processor = _llava()
    inputs = padded_batch(processor, "llava")
    layers = mod.config.text_config.num_hidden_layers
    routed = [layer for _, layer in vlmod.mod_layers(mod)]
    prefill, decode = _prefill_and_step(mod, inputs, _AttentionCalls(monkeypatch), layers)
    for step in (prefill, decode):
        masks = [step[layer][2] for layer in routed]
        assert all(isinstance(m, torch.Tensor) for m in masks)
        assert len({id(m) for m in masks}) == 1


def test_the_compiled_cache_decodes_like_the_preallocated_one():
    """Eager, on a padded batch whose rows processed different counts (filler slots in the MoD
    caches): the compiled cache's masks by device-side length and validity give the tokens and
    logits of the preallocated cache."""
    _, mod, processor = _llava()
    inputs = padded_batch(processor, "llava")
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        a = mod.generate(**inputs, **kwargs, **generate_cache(mod, 5))
        b = mod.generate(**inputs, **kwargs, **{CACHE: compiled_cache(mod, 5)})
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_compiled_mod_decode_step_is_one_graph_that_does_not_recompile():
    """vlmod.compile: fullgraph decode steps (a graph break would raise), the same tokens as
    eager, and a second request of the same shape runs 32 steps under fail_on_recompile."""
    _, mod, processor = _llava()
    inputs = tiny_inputs("llava", processor)
    gen = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    with torch.inference_mode():
        eager = mod.generate(**inputs, **gen, **generate_cache(mod, 32))
        vlmod.compile(mod)
        torch._dynamo.reset()
        try:
            first = mod.generate(**inputs, **gen, **generate_cache(mod, 32))
            with torch.compiler.set_stance("fail_on_recompile"):
                again = mod.generate(**inputs, **gen, **generate_cache(mod, 32))
        finally:
            torch._dynamo.reset()
    assert torch.equal(first, eager) and torch.equal(again, eager)


def test_compile_refuses_what_it_cannot_compile_in_one_line():
    model, _ = tiny.build("gemma3", **BUILD.get("gemma3", {}))
    with pytest.raises(vlmod.errors.InputError, match="sliding_attention.*decodes eager"):
        vlmod.compile(model)
    eager_model, _ = tiny.build("llava", attn_implementation="eager")
    vlmod.compile(eager_model)  # eager attention compiles too
    with pytest.raises(vlmod.errors.InputError, match="has no generate"):
        vlmod.compile(torch.nn.Linear(2, 2))
