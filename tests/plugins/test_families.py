"""Families beyond LLaVA (Qwen2.5-VL, Qwen3-VL, InternVL, Gemma 3) against the unmodified
transformers model. One row of FAMILIES per family: a tiny random model, its processor, a padded
batch whose rows carry different numbers of image tokens, and the same checks for each."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers import ROOT
from helpers.families import BUILD, FAMILIES
from helpers.inputs import chat_prompt
from PIL import Image

import vlmod
from vlmod import TokenType
from vlmod.cli import main
from vlmod.models import tiny
from vlmod.plugins.calls import output_cache

QUESTIONS = ["what color", "how many objects are in the image", "where is the red circle in this picture ?"]
# Gemma 3 pools every image to 16 tokens: its rows differ in the number of images instead.
SIZES = [[(32, 32)], [(48, 64)], [(64, 40)]]
GEMMA_SIZES = [[(32, 32)], [(32, 32), (40, 48)], [(48, 32)]]


@dataclass
class Family:
    name: str
    model: Any
    processor: Any
    inputs: dict
    rows: list[dict]  # each row processed alone (no padding)


def _row(processor, name: str, question: str, sizes: list[tuple[int, int]], seed: int) -> tuple[str, list]:
    rng = np.random.RandomState(seed)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return prompt, images


def _encode(processor, name: str, rows: list[tuple[str, list]]) -> dict:
    prompts = [p for p, _ in rows]
    images = [imgs for _, imgs in rows] if name == "gemma3" else [i for _, imgs in rows for i in imgs]
    return dict(processor(images=images, text=prompts, return_tensors="pt", padding=True))


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request) -> Family:
    name = request.param
    model, processor = tiny.build(name, **BUILD.get(name, {}))
    sizes = GEMMA_SIZES if name == "gemma3" else SIZES
    rows = [_row(processor, name, q, s, i) for i, (q, s) in enumerate(zip(QUESTIONS, sizes, strict=True))]
    return Family(name, model, processor, _encode(processor, name, rows), [_encode(processor, name, [r]) for r in rows])


def _image_mask(model, inputs: dict) -> torch.Tensor:
    return (inputs["input_ids"] == model.config.image_token_id) & inputs["attention_mask"].bool()


def _expected(model, inputs: dict, capacity: float) -> torch.Tensor:
    image = _image_mask(model, inputs)
    text = inputs["attention_mask"].bool() & ~image
    return text.sum(1) + torch.ceil(image.sum(1) * capacity).long()


def _extend(inputs: dict, sequences: torch.Tensor, new: int) -> dict:
    """The inputs of one forward over the prompt and the first new - 1 generated tokens."""
    full = {**inputs, "input_ids": sequences[:, :-1]}
    batch = sequences.shape[0]
    for key in ("attention_mask", "mm_token_type_ids", "token_type_ids"):
        if key in inputs:
            fill = torch.ones if key == "attention_mask" else torch.zeros
            full[key] = torch.cat([inputs[key], fill(batch, new - 1, dtype=inputs[key].dtype)], dim=1)
    return full


def test_rows_differ_in_image_tokens(fam):
    image = _image_mask(fam.model, fam.inputs).sum(1)
    assert len(set(image.tolist())) >= 2, image
    assert not fam.inputs["attention_mask"].bool().all()  # padded


def test_capacity_one_matches_upstream(fam):
    mod = vlmod.apply_mod(copy.deepcopy(fam.model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    dense = {"gemma3": 2}.get(fam.name, 1)  # Gemma 3: layer 0 and the first full-attention layer
    assert len(vlmod.mod_layers(mod)) == fam.model.config.text_config.num_hidden_layers - dense
    mask = fam.inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = fam.model(**fam.inputs).logits
        got = mod(**fam.inputs).logits
    assert (got[mask] - expected[mask]).abs().max().item() <= 1e-5
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(fam.model.generate(**fam.inputs, **gen), mod.generate(**fam.inputs, **gen))


def test_capacity_half_counts_and_cache(fam):
    mod = vlmod.apply_mod(copy.deepcopy(fam.model), vlmod.MoDConfig(capacity=0.5, layers="all"))
    expected = _expected(fam.model, fam.inputs, 0.5)
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        out = mod(**fam.inputs, use_cache=True)
        dense_logits = fam.model(**fam.inputs).logits
    types = trace.token_types
    image = _image_mask(fam.model, fam.inputs)
    assert torch.equal(types == TokenType.IMAGE, image)
    cache = output_cache(out)
    for (_, layer), processed in trace.processed.items():
        assert torch.equal(processed.sum(1), expected), layer
        assert processed[types == TokenType.INSTRUCTION].all()  # vision start/end, <img>, boi/eoi included
        assert not processed[types == TokenType.PADDING].any()
        assert cache.get_seq_length(layer) == int(expected.max())
        window = getattr(cache.layers[layer], "sliding_window", None)
        stored = cache.layers[layer].keys.shape[-2]
        assert stored == (int(expected.max()) if window is None else min(int(expected.max()), window - 1))
    assert cache.get_seq_length(0) == fam.inputs["input_ids"].shape[1]
    assert not torch.allclose(out.logits, dense_logits)


def test_cached_decoding_matches_recomputing(fam):
    """Greedy decoding through the routed KV cache gives the logits (and so the tokens) that one
    forward over the whole sequence gives at every step: multimodal RoPE at decode, Gemma 3's
    sliding-window cache with rows of different processed counts."""
    mod = vlmod.apply_mod(copy.deepcopy(fam.model), vlmod.MoDConfig(capacity=0.5, layers="all"))
    new = 4
    # A random model may emit image placeholders, which a recomputation would read as images.
    special = fam.processor.tokenizer.all_special_ids
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        gen = mod.generate(
            **fam.inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            suppress_tokens=special, output_logits=True, return_dict_in_generate=True,
        )
    with torch.no_grad():
        logits = mod(**_extend(fam.inputs, gen.sequences, new)).logits[:, -new:]
    steps = torch.stack(gen.logits, dim=1)
    assert torch.allclose(logits, steps, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.index_fill(-1, torch.tensor(special), -torch.inf).argmax(-1), gen.sequences[:, -new:])
    expected = _expected(fam.model, fam.inputs, 0.5)
    for key, processed in trace.processed.items():
        assert torch.equal(processed.sum(1), expected + new - 1), key


def test_padding_does_not_change_real_tokens(fam):
    mod = vlmod.apply_mod(copy.deepcopy(fam.model), vlmod.MoDConfig(capacity=0.5, layers="all"))
    mask = fam.inputs["attention_mask"].bool()
    with torch.no_grad():
        batched = mod(**fam.inputs).logits
        for row, alone in enumerate(fam.rows):
            single = mod(**alone).logits[0]
            assert torch.allclose(batched[row][mask[row]], single, atol=1e-5, rtol=1e-4), row


def test_convert_cli_and_save_load_round_trip(fam, tmp_path):
    plain = tiny.save(fam.name, tmp_path / "plain", **BUILD.get(fam.name, {}))
    out = tmp_path / "mod"
    assert main(["convert", "--model", str(plain), "--out", str(out), "--capacity", "0.5", "--layers", "all"]) == 0
    report = json.loads((out / "vlmod_report.json").read_text())
    loaded = vlmod.load_pretrained(out)
    assert type(loaded) is type(fam.model)
    assert {int(i) for i in report["layers"]["language"]} == {i for _, i in vlmod.mod_layers(loaded)}
    assert report["prediction"]["predicted_speedup"] > 1.0

    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(out)) is type(fam.processor)
    expected = vlmod.apply_mod(copy.deepcopy(fam.model), vlmod.MoDConfig(capacity=0.5, layers="all"))
    with torch.no_grad():
        assert torch.equal(loaded(**fam.inputs).logits, expected(**fam.inputs).logits)
        loaded.model.language_model.mod_router.weight.normal_()
        trained = loaded(**fam.inputs).logits
    loaded.save_pretrained(tmp_path / "again")
    again = vlmod.load_pretrained(tmp_path / "again")
    assert vlmod.mod_layers(again) == vlmod.mod_layers(loaded)
    theirs = loaded.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in again.state_dict().items()) and again.state_dict().keys() == theirs.keys()
    # transformers' own writer does not align tensors in the file and loading maps them, so their
    # alignment picks the CPU kernels (7e-8 apart on Qwen2.5-VL): the same weights in fresh memory
    # give the same logits bit for bit.
    for p in again.parameters():
        p.data = p.data.clone()
    with torch.no_grad():
        assert torch.equal(again(**fam.inputs).logits, trained)
    dense = type(fam.model).from_pretrained(tmp_path / "again")
    assert vlmod.mod_layers(dense) == {}


# -- what is particular to one family -----------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3():
    model, processor = tiny.build("qwen3_vl", patch_size=4)
    rows = [_row(processor, "qwen3_vl", q, s, i) for i, (q, s) in enumerate(zip(QUESTIONS[:2], SIZES[:2], strict=True))]
    return model, processor, _encode(processor, "qwen3_vl", rows)


def test_qwen3_deepstack_reaches_skipped_tokens(qwen3):
    """Deepstack adds vision features after each of the first language layers, outside the layer:
    a visual token that MoD layer 1 skipped leaves it with exactly its input plus those features."""
    model, _, inputs = qwen3
    assert len(model.config.vision_config.deepstack_visual_indexes) >= 2  # layer 1 gets features too
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5, layers=[1]))
    lm = mod.model.language_model
    seen = {}
    hooks = [
        lm.layers[i].register_forward_pre_hook(lambda m, a, k, i=i: seen.__setitem__(i, a[0].clone() if a else k["hidden_states"].clone()), with_kwargs=True)
        for i in (1, 2)
    ]
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        mod(**inputs)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        features = mod.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    deepstack = torch.cat(features.deepstack_features[1], dim=0)
    image = _image_mask(model, inputs)
    added = torch.zeros_like(seen[1])
    added[image] = deepstack.to(added.dtype)
    skipped = image & ~trace.processed[("language", 1)]
    assert torch.equal(skipped.sum(1), image.sum(1) // 2)
    assert torch.allclose(seen[2][skipped], (seen[1] + added)[skipped], atol=1e-6)


def test_qwen_video_tokens_are_routed(qwen3):
    model, processor, _ = qwen3
    rng = np.random.RandomState(0)
    videos = [(rng.rand(frames, 32, 32, 3) * 255).astype("uint8") for frames in (4, 8)]
    prompts = [chat_prompt(processor, q, "video") for q in QUESTIONS[:2]]
    inputs = dict(processor(videos=videos, text=prompts, return_tensors="pt", padding=True, do_sample_frames=False))
    video = (inputs["input_ids"] == model.config.video_token_id) & inputs["attention_mask"].bool()
    assert len(set(video.sum(1).tolist())) == 2
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    with torch.no_grad():
        mask = inputs["attention_mask"].bool()
        assert (mod(**inputs).logits[mask] - model(**inputs).logits[mask]).abs().max() <= 1e-5
    vlmod.remove_mod(mod)
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=0.25, layers=[2]))
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        mod(**inputs)
    processed = trace.processed[("language", 2)]
    assert torch.equal((processed & video).sum(1), torch.ceil(video.sum(1) * 0.25).long())
    assert (trace.token_types[video] == TokenType.VIDEO).all()


def test_gemma3_vision_tower_and_refusals():
    model, processor = tiny.build("gemma3", attn_implementation="eager")
    prompt, images = _row(processor, "gemma3", "what color", [(32, 32)], 0)
    inputs = _encode(processor, "gemma3", [(prompt, images)])
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=1.0, layers="all"), part="vision")
    with torch.no_grad():
        assert (mod(**inputs).logits - model(**inputs).logits).abs().max() <= 1e-5  # eager masks too
    vlmod.remove_mod(mod)
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=0.5, layers=[1]), part="vision")
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        mod(**inputs)
    patches = trace.processed[("vision", 1)]
    assert (patches.sum(1) == math.ceil(0.5 * patches.shape[1])).all()  # SigLIP: no prefix token

    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] must stay dense"):
        vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(layers=[1, 2]))
    flash = copy.deepcopy(model)
    flash.model.language_model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        vlmod.apply_mod(flash, vlmod.MoDConfig())


def test_internvl_vision_tower(fam):
    """InternViT, the tower of every InternVL: its patches routed, the class token always run; at
    capacity 1.0 the whole model (tower and language model converted) is the upstream one."""
    if fam.name != "internvl":
        pytest.skip("InternViT is InternVL's tower")
    mod = vlmod.apply_mod(copy.deepcopy(fam.model), vlmod.MoDConfig(capacity=1.0, layers="all"), part="vision")
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=1.0, layers="all"))
    mask = fam.inputs["attention_mask"].bool()
    with torch.no_grad():
        assert (mod(**fam.inputs).logits[mask] - fam.model(**fam.inputs).logits[mask]).abs().max() <= 1e-5
    vlmod.remove_mod(mod)
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=0.5, layers=[1]), part="vision")
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        mod(**fam.inputs)
    tiles = trace.processed[("vision", 1)]  # [tiles, 1 + patches]
    assert tiles[:, 0].all() and (tiles.sum(1) == 1 + math.ceil(0.5 * (tiles.shape[1] - 1))).all()


def test_unsupported_parts_and_models(qwen3):
    model = qwen3[0]
    with pytest.raises(ValueError, match="packed"):
        vlmod.apply_mod(model, vlmod.MoDConfig(), part="vision")
    with pytest.raises(ValueError, match="part must be"):
        vlmod.apply_mod(model, vlmod.MoDConfig(), part="audio")
    with pytest.raises(TypeError) as err:
        vlmod.apply_mod(torch.nn.Linear(2, 2), vlmod.MoDConfig())
    for name in ("LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                 "InternVLForConditionalGeneration", "Gemma3ForConditionalGeneration", "open_clip"):
        assert name in str(err.value)


# -- encoders: open_clip towers with a timm trunk, Siglip2 (NaFlex) --------------------------------


def test_open_clip_timm_trunk_tower():
    """open_clip's TimmModel (the ViT-*-SigLIP towers): the timm trunk is routed, its attention
    pooling ("map") and open_clip's head still run on every token."""
    import open_clip

    model = open_clip.CLIP(
        embed_dim=192,  # as ViT-B-16-SigLIP: attention pool, no projection
        vision_cfg={"timm_model_name": "vit_tiny_patch16_224", "timm_pool": "map", "timm_proj": "none", "image_size": 224},
        text_cfg={"width": 32, "heads": 4, "layers": 1, "context_length": 8, "vocab_size": 100},
    ).eval()
    images = torch.randn(2, 3, 224, 224)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    with torch.no_grad():
        assert (mod.encode_image(images) - model.encode_image(images)).abs().max() <= 1e-5
    vlmod.remove_mod(mod)
    vlmod.apply_mod(mod.visual, vlmod.MoDConfig(capacity=0.25, layers=[10]))  # the tower alone works too
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        out = mod.encode_image(images)
    assert out.shape == (2, 192)
    assert (trace.processed[("vision", 10)].sum(1) == 1 + math.ceil(0.25 * 196)).all()  # CLS + k patches


