"""The frontier's methods on a tiny LLaVA-NeXT-Video: the video path's token types, pre-LLM
reduction, frame subsampling, set_capacity and capacity-elastic fine-tuning, and their FLOPs."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vlmod
from vlmod.data import LlavaDataset, collate
from vlmod.data.synthetic import generate
from vlmod.data.synthetic_video import (
    FAINT_CONTRAST,
    FAINT_SHARE,
    TEMPORAL_TYPES,
    VIDEO_QUESTION_TYPES,
    video_sample,
)
from vlmod.evaluation.evaluate import evaluate
from vlmod.evaluation.knobs import (
    REACH_TOLERANCE,
    TokenCounts,
    max_reduction,
    mod_language_flops,
    reaches,
    solve_capacity,
    solve_frames,
    solve_keep,
    solve_stacked,
    stacked_language_flops,
)
from vlmod.models import tiny
from vlmod.tools.flops import (
    DecoderDims,
    frame_pooling_flops,
    hf_vision_dims,
    language_prefill_flops,
    vit_flops,
)
from vlmod.tools.reduction import PreLLMReduction, reduction_flops

FRAMES = 4
TOKENS_PER_FRAME = 16  # 32 px, patch 4: an 8 x 8 grid pooled 2 x 2


@pytest.fixture(scope="module")
def video_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clips")
    generate(out, 0, 0, image_size=32, video=True, num_videos=14, num_val_videos=7, num_frames=FRAMES)
    return out


@pytest.fixture(scope="module")
def model_and_processor() -> tuple[torch.nn.Module, object]:
    return tiny.build("llava_next_video", width=64, layers=4, vision_width=32, vision_layers=2, image_size=32,
                      patch_size=4, vision_feature_layer=-1, seed=1)


@pytest.fixture(scope="module")
def batch(video_set: Path, model_and_processor: tuple) -> dict:
    _, processor = model_and_processor
    ds = LlavaDataset(video_set / "video_train.json", processor, num_frames=FRAMES)
    return ds.collate([ds[i] for i in range(3)])


def _prompts(video_set: Path, processor: object, n: int = 3, frames: int = FRAMES) -> dict:
    ds = LlavaDataset(video_set / "video_train.json", processor, num_frames=frames)
    return collate([ds.prompt_inputs(i).inputs for i in range(n)], ds.pad_token_id, "left")


# ----------------------------------------------------------------------------- data


def test_every_clip_question_type_is_drawn_as_its_answer_says() -> None:
    import numpy as np

    from vlmod.data.scenes import ANSWERS

    for qtype in VIDEO_QUESTION_TYPES:
        for answer in ANSWERS[qtype]:
            frames, question, meta = video_sample(np.random.default_rng(7), qtype, answer, 32, 8)
            assert frames.shape == (8, 32, 32, 3) and meta["type"] == qtype
            objects = meta["objects"]
            if qtype == "distinct":
                assert len(objects) == ANSWERS["distinct"].index(answer) + 1
                assert len({o["shape"] for o in objects}) == len(objects)
                spans = sorted(tuple(o["frames"]) for o in objects)
                assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))  # never two at once
            if qtype in ("first", "last"):  # 3-4 kinds, one after another, the answer first (or last)
                assert 3 <= len(objects) <= 4 and len({o["shape"] for o in objects}) == len(objects)
                # the middle frame (the one-frame check's) shows neither the first shape nor the last
                assert not any(o["frames"][0] <= 4 <= o["frames"][1] for o in (objects[0], objects[-1]))
                spans = [tuple(o["frames"]) for o in objects]
                assert spans[0][0] == 0 and spans[-1][1] == 7  # consecutive spans over the clip
                assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:], strict=False))
                assert objects[0 if qtype == "first" else -1]["shape"] == answer == objects[meta["target"]]["shape"]
            if qtype == "when":
                thirds = [(0, 2), (3, 4), (5, 7)]  # 8 frames in three near-equal spans
                assert tuple(objects[0]["frames"]) == thirds[["start", "middle", "end"].index(answer)]
                assert all(o["frames"] == [0, 7] for o in objects[1:])  # a distractor is static, in every frame
            if qtype in ("color", "shape"):  # alone: the model is not asked to find an object by a word
                assert objects[0][qtype] == answer and objects[0]["frames"] == [0, 7]
                assert len(objects) == 1
            if qtype in ("direction", "when", "shape"):  # the named object is the only one of its colour
                assert all(o["color"] != objects[0]["color"] for o in objects[1:])
    assert set(TEMPORAL_TYPES) < set(VIDEO_QUESTION_TYPES)


def test_a_share_of_the_clips_is_faint_every_object_at_one_contrast() -> None:
    import numpy as np

    from vlmod.data.scenes import ANSWERS, paint

    contrasts = []
    for i in range(400):
        qtype = VIDEO_QUESTION_TYPES[i % len(VIDEO_QUESTION_TYPES)]
        _, _, meta = video_sample(np.random.default_rng([3, i]), qtype, ANSWERS[qtype][0], 32, 8)
        assert len({o["contrast"] for o in meta["objects"]}) == 1  # one contrast a clip
        contrasts.append(meta["objects"][0]["contrast"])
    faint = [k for k in contrasts if k < 1.0]
    assert abs(len(faint) / len(contrasts) - FAINT_SHARE) < 0.06
    assert min(faint) >= FAINT_CONTRAST[0] and max(faint) <= FAINT_CONTRAST[1]
    # a contrast scales the coverage: half contrast paints the midpoint of background and colour
    img = np.full((32, 32, 3), 100.0, dtype=np.float32)
    paint(img, {"shape": "square", "color": "red", "center": [16.0, 16.0], "radius": 8.0, "contrast": 0.5})
    assert np.allclose(img[16, 16], (100 + np.asarray([220, 30, 30])) / 2)


def test_clip_questions_need_enough_frames() -> None:
    import numpy as np

    for qtype, answer in (("distinct", "two"), ("first", "star"), ("last", "star")):
        with pytest.raises(ValueError, match="at least 4 frames"):
            video_sample(np.random.default_rng(0), qtype, answer, 32, 3)


# ----------------------------------------------------------------------------- the video path


def test_video_tokens_are_typed_video_and_instruction_tokens_always_run(model_and_processor: tuple, batch: dict) -> None:
    model, _ = model_and_processor
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.25, layers=[1, 2, 3], routable=("video",)))
    try:
        with torch.no_grad(), vlmod.trace_routing(model) as trace:
            model(**batch)
        types = trace.token_types
        video = batch["input_ids"] == model.config.video_token_id
        assert torch.equal(types == vlmod.TokenType.VIDEO, video)
        assert int(video.sum(1)[0]) == FRAMES * TOKENS_PER_FRAME
        instruction = types == vlmod.TokenType.INSTRUCTION
        for processed in trace.processed.values():
            assert bool(processed[instruction].all())
            assert torch.equal(processed[video].view(3, -1).sum(1), torch.full((3,), math.ceil(0.25 * 64)))
    finally:
        vlmod.remove_mod(model)


def test_set_capacity_changes_the_budget_of_every_converted_layer(model_and_processor: tuple, batch: dict,
                                                                  tmp_path: Path) -> None:
    model, processor = model_and_processor
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1, 3], routable=("video",), capacity_schedule="cosine"))
    try:
        vlmod.set_capacity(model, 0.125)
        caps = vlmod.mod_layers(model)
        assert sum(caps.values()) / len(caps) == pytest.approx(0.125) and caps[("language", 1)] > caps[("language", 3)]
        with torch.no_grad(), vlmod.trace_routing(model) as trace:
            model(**batch)
        video = batch["input_ids"] == model.config.video_token_id
        for (_, layer), processed in trace.processed.items():
            assert int(processed[video].view(3, -1).sum(1)[0]) == math.ceil(caps[("language", layer)] * 64)
        model.save_pretrained(tmp_path)
        assert json.loads((tmp_path / "config.json").read_text())["vlmod"]["language"]["capacity"] == 0.125
        with pytest.raises(ValueError, match="capacity must be in"):
            vlmod.set_capacity(model, 1.5)
    finally:
        vlmod.remove_mod(model)
    with pytest.raises(ValueError, match="no MoD layers"):
        vlmod.set_capacity(model, 0.5)


# ----------------------------------------------------------------------------- pre-LLM reduction


def test_reduction_keeping_everything_is_the_model(model_and_processor: tuple, batch: dict, video_set: Path) -> None:
    model, processor = model_and_processor
    full = PreLLMReduction(model, 1.0)
    with torch.no_grad():
        ref, out = model(**batch).logits, full(**batch).logits
    real = batch["attention_mask"].bool()
    assert torch.equal(out[real], ref[real])
    inputs = _prompts(video_set, processor)
    new = full.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(new, model.generate(**inputs, max_new_tokens=3, do_sample=False))


def test_reduction_keeps_its_budget_of_the_most_attended_tokens(model_and_processor: tuple, batch: dict) -> None:
    model, _ = model_and_processor
    reducer = PreLLMReduction(model, 0.3)
    with torch.no_grad():
        reduced = reducer.reduce(batch)
    video = batch["input_ids"] == model.config.video_token_id
    text = batch["attention_mask"].bool() & ~video
    kept = reduced["attention_mask"].sum(1)
    assert torch.equal(kept, text.sum(1) + math.ceil(0.3 * 64))
    index, mask = reduced["index"], reduced["attention_mask"].bool()
    assert torch.equal(reduced["position_ids"][mask], index[mask])  # kept tokens keep their positions
    for row in range(3):  # text always kept, original order kept, filler (padding) on the left
        positions = index[row][mask[row]]
        assert torch.equal(positions, positions.sort().values)
        assert set(text[row].nonzero().flatten().tolist()) <= set(positions.tolist())
        assert not bool(mask[row, : int((~mask[row]).sum())].any())
    # The kept video tokens are the top scores of the tower's CLS attention.
    features, scores, _ = reducer._media(batch)
    top = scores.view(3, 64).topk(math.ceil(0.3 * 64), dim=1).indices.sort(dim=1).values
    first_video = video.float().argmax(1)
    kept_video = [index[r][mask[r] & video[r].gather(0, index[r])] - first_video[r] for r in range(3)]
    assert all(torch.equal(kept_video[r], top[r]) for r in range(3))


def test_reduction_flops_are_the_kept_tokens(model_and_processor: tuple, batch: dict) -> None:
    model, _ = model_and_processor
    reducer = PreLLMReduction(model, 0.25)
    counted = reduction_flops(reducer, batch)
    dims = DecoderDims.from_config(model.config.text_config)
    video = batch["input_ids"] == model.config.video_token_id
    text = float((batch["attention_mask"].bool() & ~video).sum(1).double().mean())
    assert counted["language"] == pytest.approx(language_prefill_flops(dims, text + 16))
    tower = vit_flops(hf_vision_dims(model.config.vision_config)) * FRAMES
    assert tower < counted["vision"] < tower * 1.05  # the tower plus its CLS scoring


def test_reduction_flops_count_a_routed_tower_on_the_patches_it_ran(batch: dict) -> None:
    """At 8x the tower is most of what the stack leaves; routed, its MoD layer counts the patches
    it ran (from the prefill's trace), as `generation_flops` counts it without a reduction."""
    from vlmod.routing.trace import trace_routing
    from vlmod.tools.flops import processed_counts

    model, _ = tiny.build("llava_next_video", width=64, layers=4, vision_width=32, vision_layers=2, image_size=32,
                          patch_size=4, vision_feature_layer=-1, seed=1)
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1], routable=("image",), router="stride"), part="vision")
    reducer = PreLLMReduction(model, 0.25, "novelty")
    with torch.no_grad(), trace_routing(model) as trace:
        reducer(**batch)
    dense, routed = reduction_flops(reducer, batch), reduction_flops(reducer, batch, trace)
    counts = processed_counts(trace.processed, "vision")
    assert counts == {1: 33.0}  # half the 64 patches, and the CLS, which always runs
    dims = hf_vision_dims(model.config.vision_config)
    frames = batch["pixel_values_videos"].shape[1]
    assert dense["vision"] - routed["vision"] == pytest.approx((vit_flops(dims) - vit_flops(dims, counts)) * frames)
    assert routed["language"] == dense["language"]


