"""ARank: the rank metric on planted maps, calibration on every family, selection, JSON, script."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT
from PIL import Image

import vlmod
from vlmod.data import DataError, load_records
from vlmod.data.calibration import calibration_batches, calibration_samples
from vlmod.models import tiny
from vlmod.tools.arank import LayerRanks, attention_ranks
from vlmod.tools.calibrate import rank_layers

# ----------------------------------------------------------------------------- planted maps


def _planted(n: int, rank: int, gen: torch.Generator) -> torch.Tensor:
    """A row-stochastic n x n map of rank exactly `rank`: each query belongs to one of `rank`
    groups and the queries of a group share one random key distribution."""
    groups = torch.cat([torch.arange(rank), torch.randint(0, rank, (n - rank,), generator=gen)])
    groups = groups[torch.randperm(n, generator=gen)]
    patterns = torch.softmax(3 * torch.randn(rank, n, generator=gen), dim=-1)
    return patterns[groups]


def _planted_causal(n: int, rank: int, gen: torch.Generator) -> torch.Tensor:
    """A causal (lower-triangular) row-stochastic map of rank `rank`: every key past the first
    `rank` is ignored (an attention sink), so the rows live in a `rank`-dimensional space."""
    logits = 3 * torch.randn(n, n, generator=gen)
    allowed = torch.ones(n, n).tril().bool()
    allowed[:, rank:] = False
    return torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)


def _pad(maps: list[torch.Tensor], length: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Place [H, n, n] maps into [B, H, L, L] with garbage in the padding rows and columns (what
    a fully masked softmax row looks like: uniform over everything), and the real mask."""
    heads = maps[0].shape[0]
    out = torch.full((len(maps), heads, length, length), 1.0 / length)
    real = torch.zeros(len(maps), length, dtype=torch.bool)
    for b, m in enumerate(maps):
        n = m.shape[-1]
        sl = slice(length - n, length) if left else slice(0, n)
        out[b, :, sl, sl] = m
        out[b, :, sl, :][..., ~torch.isin(torch.arange(length), torch.arange(length)[sl])] = 0.7
        real[b, sl] = True
    return out, real


@pytest.mark.parametrize("left", [True, False])
def test_planted_ranks_are_exact_batched_over_heads_and_padding(left):
    gen = torch.Generator().manual_seed(0)
    lengths, ranks = [40, 23, 31], [[1, 5, 12, 23], [2, 7, 3, 23], [31, 9, 1, 16]]
    maps = [torch.stack([_planted(n, r, gen) for r in rs]) for n, rs in zip(lengths, ranks, strict=True)]
    padded, real = _pad(maps, 40, left)
    assert torch.equal(attention_ranks(padded, real), torch.tensor(ranks))
    # Without the mask the garbage rows count: the padding really is what gets removed.
    assert not torch.equal(attention_ranks(padded), torch.tensor(ranks))


def test_planted_causal_maps_keep_their_lower_triangle():
    gen = torch.Generator().manual_seed(1)
    maps = [torch.stack([_planted_causal(n, r, gen) for r in (1, 4, 9)]) for n in (30, 18)]
    padded, real = _pad(maps, 30, left=True)
    assert torch.equal(attention_ranks(padded, real), torch.tensor([[1, 4, 9], [1, 4, 9]]))
    # A causal map with every key allowed is triangular with a positive diagonal: full rank.
    full = torch.softmax(
        torch.randn(1, 2, 12, 12).masked_fill(torch.ones(12, 12).triu(1).bool(), -math.inf), -1
    )
    assert torch.equal(attention_ranks(full), torch.tensor([[12, 12]]))


def test_rank_matches_matrix_rank_of_the_real_block():
    """The definition: torch.linalg.matrix_rank's default tolerance, on the real block, in float32."""
    gen = torch.Generator().manual_seed(2)
    lengths = [48, 17, 33, 48]
    # Sharp softmaxes have singular values spread over many decades, around the tolerance too.
    blocks = [
        torch.softmax(torch.randn(3, n, n, generator=gen) * s, -1)
        for n, s in zip(lengths, (8, 20, 40, 60), strict=True)
    ]
    padded, real = _pad(blocks, 48, left=False)
    ours = attention_ranks(padded.double(), real)
    ref = torch.stack([torch.linalg.matrix_rank(b.float()) for b in blocks])
    assert torch.equal(ours, ref)
    assert ours.min() < 48  # the test exercises ranks below full
    assert torch.equal(
        attention_ranks(torch.zeros(1, 1, 5, 5), torch.zeros(1, 5, dtype=torch.bool)),
        torch.zeros(1, 1, dtype=torch.long),
    )