@pytest.fixture(scope="module")
def siglip2():
    import transformers as tf

    config = tf.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                    patch_size=4, num_patches=16)
    config._attn_implementation = "sdpa"
    model = tf.Siglip2VisionModel(config).eval()
    rng = np.random.RandomState(0)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in [(16, 16), (16, 48), (32, 32)]]
    inputs = dict(tf.Siglip2ImageProcessor(patch_size=4, max_num_patches=16)(images=images, return_tensors="pt"))
    return model, inputs


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_siglip2_padded_patches_never_count(siglip2, attn):
    model, inputs = siglip2
    model = copy.deepcopy(model)
    model.config._attn_implementation = attn
    real = inputs["pixel_attention_mask"].bool()
    assert len(set(real.sum(1).tolist())) == 2  # the 16 x 48 image has padded patches
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    with torch.no_grad():
        dense, got = model(**inputs), mod(**inputs)
    assert (got.last_hidden_state[real] - dense.last_hidden_state[real]).abs().max() <= 1e-5
    assert (got.pooler_output - dense.pooler_output).abs().max() <= 1e-5
    vlmod.remove_mod(mod)
    vlmod.apply_mod(mod, vlmod.MoDConfig(capacity=0.5, layers="all"))
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        batched = mod(**inputs).pooler_output
        for row in range(3):  # alone: no row with fewer real patches, so no skipped slot to hide
            alone = mod(**{k: v[row : row + 1] for k, v in inputs.items()}).pooler_output[0]
            assert torch.allclose(batched[row], alone, atol=1e-5), row
    for processed in trace.steps[0].values():
        assert torch.equal(processed[0].sum(1), torch.ceil(real.sum(1) * 0.5).long())
        assert not processed[0][~real].any()