def test_reduction_stacked_on_mod_routes_the_kept_vision_tokens(model_and_processor: tuple, batch: dict,
                                                                 video_set: Path) -> None:
    """Behind a pre-LLM reduction the language model gets embeddings, where a vision feature is
    not its placeholder's embedding: the kept tokens are still typed video, so MoD routes them,
    and the FLOPs count each MoD layer on what it ran."""
    model, processor = model_and_processor
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.25, layers=[1, 2, 3], routable=("video",)))
    try:
        reducer = PreLLMReduction(model, 0.5, "mean")
        with torch.no_grad(), vlmod.trace_routing(model) as trace:
            reducer(**batch)
        reduced = reducer.reduce(batch)
        video = reduced["input_ids"] == model.config.video_token_id
        kept = reduced["attention_mask"].bool()
        assert torch.equal(trace.token_types == vlmod.TokenType.VIDEO, video & kept)
        assert torch.equal((video & kept).sum(1), torch.full((3,), 32))  # half of 64
        for processed in trace.processed.values():
            assert torch.equal((processed & video).sum(1), torch.full((3,), math.ceil(0.25 * 32)))
            assert bool(processed[kept & ~video].all())  # text always runs
        counted = reduction_flops(reducer, batch, trace)
        dims = DecoderDims.from_config(model.config.text_config)
        tokens = float(kept.sum(1).double().mean())
        routed = {i: tokens - 32 + 8 for i in (1, 2, 3)}
        assert counted["language"] == pytest.approx(language_prefill_flops(dims, tokens, routed))
        assert counted["language"] < reduction_flops(reducer, batch)["language"]
        assert "token_types" not in vars(next(p for p in vlmod.routing.trace.find_parts(model)).adapter)
        new = reducer.generate(**_prompts(video_set, processor), max_new_tokens=3, do_sample=False)
        assert new.shape[1] == _prompts(video_set, processor)["input_ids"].shape[1] + 3
    finally:
        vlmod.remove_mod(model)