def test_attention_ranks_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, H, L, L\]"):
        attention_ranks(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="mask"):
        attention_ranks(torch.zeros(2, 1, 4, 4), torch.ones(2, 5, dtype=torch.bool))


# ----------------------------------------------------------------------------- tiny LLaVA


QUESTIONS = [
    "what color is the circle ?",
    "how many",
    "where is the red square in this picture ?",
    "describe the image with one word",
]


def _images(count: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(40, 50, 3) * 255).astype("uint8")) for _ in range(count)]


def _encode(processor, questions, images) -> dict:
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in questions
    ]
    return dict(processor(images=images, text=texts, return_tensors="pt", padding=True))


@pytest.fixture(scope="module")
def llava():
    """A tiny LLaVA whose attention is sharpened layer by layer (a random tiny model attends
    almost uniformly: full rank everywhere), so ranks differ between layers and samples."""
    model, processor = tiny.build("llava")
    with torch.no_grad():
        for i, layer in enumerate(model.model.language_model.layers):
            layer.self_attn.q_proj.weight.mul_(1 + 4 * i)
            layer.self_attn.k_proj.weight.mul_(1 + 4 * i)
    return model, processor, _encode(processor, QUESTIONS, _images(len(QUESTIONS)))


def _stats(r: LayerRanks) -> np.ndarray:
    return np.array([r.mean, r.std, r.normalized, r.normalized_std])


def test_tiny_llava_one_rank_per_layer_reproducible(llava):
    model, _, batch = llava
    first = rank_layers(model, [batch], progress=False)
    again = rank_layers(model, [batch], progress=False)
    layers = model.config.text_config.num_hidden_layers
    assert first.part == "language" and first.family == "llava" and first.dense_layers == [0]
    assert len(first.mean) == len(first.std) == len(first.normalized) == layers
    assert first.num_samples == len(QUESTIONS)
    assert first.tokens == batch["attention_mask"].sum(1).tolist()
    assert all(0 < m <= max(first.tokens) for m in first.mean)
    assert all(0 < v <= 1 for v in first.normalized)
    assert first.normalized[-1] < 1.0  # the sharpest layer lost rank
    assert first == again


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_sample_gives_the_same_ranks_as_alone(llava, side):
    model, processor, _ = llava
    processor.tokenizer.padding_side = side
    try:
        images = _images(len(QUESTIONS))
        batched = _encode(processor, QUESTIONS, images)
        alone = [_encode(processor, [q], [im]) for q, im in zip(QUESTIONS, images, strict=True)]
    finally:
        processor.tokenizer.padding_side = "left"
    assert (batched["attention_mask"] == 0).any()  # some rows really are padded
    together = rank_layers(model, [batched], progress=False)
    separate = rank_layers(model, alone, progress=False)
    assert together.tokens == separate.tokens
    np.testing.assert_allclose(_stats(together), _stats(separate), rtol=1e-12, atol=1e-12)


def _attn_state(model) -> dict:
    configs = {
        "top": model.config._attn_implementation,
        "text": model.config.text_config._attn_implementation,
        "vision": model.config.vision_config._attn_implementation,
        "lm": model.model.language_model.config._attn_implementation,
        "tower": model.model.vision_tower.config._attn_implementation,
    }
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return {"configs": configs, "hooks": hooks, "training": [m.training for m in model.modules()]}


def test_attention_implementation_restored_after_calibration(llava):
    model, _, batch = llava
    before = _attn_state(model)
    assert before["configs"]["text"] == "sdpa"
    for part in ("language", "vision"):
        rank_layers(model, [batch], part=part, progress=False)
        assert _attn_state(model) == before


def test_attention_implementation_restored_after_an_error(llava):
    model, _, batch = llava
    model.model.vision_tower.train()  # a mixed train/eval state must come back as it was
    try:
        before = _attn_state(model)

        def batches():
            yield batch
            bad = dict(batch)
            bad["pixel_values"] = bad["pixel_values"][:, :2]  # wrong channel count: the model raises
            yield bad

        with pytest.raises(RuntimeError):
            rank_layers(model, batches(), progress=False)
        assert _attn_state(model) == before
        # And the model works as before.
        with torch.inference_mode():
            model(**batch)
    finally:
        model.model.vision_tower.eval()


def test_llava_vision_tower_part(llava):
    model, _, batch = llava
    r = rank_layers(model, [batch], part="vision", progress=False)
    assert r.part == "vision" and r.family == "hf_vision" and r.dense_layers == []
    assert len(r.mean) == model.config.vision_config.num_hidden_layers
    assert r.num_samples == len(QUESTIONS)
    assert r.tokens == [17] * len(QUESTIONS)  # CLS + 4x4 patches per image


