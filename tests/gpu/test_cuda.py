"""On a CUDA GPU (skipped without one): MoD at capacity 1.0 is the unmodified model in bfloat16
under each attention kernel transformers offers here, a MoD decode step makes no host sync
(`torch.cuda.set_sync_debug_mode("error")`, upstream's own one set aside), and the benchmarks run
with every timing waiting for the GPU."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from helpers.inputs import padded_batch

import vlmod
from vlmod.models import tiny
from vlmod.tools.cache import generate_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")

DTYPE = torch.bfloat16
GENERATE = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
KERNELS = ["sdpa", "eager", "flash_attention_2"]


def _cuda_inputs(processor, family: str) -> dict:
    return {
        k: v.to("cuda", DTYPE if v.is_floating_point() else None) for k, v in padded_batch(processor, family).items()
    }


def _kernel(name: str) -> str:
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attention_2 needs the flash-attn package, which is not installed here")
    return name


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", ["llava", "llava_next_video"])
def test_capacity_one_is_the_upstream_model_on_cuda(family, kernel):
    model, processor = tiny.build(family, attn_implementation=_kernel(kernel))
    model = model.to("cuda", DTYPE)
    inputs = _cuda_inputs(processor, family)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    with torch.inference_mode():
        expected, got = model(**inputs).logits, mod(**inputs).logits
    real = inputs["attention_mask"].bool()
    err = ((got[real] - expected[real]).abs().max() / expected[real].abs().max()).item()
    assert err <= 2 * torch.finfo(DTYPE).eps
    assert torch.equal(mod.generate(**inputs, **GENERATE), model.generate(**inputs, **GENERATE))


def _decode_steps(model, processor, cache: str, steps: int = 3) -> None:
    """Prefill a padded batch of two, then `steps` decode steps under
    `torch.cuda.set_sync_debug_mode("error")`: any host sync raises."""
    inputs = _cuda_inputs(processor, "llava")
    kwargs = generate_cache(model, steps + 1) if cache == "preallocated" else {}
    with torch.inference_mode():
        out = model(**inputs, **kwargs, use_cache=True, logits_to_keep=1)
        past, token, mask = out.past_key_values, out.logits[:, -1:].argmax(-1), inputs["attention_mask"]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = model(input_ids=token, attention_mask=mask, past_key_values=past, use_cache=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            token = out.logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("cache", ["preallocated", "dynamic"])
def test_mod_decode_step_makes_no_host_sync(cache, monkeypatch):
    """transformers' own decode step syncs once, where its mask code asks whether the padding mask
    is all ones (`_ignore_causal_mask_sdpa`); with that question answered "no" on the device's
    behalf, neither the dense model nor its MoD conversion syncs: routing, gates, token types and
    key-slot records stay on the GPU."""
    import transformers.masking_utils as masking

    model, processor = tiny.build("llava")
    dense = model.to("cuda", DTYPE)
    mod = vlmod.apply_mod(copy.deepcopy(dense), vlmod.MoDConfig(capacity=0.5, layers="every_other"))
    with pytest.raises(RuntimeError, match="synchroniz"):  # the probe is live: upstream's own sync
        _decode_steps(dense, processor, cache, steps=1)
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    _decode_steps(dense, processor, cache)
    _decode_steps(mod, processor, cache)


def test_bench_llava_times_the_gpu():
    from vlmod.bench import bench_llava

    result = bench_llava(preset="tiny", device="cuda", dtype="bfloat16", new_tokens=3, warmup=1, repeats=2,
                         progress=False)
    assert result["device"].startswith("cuda") and result["dtype"] == "bfloat16"
    assert result["dense"]["peak_memory_bytes"] > 0 and result["mod"]["peak_memory_bytes"] > 0
    assert result["contention"]["prefill"]["others_cores"] is None  # judged by spread on a GPU


def test_compiled_decoding_on_cuda_graphs():
    """vlmod.compile on a GPU (reduce-overhead: CUDA graphs) in bfloat16: a MoD model decodes the
    eager tokens, and a second request of the same shape replays without recompiling."""
    model, processor = tiny.build("llava")
    mod = vlmod.apply_mod(model.to("cuda", DTYPE), vlmod.MoDConfig(capacity=0.5, layers="every_other"))
    from vlmod.bench.ops import tiny_inputs

    inputs = {
        k: v.to("cuda", DTYPE if v.is_floating_point() else None) for k, v in tiny_inputs("llava", processor).items()
    }
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        eager = mod.generate(**inputs, **gen, **generate_cache(mod, 16))
        vlmod.compile(mod)
        torch._dynamo.reset()
        first = mod.generate(**inputs, **gen, **generate_cache(mod, 16))
        with torch.compiler.set_stance("fail_on_recompile"):
            again = mod.generate(**inputs, **gen, **generate_cache(mod, 16))
    assert torch.equal(first, eager) and torch.equal(again, eager)