@pytest.mark.parametrize("scoring", ["cls", "mean"])
def test_reduction_scores_are_the_towers_own_attention(scoring: str) -> None:
    """Against the CLIP tower's own attention probabilities (eager attention, output_attentions)
    in the layer whose output the projector reads: the CLS row, or the mean over every query."""
    model, _ = tiny.build("llava", width=64, layers=2, vision_width=32, vision_layers=2, image_size=32, patch_size=8,
                          vision_feature_layer=-1, attn_implementation="eager", seed=2)
    pixels = torch.randn(3, 3, 32, 32)
    reducer = PreLLMReduction(model, 0.5, scoring)
    with torch.no_grad():
        _, scores, _ = reducer._media({"pixel_values": pixels})
        probs = model.model.vision_tower(pixels, output_attentions=True).attentions[-1].mean(1)  # [B, L, L]
    expected = probs[:, 0, 1:] if scoring == "cls" else probs.mean(1)[:, 1:]
    assert torch.allclose(scores.view(3, -1), expected, atol=1e-6)
    dims = hf_vision_dims(model.config.vision_config)
    batch = {"input_ids": torch.zeros(3, 20, dtype=torch.long), "attention_mask": torch.ones(3, 20, dtype=torch.long),
             "pixel_values": pixels}
    extra = reduction_flops(reducer, batch)["vision"] - vit_flops(dims)
    width, n = dims.heads * dims.head_dim, dims.num_tokens
    queries = 1 if scoring == "cls" else n
    assert extra == pytest.approx(2 * queries * dims.dim * width + 2 * n * dims.dim * width + 2 * queries * n * width)
    with pytest.raises(ValueError, match="scoring must be one of cls, mean, deviation, novelty"):
        PreLLMReduction(model, 0.5, "max")


def test_reduction_by_deviation_keeps_what_stands_out_of_its_frame(model_and_processor: tuple, batch: dict) -> None:
    """`deviation` ranks each frame's (pooled) features by their distance from that frame's mean
    feature, reads no attention, and counts four passes over the features instead of the scoring."""
    model, _ = model_and_processor
    reducer = PreLLMReduction(model, 0.25, "deviation")
    with torch.no_grad():
        features, scores, _ = reducer._media(batch)
        reduced = reducer.reduce(batch)
    frames = features.view(3 * FRAMES, TOKENS_PER_FRAME, -1)
    expected = (frames - frames.mean(1, keepdim=True)).norm(dim=-1)
    assert torch.allclose(scores.view(3 * FRAMES, -1), expected, atol=1e-5)
    video = batch["input_ids"] == model.config.video_token_id
    first_video, mask = video.float().argmax(1), reduced["attention_mask"].bool()
    top = scores.view(3, -1).topk(math.ceil(0.25 * FRAMES * TOKENS_PER_FRAME), dim=1).indices.sort(dim=1).values
    for row in range(3):
        index = reduced["index"][row]
        assert torch.equal(index[mask[row] & video[row].gather(0, index)] - first_video[row], top[row])
    dim = model.config.text_config.hidden_size
    attention = reduction_flops(PreLLMReduction(model, 0.25, "mean"), batch)
    counted = reduction_flops(reducer, batch)
    assert counted["language"] == attention["language"]
    tower = vit_flops(hf_vision_dims(model.config.vision_config)) * FRAMES + frame_pooling_flops(model, batch) / 3
    assert counted["vision"] == pytest.approx(tower + 4 * dim * FRAMES * TOKENS_PER_FRAME)


def test_reduction_by_novelty_keeps_what_changed_since_the_last_frame(model_and_processor: tuple, batch: dict) -> None:
    """`novelty`: a clip's first frame is ranked by deviation; past it, a feature scores at most its
    distance from the same spot one frame earlier. A clip whose frames repeat its first keeps only
    the first's tokens where that many slots are all it has; counted as seven passes a feature."""
    model, _ = model_and_processor
    reducer = PreLLMReduction(model, 0.25, "novelty")
    with torch.no_grad():
        features, scores, _ = reducer._media(batch)
    clips = features.view(3, FRAMES, TOKENS_PER_FRAME, -1)
    deviation = (clips - clips.mean(2, keepdim=True)).norm(dim=-1)
    expected = deviation.clone()
    for frame in range(1, FRAMES):
        expected[:, frame] = torch.minimum(deviation[:, frame], (clips[:, frame] - clips[:, frame - 1]).norm(dim=-1))
    assert torch.allclose(scores.view(3, FRAMES, -1), expected, atol=1e-5)
    assert (scores.view(3, FRAMES, -1)[:, 1:] < deviation[:, 1:] - 1e-4).any()  # these clips move: it bites

    still = dict(batch, pixel_values_videos=batch["pixel_values_videos"][:, :1].expand_as(batch["pixel_values_videos"]))
    with torch.no_grad():
        reduced = PreLLMReduction(model, 1 / FRAMES, "novelty").reduce(still)
    video = still["input_ids"] == model.config.video_token_id
    first_video, mask = video.float().argmax(1), reduced["attention_mask"].bool()
    for row in range(3):
        index = reduced["index"][row]
        assert torch.equal(index[mask[row] & video[row].gather(0, index)] - first_video[row], torch.arange(TOKENS_PER_FRAME))
    dim = model.config.text_config.hidden_size
    tower = vit_flops(hf_vision_dims(model.config.vision_config)) * FRAMES + frame_pooling_flops(model, batch) / 3
    assert reduction_flops(reducer, batch)["vision"] == pytest.approx(tower + 7 * dim * FRAMES * TOKENS_PER_FRAME)


def test_reduction_by_novelty_is_deviation_on_images() -> None:
    model, _ = tiny.build("llava", width=64, layers=2, vision_width=32, vision_layers=2, image_size=32, patch_size=8,
                          vision_feature_layer=-1, seed=2)
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        _, novelty, _ = PreLLMReduction(model, 0.5, "novelty")._media({"pixel_values": pixels})
        _, deviation, _ = PreLLMReduction(model, 0.5, "deviation")._media({"pixel_values": pixels})
    assert torch.equal(novelty, deviation)
    ids = torch.zeros(3, 20, dtype=torch.long)
    ids[:, 2:18] = model.config.image_token_id  # 16 patches an image
    batch = {"input_ids": ids, "attention_mask": torch.ones(3, 20, dtype=torch.long), "pixel_values": pixels}
    assert reduction_flops(PreLLMReduction(model, 0.5, "novelty"), batch)["vision"] > vit_flops(
        hf_vision_dims(model.config.vision_config))
    assert reduction_flops(PreLLMReduction(model, 0.5, "novelty"), batch) == reduction_flops(
        PreLLMReduction(model, 0.5, "deviation"), batch)