def test_converted_model_and_bad_batches_are_refused(llava):
    model, _, batch = llava
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    with pytest.raises(ValueError, match="dense model"):
        rank_layers(mod, [batch], progress=False)
    with pytest.raises(ValueError, match="no calibration samples"):
        rank_layers(model, [], progress=False)
    with pytest.raises(TypeError, match="wrap a single batch"):
        rank_layers(model, batch, progress=False)
    with pytest.raises(ValueError, match="part must be"):
        rank_layers(model, [batch], part="audio", progress=False)


# ----------------------------------------------------------------------------- ViT families


def test_timm_vit_ranks_and_restores_fused_attention():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    fused = [b.attn.fused_attn for b in model.blocks]
    x = torch.randn(2, 3, 64, 64)
    r = rank_layers(model, [{"pixel_values": x}, x], part="vision", progress=False)
    assert r.family == "timm" and len(r.mean) == len(model.blocks) == 12
    assert r.num_samples == 4 and r.tokens == [17] * 4
    assert [b.attn.fused_attn for b in model.blocks] == fused
    assert not any(b.attn.attn_drop._forward_hooks for b in model.blocks)
    with pytest.raises(RuntimeError):
        rank_layers(model, [x, torch.randn(2, 4, 64, 64)], progress=False)
    assert [b.attn.fused_attn for b in model.blocks] == fused


def test_hf_clip_vision_model_ranks():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    config._attn_implementation = "sdpa"
    model = CLIPVisionModel(config).eval()
    r = rank_layers(model, [{"pixel_values": torch.randn(3, 3, 32, 32)}], progress=False)
    assert r.family == "hf_vision" and len(r.mean) == 3 and r.tokens == [17] * 3
    assert model.config._attn_implementation == "sdpa"


def test_open_clip_vision_transformer_ranks():
    from open_clip.transformer import VisionTransformer

    model = VisionTransformer(
        image_size=32, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=2.0, output_dim=16
    )
    r = rank_layers(model.eval(), [torch.randn(2, 3, 32, 32)], progress=False)
    assert r.family == "open_clip" and len(r.mean) == 2 and r.tokens == [17, 17]
    assert not any(b.attn._forward_pre_hooks or b.attn._forward_hooks for b in model.transformer.resblocks)


# ----------------------------------------------------------------------------- selection and JSON


def _ranks(normalized, dense=()) -> LayerRanks:
    return LayerRanks(
        part="language",
        mean=[10 * v for v in normalized],
        std=[0.5] * len(normalized),
        normalized=list(normalized),
        normalized_std=[0.05] * len(normalized),
        num_samples=8,
        tokens=[10] * 8,
        family="llava",
        dense_layers=list(dense),
    )


def test_select_orders_by_rank_and_honours_limits():
    r = _ranks([0.2, 0.9, 0.5, 0.3, 0.8, 0.1], dense=[0])
    assert r.select() == [5, 3, 2, 4, 1]  # lowest first; dense layer 0 never
    assert r.select(n=2) == [5, 3]
    assert r.select(threshold=0.5) == [5, 3, 2]
    assert r.select(n=2, threshold=0.9) == [5, 3]
    assert r.select(n=4, threshold=0.35) == [5, 3]  # n caps, the threshold decides
    assert r.select(keep_last=1) == [3, 2, 4, 1]
    assert r.select(keep_first=3, keep_last=1) == [3, 4]
    assert r.select(keep_first=0) == r.select(keep_first=1)  # LLaVA language: keep_first >= 1 in effect
    assert _ranks([0.2, 0.9, 0.5]).select(n=1) == [0]  # a ViT part may convert layer 0
    assert r.select(threshold=0.05) == []


def test_select_rejects_bad_arguments():
    r = _ranks([0.2, 0.9, 0.5, 0.3], dense=[0])
    with pytest.raises(ValueError, match="only 4 layers"):
        r.select(n=5)
    with pytest.raises(ValueError, match="only 3 of 4 can be converted"):
        r.select(n=4)
    for bad in (0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"threshold"):
            r.select(threshold=bad)
    with pytest.raises(ValueError, match="positive"):
        r.select(n=0)
    with pytest.raises(ValueError, match="keep_last"):
        r.select(keep_last=-1)