@pytest.mark.parametrize(
    "name, layers",
    [
        ("qwen2.5-vl-7b-instruct", "every_other"),
        ("qwen3-vl-8b-instruct", list(range(3, 36, 2))),  # layers 0-2 take deepstack features: dense
        ("internvl3-8b", "every_other"),
        ("gemma-3-4b-it", "every_other"),
    ],
)
def test_convert_configs_of_real_checkpoints(name, layers):
    from vlmod.tools.convert import ConvertOptions

    path = ROOT / "configs" / "convert" / f"{name}.yaml"
    options = ConvertOptions.from_yaml(path)
    assert options.layers == layers and options.dtype == "bfloat16"
    assert options.language_config().capacity == 0.5


@pytest.mark.parametrize("name", FAMILIES)
def test_attention_router_is_the_eager_attention_from_instruction_tokens(name, monkeypatch):
    """The training-free router's keys at layer 3 are the dense model's own layer-3 attention map
    (eager; q/k norms of Qwen3 and Gemma 3 included), averaged over heads and instruction rows."""
    from vlmod.routing.layer import LayerRouting

    seen = {}
    original = LayerRouting.keys
    monkeypatch.setattr(LayerRouting, "keys", lambda self, *a, **k: seen.setdefault(self.layer_idx, original(self, *a, **k)))
    model, processor = tiny.build(name, attn_implementation="eager", **BUILD.get(name, {}))
    sizes = GEMMA_SIZES if name == "gemma3" else SIZES
    inputs = _encode(processor, name, [_row(processor, name, q, s, i) for i, (q, s) in enumerate(zip(QUESTIONS, sizes, strict=True))])
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5, layers=[3], router="attention"))
    with torch.no_grad(), vlmod.trace_routing(mod) as trace:
        mod(**inputs)
        maps = model(**inputs, output_attentions=True).attentions[3]
    types = trace.token_types
    for b in range(types.shape[0]):
        query = types[b] == int(TokenType.INSTRUCTION)
        real = types[b] != int(TokenType.PADDING)
        expected = maps[b][:, query].mean((0, 1))
        torch.testing.assert_close(seen[3][b][real], expected[real], rtol=1e-4, atol=1e-6)
    if name == "gemma3":
        with pytest.raises(ValueError, match="sliding window"):
            vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(layers=[2], router="attention"))