def test_reduction_contextual_tokens_merge_what_the_ranking_drops(model_and_processor: tuple, batch: dict) -> None:
    """VisionZip's contextual tokens: the budget is the same; the best scored tokens but c are
    kept as they are, and c more carry the mean feature of a group of the dropped ones, each
    dropped token in exactly one group."""
    model, _ = model_and_processor
    keep, contextual = 0.3, 0.25
    plain, merging = PreLLMReduction(model, keep), PreLLMReduction(model, keep, contextual=contextual)
    video = batch["input_ids"] == model.config.video_token_id
    k = math.ceil(keep * 64)
    context = math.floor(k * contextual + 0.5)
    with torch.no_grad():
        reduced = merging.reduce(batch)
        features, scores, _ = merging._media(batch)
    assert torch.equal(reduced["attention_mask"].sum(1), plain.reduce(batch)["attention_mask"].sum(1))
    features, scores = features.view(3, 64, -1), scores.view(3, 64)
    first_video = video.float().argmax(1)
    mask = reduced["attention_mask"].bool()
    for row in range(3):
        kept = reduced["index"][row][mask[row] & video[row].gather(0, reduced["index"][row])] - first_video[row]
        embeds = reduced["inputs_embeds"][row][mask[row] & video[row].gather(0, reduced["index"][row])]
        dominant = set(scores[row].topk(k - context).indices.tolist())
        assert dominant <= set(kept.tolist()) and len(kept) == k
        for position, embed in zip(kept.tolist(), embeds, strict=True):
            if position in dominant:
                assert torch.allclose(embed, features[row, position])
        targets = [i for i, p in enumerate(kept.tolist()) if p not in dominant]
        assert len(targets) == context
        # Each target's feature is a mean of dropped features: it lies in their span, and the
        # group sizes add up to every non-dominant token.
        rest = torch.tensor([i for i in range(64) if i not in dominant])
        centres = F.normalize(features[row, kept[targets]], dim=-1)
        groups = (F.normalize(features[row, rest], dim=-1) @ centres.T).argmax(1)
        groups[torch.isin(rest, kept[targets])] = torch.arange(context)
        for g, target in enumerate(targets):
            assert torch.allclose(embeds[target], features[row, rest[groups == g]].mean(0), atol=1e-5)
    with pytest.raises(ValueError, match="contextual must be in"):
        PreLLMReduction(model, keep, contextual=1.0)


def test_reduction_flops_count_the_contextual_similarities(model_and_processor: tuple, batch: dict) -> None:
    model, _ = model_and_processor
    plain, merging = reduction_flops(PreLLMReduction(model, 0.25), batch), reduction_flops(
        PreLLMReduction(model, 0.25, contextual=0.25), batch)
    assert merging["language"] == plain["language"]  # the same kept tokens
    dim = model.config.text_config.hidden_size
    assert merging["vision"] - plain["vision"] == pytest.approx(2 * dim * (64 - 12) * 4)


def test_reduction_refuses_what_it_cannot_rank() -> None:
    llava_next, _ = tiny.build("llava_next")
    with pytest.raises(TypeError, match="pre-LLM reduction supports"):
        PreLLMReduction(llava_next, 0.5)
    onevision, _ = tiny.build("llava_onevision")
    with pytest.raises(TypeError):
        PreLLMReduction(onevision, 0.5)
    llava, _ = tiny.build("llava")
    with pytest.raises(ValueError, match="keep must be in"):
        PreLLMReduction(llava, 0.0)