def test_json_round_trip_is_atomic(tmp_path, llava):
    model, _, batch = llava
    r = rank_layers(model, [batch], progress=False)
    r.suggested = r.select(n=2)
    r.meta = {"model": "tiny"}
    path = r.to_json(tmp_path / "sub" / "ranks.json")
    assert [p.name for p in path.parent.iterdir()] == ["ranks.json"]  # no temp file left
    d = json.loads(path.read_text())
    assert d["layers"][1].keys() == {"layer", "mean_rank", "std_rank", "normalized_rank", "normalized_std"}
    assert "eps(float32)" in d["rank_definition"]
    assert LayerRanks.from_json(path) == r
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a vlmod ARank file"):
        LayerRanks.from_json(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        LayerRanks.from_json(tmp_path / "broken.json")


# ----------------------------------------------------------------------------- calibration data


def _image_dir(root: Path, count: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(_images(count, seed=3)):
        im.save(root / f"img{i}.png")
    return root


def test_llava_json_batches_skip_missing_and_corrupt_images(tmp_path, llava):
    _, processor, _ = llava
    images = _image_dir(tmp_path / "images", 3)
    (images / "corrupt.jpg").write_bytes(b"not a jpeg")
    conv = [
        {"from": "human", "value": "<image>\nwhat color is the circle ?"},
        {"from": "gpt", "value": "red"},
    ]
    records = [{"id": f"r{i}", "image": f"img{i}.png", "conversations": conv} for i in range(3)]
    records += [
        {"id": "missing", "image": "nope.png", "conversations": conv},
        {"id": "corrupt", "image": "corrupt.jpg", "conversations": conv},
        {"id": "text", "conversations": [{"from": "human", "value": "how many"}]},
    ]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records))
    batches = calibration_batches(processor, data, image_root=images, batch_size=2, num_samples=10)
    with pytest.warns(UserWarning, match="skipped 2 sample"):
        out = list(batches)
    assert batches.used == 4 and len(batches.skipped) == 2
    assert sum(len(b["input_ids"]) for b in out) == 4
    assert sum(len(b.get("pixel_values", ())) for b in out) == 3  # the text-only record has none
    assert calibration_samples(data, image_root=images)[0].text == "what color is the circle ?"


def test_llava_json_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_records(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('[{"id": 1,}]')
    with pytest.raises(DataError, match="not valid JSON.*line 1"):
        load_records(tmp_path / "bad.json")
    (tmp_path / "nokey.json").write_text('[{"id": "a", "image": "x.png"}]')
    with pytest.raises(DataError, match="record 0.*'conversations'"):
        load_records(tmp_path / "nokey.json")
    (tmp_path / "noturn.json").write_text('[{"id": "a", "conversations": [{"from": "human"}]}]')
    with pytest.raises(DataError, match="turn 0 needs 'from' and 'value'"):
        load_records(tmp_path / "noturn.json")
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(DataError, match="JSON list"):
        load_records(tmp_path / "obj.json")


# ----------------------------------------------------------------------------- the script


def _script():
    spec = importlib.util.spec_from_file_location("rank_layers_script", ROOT / "scripts" / "rank_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_end_to_end(tmp_path, llava_checkpoint, capsys):
    images = _image_dir(tmp_path / "images", 5)
    out, png = tmp_path / "ranks.json", tmp_path / "ranks.png"
    argv = [
        "--model", str(llava_checkpoint), "--data", str(images), "--prompt", "what color is the circle ?",
        "--num-samples", "4", "--batch-size", "3", "--out", str(out), "--select", "2", "--no-progress",
    ]  # fmt: skip
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        argv += ["--plot", str(png)]
    assert _script().main(argv) == 0
    d = json.loads(out.read_text())
    assert d["num_samples"] == 4 and d["num_layers"] == 4 and len(d["layers"]) == 4
    assert len(d["suggested"]) == 2 and 0 not in d["suggested"]
    assert {"mean_rank", "std_rank", "normalized_rank"} <= d["layers"][0].keys()
    assert LayerRanks.from_json(out).suggested == d["suggested"]
    assert "suggested layers" in capsys.readouterr().out
    if has_mpl:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_script_bad_input_is_one_error_line(tmp_path, llava_checkpoint, capsys, monkeypatch):
    script = _script()
    images = _image_dir(tmp_path / "images", 1)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "model path": ["--model", str(tmp_path / "missing"), "--data", str(images), "--prompt", "what"],
        "data": ["--model", str(llava_checkpoint), "--data", str(tmp_path / "nodata"), "--prompt", "what"],
        "no image files": ["--model", str(llava_checkpoint), "--data", str(empty), "--prompt", "what"],
        "--prompt": ["--model", str(llava_checkpoint), "--data", str(images)],
        "only 4 layers": [
            "--model",
            str(llava_checkpoint),
            "--data",
            str(images),
            "--prompt",
            "what",
            "--select",
            "9",
        ],
    }
    for expected, argv in cases.items():
        assert script.main([*argv, "--out", str(tmp_path / "r.json"), "--no-progress"]) == 2, expected
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # after transformers' weight-loading bar, if any
        assert last.startswith("error:") and expected in last and "Traceback" not in err, err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = [
        "--model",
        str(llava_checkpoint),
        "--data",
        str(images),
        "--prompt",
        "what",
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert script.main(argv) == 2
    assert "--plots needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