def test_the_feature_rankings_reduce_a_siglip_tower(model_and_processor: tuple, batch: dict, video_set: Path) -> None:
    """Deviation and novelty read only the features the projector gets: a SigLIP tower (no CLS,
    every feature kept) reduces as a CLIP one; the attention rankings refuse it in one line."""
    import transformers

    model, processor = model_and_processor
    config = copy.deepcopy(model.config)
    vision = config.vision_config
    config.vision_config = transformers.SiglipVisionConfig(
        hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size, num_hidden_layers=vision.num_hidden_layers,
        num_attention_heads=vision.num_attention_heads, image_size=vision.image_size, patch_size=vision.patch_size)
    config.vision_feature_select_strategy = "full"
    torch.manual_seed(0)
    siglip = type(model)(config).eval()
    with torch.no_grad():
        full = PreLLMReduction(siglip, 1.0, "novelty")
        real = batch["attention_mask"].bool()
        assert torch.equal(full(**batch).logits[real], siglip(**batch).logits[real])
        reducer = PreLLMReduction(siglip, 0.25, "novelty")
        reducer(**batch)
        vision = (batch["input_ids"] == config.video_token_id).sum(1)
        assert reducer.last_length == int((batch["attention_mask"].sum(1) - vision + (vision + 3) // 4).max())
        inputs = _prompts(video_set, processor)
        new = reducer.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert new.shape == (3, inputs["input_ids"].shape[1] + 2)
    assert reduction_flops(reducer, batch)["language"] < reduction_flops(full, batch)["language"]
    for scoring in ("cls", "mean"):
        with pytest.raises(ValueError, match="siglip_vision_model: scoring='deviation' or 'novelty' read the features"):
            PreLLMReduction(siglip, 0.5, scoring)


def test_reduction_refuses_images_and_clips_in_one_batch(model_and_processor: tuple, batch: dict) -> None:
    """Its frame grouping counts every picture, so a batch holds one kind of media."""
    model, _ = model_and_processor
    mixed = dict(batch, pixel_values=batch["pixel_values_videos"][:, 0], image_sizes=torch.tensor([[32, 32]] * 3))
    with pytest.raises(ValueError, match="one kind of media a batch, got images and clips together"):
        PreLLMReduction(model, 0.5, "novelty").reduce(mixed)
    attention = PreLLMReduction(model, 0.5, "mean")
    with pytest.raises(ValueError, match="one kind of media a batch"):
        attention.reduce(mixed)
    assert not attention._scoring_block()._forward_pre_hooks  # refused before the tower is hooked


# ----------------------------------------------------------------------------- frame subsampling


def test_frame_subsampling_runs_fewer_frames_and_counts_them(model_and_processor: tuple, video_set: Path) -> None:
    model, processor = model_and_processor
    full = evaluate(model, processor, video_set / "video_val.json", batch_size=8, max_new_tokens=1,
                    progress=False, num_frames=FRAMES)
    half = evaluate(model, processor, video_set / "video_val.json", batch_size=8, max_new_tokens=1,
                    progress=False, num_frames=FRAMES // 2)
    tower = vit_flops(hf_vision_dims(model.config.vision_config))
    assert full.flops_by_part["vision"] == pytest.approx(FRAMES * tower)
    assert half.flops_by_part["vision"] == pytest.approx(FRAMES // 2 * tower)
    dims = DecoderDims.from_config(model.config.text_config)
    drop = full.flops_by_part["language"] - half.flops_by_part["language"]
    text = 20.0  # any text length: the difference of two prefills is what the frames add
    assert drop == pytest.approx(
        language_prefill_flops(dims, text + FRAMES * TOKENS_PER_FRAME) - language_prefill_flops(
            dims, text + FRAMES // 2 * TOKENS_PER_FRAME), rel=0.2)


def test_a_learned_frame_pool_starts_as_the_average_and_counts_its_flops(
    model_and_processor: tuple, video_set: Path
) -> None:
    model, processor = model_and_processor
    conv, _ = tiny.build("llava_next_video", width=64, layers=4, vision_width=32, vision_layers=2, image_size=32,
                         patch_size=4, vision_feature_layer=-1, spatial_pool_mode="conv", seed=1)
    assert tiny.copy_weights(model, conv) == ["model.vision_resampler.pool.weight", "model.vision_resampler.pool.bias"]
    inputs = _prompts(video_set, processor)
    with torch.no_grad():
        assert torch.allclose(conv(**inputs).logits, model(**inputs).logits, atol=1e-5)
    average = evaluate(model, processor, video_set / "video_val.json", batch_size=8, max_new_tokens=1,
                       progress=False, num_frames=FRAMES)
    learned = evaluate(conv, processor, video_set / "video_val.json", batch_size=8, max_new_tokens=1,
                       progress=False, num_frames=FRAMES)
    # Per frame: 16 pooled tokens, each a Linear(4 x 32 -> 32) over its 2 x 2 patches.
    assert learned.flops_by_part["vision"] - average.flops_by_part["vision"] == pytest.approx(
        FRAMES * 2 * TOKENS_PER_FRAME * 4 * 32 * 32)
    assert learned.flops_by_part["language"] == average.flops_by_part["language"]
    reduced = reduction_flops(PreLLMReduction(conv, 0.5), inputs)["vision"]
    assert reduced - reduction_flops(PreLLMReduction(model, 0.5), inputs)["vision"] == pytest.approx(
        FRAMES * 2 * TOKENS_PER_FRAME * 4 * 32 * 32)


# ----------------------------------------------------------------------------- compute points


def test_compute_points_reach_their_targets() -> None:
    dims = DecoderDims(dim=128, layers=8, heads=4, kv_heads=2, head_dim=32, mlp_hidden=256, vocab=200)
    counts = TokenCounts(text=20, vision=127.5, frames=8)  # a mean over samples: no whole slots
    dense = language_prefill_flops(dims, counts.total)
    layers = list(range(1, 8))
    for target in (1.5, 2.0, 3.0):
        c = solve_capacity(dims, counts, target, layers, None)
        assert dense / mod_language_flops(dims, counts, c, layers, None) == pytest.approx(target, rel=1e-6)
        keep = solve_keep(dims, counts, target)
        assert dense / language_prefill_flops(dims, counts.text + keep * counts.vision) == pytest.approx(target, rel=1e-6)
    assert solve_frames(dims, counts, 2.0) == 4 and solve_frames(dims, counts, 100.0) == 1
    assert solve_capacity(dims, counts, 100.0, layers, None) == pytest.approx(1e-4)  # out of reach: the least


@pytest.mark.parametrize("schedule", [None, "cosine"])
def test_compute_points_in_whole_slots_never_land_above_their_flops(schedule: str | None) -> None:
    """k = ceil(capacity * n) rounds up: a capacity solved without it ran 10 of 64 tokens for 9.1
    (2.91x for a 3x point). The solved capacity runs the most slots that stay at or under the target."""
    dims = DecoderDims(dim=128, layers=8, heads=8, kv_heads=2, head_dim=16, mlp_hidden=256, vocab=200)
    counts = TokenCounts(text=10, vision=64)
    dense = language_prefill_flops(dims, counts.total)
    layers = list(range(1, 8))
    for target in (1.5, 2.0, 3.0, 3.5):
        c = solve_capacity(dims, counts, target, layers, schedule)
        assert dense / mod_language_flops(dims, counts, c, layers, schedule) >= target
        assert dense / mod_language_flops(dims, counts, c + 1.5 / 64, layers, schedule) < target  # one slot more
        if schedule is None:
            assert c * 64 == round(c * 64)  # exactly k / n
            keep = solve_keep(dims, counts, target)  # pre-LLM reduction keeps ceil(keep * n) too
            assert dense / language_prefill_flops(dims, counts.text + math.ceil(keep * 64 - 1e-9)) >= target
            assert dense / language_prefill_flops(dims, counts.text + math.ceil(keep * 64 - 1e-9) + 1) < target


def test_stacked_points_split_the_reduction_and_reach_past_mods_ceiling() -> None:
    """Layer 0 dense and the text always run: MoD alone stops near 5x on these counts (the video
    recipe's: 8 layers, 12.5 text and 128 vision tokens); pre-LLM reduction under it shrinks layer
    0's tokens too, so the stack reaches 8x, in whole slots, at or under the point's FLOPs."""
    dims = DecoderDims(dim=128, layers=8, heads=8, kv_heads=2, head_dim=16, mlp_hidden=256, vocab=200)
    counts = TokenCounts(text=12.5, vision=128, frames=8)
    dense = language_prefill_flops(dims, counts.total)
    layers = list(range(1, 8))
    mod = max_reduction(dims, counts, "mod", layers)
    assert 5.0 < mod < 8.0 * (1 - REACH_TOLERANCE) and reaches(mod, 5.0) and not reaches(mod, 8.0)
    assert max_reduction(dims, counts, "stacked", layers) > max_reduction(dims, counts, "frames") > mod
    for target in (1.5, 3.0, 5.0, 8.0):
        keep, capacity = solve_stacked(dims, counts, target, layers, None)
        assert keep * 128 == round(keep * 128) and 0 < capacity <= 1
        kept = math.ceil(keep * 128 - 1e-9)
        assert capacity * kept == pytest.approx(round(capacity * kept))  # whole slots of the kept tokens
        reduction = dense / stacked_language_flops(dims, counts, keep, capacity, layers, None)
        assert target <= reduction < dense / stacked_language_flops(dims, counts, keep, capacity - 1.01 / kept, layers,
                                                                    None) or capacity * kept == 1
        assert reduction < target * 1.1
        # The reduction does its share (the square root) unless MoD could not reach the rest on it.
        assert dense / language_prefill_flops(dims, counts.text + kept) <= target ** 0.5 * 1.05
    # Most of the reduction asked of MoD: the reduction keeps less, so that MoD at its floor reaches.
    keep, capacity = solve_stacked(dims, counts, 8.0, layers, None, share=0.05)
    assert keep < solve_keep(dims, counts, 8.0 ** 0.05) and dense / stacked_language_flops(
        dims, counts, keep, capacity, layers, None) >= 8.0 * (1 - REACH_TOLERANCE)
    assert solve_stacked(dims, counts, 100.0, layers, None) is None  # past the text-only floor


def test_the_recipe_solves_every_point_or_says_it_is_out_of_reach() -> None:
    from vlmod.recipes.points import solve_points
    from vlmod.recipes.settings import RecipeSettings

    dims = DecoderDims(dim=128, layers=8, heads=8, kv_heads=2, head_dim=16, mlp_hidden=256, vocab=200)
    s = RecipeSettings.for_task("video")
    points, ceilings = solve_points(dims, TokenCounts(text=12.5, vision=128, frames=8), s, list(range(1, 8)), 1e5)
    assert [p["target"] for p in points] == [1.5, 2.0, 3.0, 3.5, 5.0, 8.0]
    for p in points:
        for method, ceiling in ceilings.items():
            assert (method in p["out_of_reach"]) == (ceiling < p["target"] * (1 - REACH_TOLERANCE))
        assert (p["capacity"] is None) == ("learned" in p["out_of_reach"])
        assert (p["stack_keep"] is None) == ("stacked" in p["out_of_reach"])
        assert all(v >= p["target"] for m, v in p["predicted"].items() if m != "frames")
    eight = points[-1]
    assert {"learned", "random", "stride", "attention"} <= set(eight["out_of_reach"]) and eight["stack_keep"]
    # Each stacked point solved at its own share: here the reduction takes more of 8x alone.
    assert s.share_at(5.0) == s.share_at(8.0) == 0.85  # the video default: 0.85 everywhere
    shares = RecipeSettings.for_task("video", stack_share={8.0: 0.85, **{t: 0.5 for t in s.targets[:-1]}})
    split, _ = solve_points(dims, TokenCounts(text=12.5, vision=128, frames=8), shares, list(range(1, 8)), 1e5)
    even, _ = solve_points(dims, TokenCounts(text=12.5, vision=128, frames=8),
                           RecipeSettings.for_task("video", stack_share=0.5), list(range(1, 8)), 1e5)
    assert [p["stack_keep"] for p in even[:-1]] == [p["stack_keep"] for p in split[:-1]]
    assert split[-1]["stack_keep"] == eight["stack_keep"] < even[-1]["stack_keep"]
    assert split[-1]["stack_capacity"] > even[-1]["stack_capacity"]
    assert all(a["stack_keep"] < b["stack_keep"] for a, b in zip(points, even, strict=True))


def test_attention_routed_points_count_the_routers_scoring() -> None:
    """`mod_router` attention: ours (MoD alone and stacked) solve their capacities with the
    attention router's scoring counted (on the tokens each layer sees), so they land on the point
    at lower capacities than a learned router's; the random and stride rows keep the learned one's."""
    from vlmod.evaluation.knobs import attention_scoring_flops
    from vlmod.recipes.points import solve_points
    from vlmod.recipes.settings import RecipeSettings

    dims = DecoderDims(dim=128, layers=8, heads=8, kv_heads=2, head_dim=16, mlp_hidden=256, vocab=200)
    counts, layers = TokenCounts(text=10.0, vision=144), list(range(1, 8))
    scoring = attention_scoring_flops(dims, counts)
    dense = language_prefill_flops(dims, counts.total)
    # The stack split by share (`stack_pool` 1): its capacity and keep both move with the scoring.
    learned, _ = solve_points(dims, counts, RecipeSettings.for_task("detail", mod_router="learned", stack_pool=1), layers,
                              scoring)
    attention, reach = solve_points(dims, counts, RecipeSettings.for_task("detail", stack_pool=1), layers, scoring)
    assert "learned" not in reach and reach["mod-attention"] == reach["attention"] < reach["random"]
    assert reach["stacked-attention"] < max_reduction(dims, counts, "stacked", layers)
    for a, b in zip(attention, learned, strict=True):
        assert b["mod_capacity"] == b["capacity"] and a["capacity"] == b["capacity"]
        if a["mod_capacity"] is not None:
            assert a["mod_capacity"] == a["attention_capacity"] < a["capacity"]
            flops = mod_language_flops(dims, counts, a["mod_capacity"], layers, None, scoring)
            assert a["target"] <= dense / flops == a["predicted"]["mod-attention"]
        if a["stack_keep"] is not None:
            flops = stacked_language_flops(dims, counts, a["stack_keep"], a["stack_capacity"], layers, None, True)
            scored = mod_language_flops(dims, TokenCounts(10.0, math.ceil(a["stack_keep"] * 144 - 1e-9)),
                                        a["stack_capacity"], layers, None,
                                        attention_scoring_flops(dims, counts, a["stack_keep"]))
            assert flops == pytest.approx(scored) and a["target"] * (1 - REACH_TOLERANCE) <= dense / flops
            assert a["stack_capacity"] < b["stack_capacity"] or a["stack_keep"] < b["stack_keep"]
        else:
            assert "stacked-attention" in a["out_of_reach"]


def test_the_stacked_stage_trains_at_its_own_split() -> None:
    """`stack_train_share`: the stacked stage's draws are solved at that split (video: 5x at 0.5,
    8x as it runs, 0.85), the points still run at `stack_share`; None: the points' own."""
    from vlmod.errors import InputError
    from vlmod.recipes.points import solve_points, stack_training_points
    from vlmod.recipes.settings import RecipeSettings

    dims = DecoderDims(dim=128, layers=8, heads=8, kv_heads=2, head_dim=16, mlp_hidden=256, vocab=200)
    counts, layers = TokenCounts(text=12.5, vision=128, frames=8), list(range(1, 8))
    s = RecipeSettings.for_task("video")
    points, _ = solve_points(dims, counts, s, layers, 1e5)
    far = [p for p in points if p["target"] > 3.5]
    draws = stack_training_points(dims, counts, s, layers, far)
    assert draws[0] == solve_stacked(dims, counts, 5.0, layers, None, 0.5) != (far[0]["stack_keep"], far[0]["stack_capacity"])
    assert draws[1] == (far[1]["stack_keep"], far[1]["stack_capacity"]) == solve_stacked(dims, counts, 8.0, layers, None, 0.85)
    same = RecipeSettings.for_task("video", stack_train_share=None)
    assert stack_training_points(dims, counts, same, layers, far) == [(p["stack_keep"], p["stack_capacity"]) for p in far]
    with pytest.raises(InputError, match="stack_train_share is the pre-LLM reduction's share of a stacked point"):
        RecipeSettings.for_task("video", stack_train_share={5.0: 1.5})


def test_the_stack_on_pooling_keeps_every_window() -> None:
    """`stack_pool` 2 (the detail recipe's without merging): every stacked point keeps a quarter of the vision
    tokens, MoD's capacity reaching the rest; a point the pooling alone passes runs at capacity
    1.0, past it; the stacked stage draws each (keep, capacity) once."""
    from vlmod.errors import InputError
    from vlmod.evaluation.knobs import solve_stacked_at
    from vlmod.recipes.points import solve_points, stack_training_points
    from vlmod.recipes.settings import RecipeSettings

    dims = DecoderDims(dim=128, layers=8, heads=8, kv_heads=2, head_dim=16, mlp_hidden=256, vocab=200)
    counts, layers = TokenCounts(text=10.0, vision=144), list(range(1, 8))
    s = RecipeSettings.for_task("detail", stack_merge=False)
    assert s.stack_pool == 2
    points, reach = solve_points(dims, counts, s, layers, 1e5)
    dense = language_prefill_flops(dims, counts.total)
    alone = dense / language_prefill_flops(dims, counts.text + 36)  # every window, nothing routed
    for p in points:
        assert p["stack_keep"] == 0.25
        if p["target"] <= alone:  # every window runs: the router scores nothing, so the pooling's reduction
            assert p["stack_capacity"] == 1.0 and p["predicted"]["stacked-attention"] == pytest.approx(alone, rel=1e-3)
        else:
            flops = stacked_language_flops(dims, counts, 0.25, p["stack_capacity"], layers, None, attention=True)
            assert p["target"] * (1 - REACH_TOLERANCE) <= dense / flops <= p["target"] * 1.1
    assert {p["target"] for p in points if p["stack_capacity"] < 1.0} == {5.0, 8.0}
    draws = stack_training_points(dims, counts, s, layers, points)
    assert draws == [(0.25, 1.0)] + [(p["stack_keep"], p["stack_capacity"]) for p in points if p["target"] >= 5]
    assert solve_stacked_at(dims, counts, 2 * reach["stacked-attention"], layers, None, 0.25, True) is None
    with pytest.raises(InputError, match="the video model pools its frames already"):
        RecipeSettings.for_task("video", stack_pool=2)
    with pytest.raises(InputError, match=r"12 x 12 patches do not split into 5 x 5 windows"):
        RecipeSettings.for_task("detail", stack_merge=False, stack_pool=5)


def test_a_row_counts_the_whole_prefill() -> None:
    from types import SimpleNamespace

    from vlmod.evaluation.frontier import format_frontier, out_of_reach, row

    report = SimpleNamespace(flops_by_part={"vision": 4e9, "language": 2e9}, dense_flops_by_part={"vision": 4e9,
                             "language": 10e9}, accuracy=0.5, accuracy_by_type={}, answer_loss=1.0,
                             mean_processed_fraction=0.2, samples=[SimpleNamespace(correct=True)] * 2)
    r = row("learned", 5.0, "capacity 0.1", report, projector=1e9)
    assert r["gflops"] == {"vision": 4.0, "language": 2.0, "projector": 1.0} and r["gflops_total"] == 7.0
    assert r["language_reduction"] == 5.0 and r["total_reduction"] == pytest.approx(15 / 7)
    # Fewer frames: the tower and projector ran less, against the dense model on every frame.
    fewer = row("frames", 5.0, "2 of 8", report, projector=0.25e9,
                dense_reference={"vision": 16e9, "language": 10e9, "projector": 1e9})
    assert fewer["total_reduction"] == pytest.approx(27 / 6.25) and fewer["language_reduction"] == 5.0
    table = format_frontier([r], unreachable=[out_of_reach("attention", 5.0, 4.54)])
    assert "| /5 | out of reach (at most 4.54x) |" in table and "| 7.0000 | 5.00x | 2.14x |" in table


# ----------------------------------------------------------------------------- capacity-elastic fine-tuning


@pytest.mark.parametrize("warmup", [0, 3])
def test_finetune_draws_its_capacity_per_step_and_saves_the_converted_one(
        model_and_processor: tuple, video_set: Path, tmp_path: Path, warmup: int) -> None:
    from vlmod.training.train import TrainConfig, TrainError, train

    model, processor = model_and_processor
    src = tmp_path / "converted"
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1, 2, 3], routable=("video",)))
    try:
        model.save_pretrained(src)
    finally:
        vlmod.remove_mod(model)
    processor.save_pretrained(src)
    seen: list[float] = []
    original = vlmod.api.set_capacity

    def spy(m: torch.nn.Module, c: float, part: str | None = None) -> torch.nn.Module:
        seen.append(c)
        return original(m, c, part)

    cfg = TrainConfig(model=str(src), data=str(video_set / "video_train.json"), output_dir=str(tmp_path / "run"),
                      trainable="router", lr=1e-3, max_steps=6, batch_size=4, num_frames=FRAMES,
                      capacities=[0.125, 0.25], capacity_warmup=warmup)
    import vlmod.api as api

    api.set_capacity = spy
    try:
        result = train(cfg, progress=False)
    finally:
        api.set_capacity = original
    assert set(seen[warmup:6]) == {0.125, 0.25} and seen[-1] == 0.5
    if warmup:  # 1.0 at the first step, then a third, two thirds of the way down to the step's draw
        assert seen[0] == 1.0 and all(0.25 < c < 1.0 for c in seen[1:warmup])
    saved = vlmod.load_pretrained(result.model_dir)
    assert set(vlmod.mod_layers(saved).values()) == {0.5}
    with pytest.raises(TrainError, match="capacities must be"):
        TrainConfig(model="m", data="d", output_dir="o", capacities=[0.0])


def test_step_capacities_fall_from_one_to_the_draw_during_the_warmup() -> None:
    from vlmod.training.loop import step_capacities
    from vlmod.training.train import TrainConfig, TrainError

    def caps(**kw: object) -> list[dict[str, float]]:
        cfg = TrainConfig(model="m", data="d", output_dir="o", **kw)
        return [step_capacities(cfg, {"language": 0.4}, step, 10) for step in range(10)]

    assert caps() == [{}] * 10  # nothing to set: the converted capacity stays
    plain = caps(capacity_warmup=0.5)  # five steps, to the converted capacity
    assert [round(c["language"], 6) for c in plain] == [1.0, 0.88, 0.76, 0.64, 0.52] + [0.4] * 5
    drawn = caps(capacities=[0.2, 0.6])
    warm = caps(capacities=[0.2, 0.6], capacity_warmup=4)
    for step, (d, w) in enumerate(zip(drawn, warm, strict=True)):
        left = max(0.0, 1 - step / 4)
        assert w["language"] == pytest.approx(d["language"] + (1 - d["language"]) * left)
    assert {c["language"] for c in drawn} == {0.2, 0.6}
    with pytest.raises(TrainError, match="capacity_warmup must be >= 0"):
        TrainConfig(model="m", data="d", output_dir="o", capacity_warmup=-1)


def test_distillation_loss_is_zero_only_for_the_teacher() -> None:
    from vlmod.data.answers import next_token_labels
    from vlmod.training.distill import distillation_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.full((2, 5), -100)
    labels[:, 3:] = 4
    labels = next_token_labels(labels)  # what each position's logits predict
    assert float(distillation_loss(logits, logits, labels)) == pytest.approx(0.0, abs=1e-6)
    other = logits.clone()
    other[:, 2:4] += torch.randn(2, 2, 11)
    assert float(distillation_loss(other, logits, labels)) > 0.01
    early = logits.clone()
    early[:, :2] += torch.randn(2, 2, 11)  # positions that predict no answer token do not count
    assert float(distillation_loss(early, logits, labels)) == pytest.approx(0.0, abs=1e-6)
    # Over a given token count (a process's share of the global count in a multi-process run)
    # it is the sum over tokens divided by that count: with this batch's own count, the mean.
    mean = distillation_loss(other, logits, labels)
    assert float(distillation_loss(other, logits, labels, num_items=4)) == pytest.approx(float(mean))
    assert float(distillation_loss(other, logits, labels, num_items=torch.tensor(8.0))) == pytest.approx(float(mean) / 2)


def _row(method: str, correct: str, target: float | None = None, reduction: float = 1.0, samples: int = 400) -> dict:
    # `samples`: the eval set's size the verdict rule reads (vlmod.evaluation.evidence); 400 by
    # default, so these tests read the verdicts' own logic, not the toy-run rule.
    return {"method": method, "target": target, "accuracy": correct.count("1") / len(correct),
            "language_reduction": reduction, "correct": correct, "samples": samples, "accuracy_by_type": {}}


def test_a_toy_run_gives_no_verdict() -> None:
    """Before: `vlmod recipe --quick` (7 questions, every model 0.0%) wrote "goal ... met ... the
    interval stays within it" and "best of all methods" at every point. Now: without a dense model
    10 points above chance on at least 200 questions there is no verdict, one line says why."""
    from vlmod.evaluation.evidence import chance_accuracy, verdict_evidence
    from vlmod.evaluation.frontier import verdicts

    toy = [{**_row("dense", "0" * 7, samples=7), "accuracy_by_type": {"when": 0.0, "first": 0.0}},
           {**_row("learned", "0" * 7, 3.0, 3.0, samples=7), "accuracy_by_type": {"when": 0.0, "first": 0.0}}]
    lines = verdicts(toy, {3.0: 1.0})
    assert lines == ["This run checks the pipeline only, so it gives no verdict (7 questions, a verdict needs "
                     "at least 200; dense 0.0% is not 10 points above chance 26.7%)."]
    assert not any("met" in line or "best of all" in line for line in lines)
    assert chance_accuracy(["when", "first"]) == pytest.approx((1 / 3 + 1 / 5) / 2)
    assert chance_accuracy(["a real question"]) is None
    # Enough questions but dense at chance: still none; 10 points above it: a verdict.
    assert not verdict_evidence(0.45, 400, 0.4).enough and verdict_evidence(0.51, 400, 0.4).enough
    assert not verdict_evidence(0.95, 199, 0.2).enough
    big = [_row("dense", "1" * 90 + "0" * 10), _row("learned", "1" * 90 + "0" * 10, 3.0, 3.0)]
    assert "met by MoD" in verdicts(big, {3.0: 1.0})[-1]


def test_the_gap_to_dense_is_paired_per_question() -> None:
    from vlmod.evaluation.frontier import paired_gap, verdicts

    dense = _row("dense", "1" * 90 + "0" * 10)
    same = _row("learned", "1" * 90 + "0" * 10, 3.0, 3.0)
    assert paired_gap(same, dense) == (0.0, 0.0, 0.0)  # the same answers: no noise at all
    swapped = _row("learned", "0" * 10 + "1" * 80 + "0" * 10, 3.0, 3.0)  # 10 questions lost, none gained
    gap, low, high = paired_gap(swapped, dense)
    assert gap == pytest.approx(-10.0) and low < gap < high
    # d is -1 on 10 of 100 questions: sd = sqrt(0.1 * 0.9 * 100 / 99), half width 1.96 sd / 10
    assert high - gap == pytest.approx(100 * 1.96 * math.sqrt(0.09 * 100 / 99) / 10)
    assert paired_gap(swapped, {"correct": ""}) is None  # no per-question marks: no pairing
    # A baseline that answered the first 50 questions is paired with MoD on those 50 only.
    assert paired_gap(swapped, _row("dense", "1" * 50)) == pytest.approx((-20.0, -31.3, -8.7), abs=0.1)
    one_off = _row("learned", "0" + "1" * 89 + "0" * 10, 3.0, 3.0)  # -1 point, one question
    lines = verdicts([dense, one_off], {3.0: 1.0})
    assert lines[0].startswith("/3 (3.00x fewer LM FLOPs measured): MoD 89.0% (-1.0 points vs dense, 95% interval")
    assert "met by MoD (at 3.00x" in lines[-1] and "within this eval set's noise" in lines[-1]
    assert "the interval stays within it" in verdicts([dense, same], {3.0: 1.0})[-1]
    # A point whose interval stays within the goal wins over a more reducing one inside the noise.
    further = _row("learned", "0" + "1" * 89 + "0" * 10, 3.5, 3.6)
    assert "met by MoD (at 3.00x" in verdicts([dense, same, further], {3.0: 1.0})[-1]
    assert verdicts([dense, swapped], {3.0: 1.0})[-1].endswith("NOT met (MoD 80.0% at 3.00x)")
    assert verdicts([dense], {8.0: 2.0})[-1].endswith("out of reach")


def test_the_goals_read_the_best_of_ours_against_dense_and_the_control() -> None:
    """MoD alone or stacked on the reduction, whichever is more accurate at a point, stands for
    ours; each goal has its own tolerance, and a control gets its own verdict."""
    from vlmod.evaluation.frontier import verdicts

    dense = _row("dense", "1" * 95 + "0" * 5)
    control = _row("dense-control", "1" * 96 + "0" * 4)
    mod = _row("learned", "1" * 85 + "0" * 15, 3.0, 3.0)  # -10 points
    stacked = _row("stacked", "1" * 95 + "0" * 5, 3.0, 3.05)  # on par
    far = _row("stacked", "1" * 93 + "0" * 7, 8.0, 8.0)  # -2 points: inside 8x's 2, not 5x's 1
    lines = verdicts([dense, control, mod, stacked, far], {3.0: 1.0, 5.0: 1.0, 8.0: 2.0})
    assert lines[0].startswith("/3 (3.05x fewer LM FLOPs measured): MoD stacked on pre-LLM reduction 95.0%")
    assert "; MoD 85.0%: best of all methods" in lines[0]
    assert "MoD alone out of reach" in lines[1]
    goal3, goal5, goal8 = lines[-3:]
    assert goal3.startswith("goal (3x fewer LM prefill FLOPs within 1 point of dense 95.0%): met by MoD stacked")
    assert "of the control 96.0%: met by MoD stacked on pre-LLM reduction (at 3.05x, -1.0 points vs the control" in goal3
    assert goal5.endswith("out of reach; of the control 96.0%: out of reach")
    assert "within 2 points of dense 95.0%): met by MoD stacked" in goal8
    assert "of the control 96.0%: NOT met (MoD stacked on pre-LLM reduction 93.0% at 8.00x)" in goal8


def test_a_baseline_on_the_first_questions_is_compared_with_mod_on_the_same_questions() -> None:
    from vlmod.evaluation.frontier import verdicts

    dense = _row("dense", "1" * 100)
    mod = _row("learned", "0" * 30 + "1" * 70, 3.0, 3.0)  # 70% overall, 25% on the first 40
    baseline = _row("random", "1" * 20 + "0" * 20, 3.0, 3.0)  # 50% on the first 40: better there
    assert "beaten by random (50.0%)" in verdicts([dense, mod, baseline])[0]
    worse = _row("random", "0" * 30 + "1" * 10, 3.0, 3.0)  # 25% on the first 40: a tie is no defeat
    assert "best of all methods" in verdicts([dense, mod, worse])[0]
    # Past MoD's reach the stack stands for it, compared on the questions both answered.
    stacked = _row("stacked", "1" * 30 + "0" * 10, 8.0, 8.0)
    reduce = _row("reduce", "1" * 35 + "0" * 5, 8.0, 8.0)
    line = verdicts([dense, mod, stacked, reduce])[1]
    assert line.startswith("/8 (8.00x fewer LM FLOPs measured): MoD stacked on pre-LLM reduction (MoD alone out of reach) 75.0%")
    assert line.endswith("beaten by reduce (87.5%)")


def test_a_curve_on_the_first_questions_says_so_and_ends_at_dense_on_them() -> None:
    """The recipe's baselines answer the first N questions: their legend says so and their curve
    ends at dense on those N, not on every question."""
    from vlmod.evaluation.frontier import METHOD_LABELS, curve_label

    dense = {"method": "dense", "accuracy": 0.5, "samples": 4, "correct": "1100"}
    ours = [{"method": "learned", "accuracy": 0.5, "samples": 4, "correct": "1010"}]
    baseline = [{"method": "random", "accuracy": 0.5, "samples": 2, "correct": "10"}]
    assert curve_label("learned", ours, dense) == (METHOD_LABELS["learned"], 0.5)
    assert curve_label("random", baseline, dense) == (f"{METHOD_LABELS['random']} (first 2 questions)", 1.0)
