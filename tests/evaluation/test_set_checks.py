"""The recipe's set checks (issue 59): the blind ceiling, the one-frame evaluation, the
discrimination arithmetic at 3x, and how they are reported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmod.data import LlavaDataset
from vlmod.data.video import write_video
from vlmod.evaluation.set_checks import (
    _digest,
    answer_blanked_report,
    blanking_answers,
    blind_ceiling,
    chance,
    failures,
    format_set_checks,
    loss_at,
    one_frame_report,
    set_checks,
)
from vlmod.models import tiny


def _record(i: int, qtype: str, question: str, answer: str, media: str = "image") -> dict:
    key = "image" if media == "image" else "video"
    return {"id": f"{qtype}-{i}", key: f"{key}s/{i}.png", "meta": {"type": qtype},
            "conversations": [{"from": "human", "value": f"<{media}>\n{question}"}, {"from": "gpt", "value": answer}]}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def _dense(accuracy: float, by_type: dict[str, float], correct: str) -> dict:
    return {"method": "dense", "target": None, "accuracy": accuracy, "accuracy_by_type": by_type, "correct": correct,
            "language_reduction": 1.0}


def _row(method: str, target: float, reduction: float, accuracy: float, n: int) -> dict:
    right = round(accuracy * n)
    return {"method": method, "target": target, "language_reduction": reduction, "accuracy": right / n,
            "accuracy_by_type": {}, "correct": "1" * right + "0" * (n - right)}


def _sets(tmp_path: Path) -> tuple[Path, Path]:
    """color: always "red" (the text alone answers it); position: the answer follows the question
    text ("where is the red circle ?" is always "top"), balanced over the type; shape: every text
    asked with every answer (nothing but the picture answers it)."""
    shapes = ["circle", "square", "triangle", "star", "cross"]
    train, val = [], []
    for split, n in ((train, 60), (val, 30)):
        for i in range(n):
            split.append(_record(i, "color", f"what color is the {shapes[i % 5]} ?", "red"))
            color, where = [("red", "top"), ("blue", "left"), ("green", "center")][i % 3]
            split.append(_record(i, "position", f"where is the {color} circle ?", where))
            split.append(_record(i, "shape", f"what shape is the {['red', 'blue'][i % 2]} object ?", shapes[(i // 2) % 5]))
    return _write(tmp_path / "train.json", train), _write(tmp_path / "val.json", val)


def test_the_blind_ceiling_is_the_per_question_text_prior_of_the_training_set(tmp_path: Path) -> None:
    """Before: the recipe never asked whether its questions need the picture, so a type answered by
    its text alone (always "red"; or "where is the red circle" always "top") counted as vision.
    Now: the per-question-text prior scores 100% on both and the blind check fails them; the type
    that needs the picture stays at chance and passes."""
    train, val = _sets(tmp_path)
    blind = blind_ceiling(train, val)
    assert blind["color"] == 100.0 and blind["position"] == 100.0
    assert blind["shape"] == 20.0  # each text's answers are balanced over the 5 shapes: the prior is chance
    floor = chance(train)
    assert floor["color"] == 100 / 6 and floor["shape"] == 20.0 and floor["position"] == 100 / 9  # scenes.ANSWERS
    dense = _dense(0.9, {"color": 0.9, "position": 0.9, "shape": 0.9}, "1" * 81 + "0" * 9)
    checks = set_checks([dense], train, val)
    blind_check = next(c for c in checks["checks"] if c["name"] == "blind")
    assert blind_check["pass"] is False and blind_check["failed"] == ["color", "position"]
    assert blind_check["threshold"]["shape"] == 30.0
    assert checks["pass"] is False
    assert any("blind ceiling" in line and "color 100.0%" in line for line in failures(checks))


def test_a_run_too_small_for_a_verdict_measures_every_check_and_judges_none(tmp_path: Path) -> None:
    """Before: no set checks at all. Now: without a verdict (`--quick`) each check still has its
    value, and none passes or fails; the table says so."""
    train, val = _sets(tmp_path)
    dense = _dense(0.5, {"color": 0.5, "position": 0.5, "shape": 0.5}, "10" * 45)
    checks = set_checks([dense], train, val, verdict=False)
    assert checks["pass"] is None and all(c["pass"] is None for c in checks["checks"])
    assert next(c for c in checks["checks"] if c["name"] == "blind")["value"]["color"] == 100.0
    assert not failures(checks)
    table = format_set_checks(checks)
    assert "| blind ceiling: the best score with no vision tokens | 100.0% | 100.0% | 20.0% | - |" in table
    assert "none judged" in table


def test_dense_by_contrast_says_where_the_faint_pictures_lose_their_answers(tmp_path: Path) -> None:
    """Before: a set with faint pictures reported dense overall and by type only, so whether its
    errors were the faint pictures (room graded by what can be seen) or a type not learned could not
    be read off a run. Now: dense per contrast band, from the per-question results in file order, a
    picture's contrast its meta's (the shapes' per object, the fine-detail set's per picture)."""
    train, val = _sets(tmp_path)
    records = json.loads(val.read_text())
    for i, r in enumerate(records):  # 90 questions: 10 at 0.1, 10 at 0.2 (shapes), 10 at 0.4 (a picture), 60 solid
        if i < 20:
            r["meta"]["objects"] = [{"shape": "circle", "contrast": 0.1 if i < 10 else 0.2}, {"shape": "star", "contrast": 0.1 if i < 10 else 0.2}]
        elif i < 30:
            r["meta"]["contrast"] = 0.4
    _write(val, records)
    correct = "0" * 8 + "1" * 2 + "0" * 3 + "1" * 7 + "1" * 10 + "1" * 59 + "0"
    checks = set_checks([_dense(79 / 90, {"color": 0.9}, correct)], train, val)
    assert checks["dense_by_contrast"] == {
        "0-0.15": {"accuracy": 20.0, "questions": 10}, "0.15-0.3": {"accuracy": 70.0, "questions": 10},
        "0.3-0.5": {"accuracy": 100.0, "questions": 10}, "solid": {"accuracy": 100 * 59 / 60, "questions": 60}}
    assert ("Dense by the pictures' contrast (faint ones drawn at under 1): 0-0.15 20.0% (10), 0.15-0.3 70.0% (10), "
            "0.3-0.5 100.0% (10), solid 98.3% (60)") in format_set_checks(checks)
    # A solid set, or a dense row that did not answer the whole file, has no such line.
    (tmp_path / "solid").mkdir()
    assert "dense_by_contrast" not in set_checks([_dense(0.5, {"color": 0.5}, "10" * 45)], *_sets(tmp_path / "solid"))
    assert "dense_by_contrast" not in set_checks([_dense(0.5, {"color": 0.5}, "1" * 40)], train, val)


def test_discrimination_reads_each_method_at_3x_against_dense_on_its_questions(tmp_path: Path) -> None:
    """Before: nothing said whether the set discriminates. Now: random routing's and the best
    training-free method's loss at 3x, from the row at 3x where there is one, else interpolated in
    log reduction between the measured points; each against dense on the questions it answered."""
    n = 10
    dense = _dense(0.9, {"a": 0.9}, "1" * n + "1" * 80 + "0" * 10)  # the first 10 questions: 100%
    rows = [dense,
            _row("random", 2.0, 2.0, 0.9, n), _row("random", 5.0, 5.0, 0.6, n),
            _row("reduce", 3.0, 2.98, 0.8, n), _row("attention", 3.0, 3.01, 0.9, n),
            _row("frames", 2.0, 2.1, 1.0, n)]  # frame subsampling stops short of 3x
    w = math.log(3 / 2) / math.log(5 / 2)
    assert math.isclose(loss_at(rows, "random"), 100 - (90 + w * (60 - 90)))
    assert math.isclose(loss_at(rows, "reduce"), 20.0)  # the 3x row (2.98x measured), on its 10 questions
    assert loss_at(rows, "frames") is None and loss_at(rows, "stride") is None
    checks = {c["name"]: c for c in set_checks(rows, *_sets(tmp_path))["checks"]}
    assert checks["random_loss"]["pass"] is True  # 100 - 76.7: 23.3 points, at least 10
    free = checks["training_free_loss"]
    # The attention router loses 10 points, reduction 20: the best training-free method is attention.
    assert free["method"] == "attention" and math.isclose(free["value"], 10.0) and free["pass"] is True
    assert sorted(free["losses"]) == ["attention", "reduce"]
    rows[4] = _row("attention", 3.0, 3.01, 0.99, n)  # within 3 points of dense: the set does not discriminate
    free = next(c for c in set_checks(rows, *_sets(tmp_path))["checks"] if c["name"] == "training_free_loss")
    assert free["pass"] is False and math.isclose(free["value"], 0.0)
    # Asked of one set of the benchmark, not of each: it alone does not fail a set that needs its
    # pictures (shape questions only) and leaves the dense model room.
    kinds = ["circle", "square", "triangle", "star", "cross"]
    shapes = [_record(i, "shape", "what shape is the red object ?", kinds[i % 5]) for i in range(20)]
    files = _write(tmp_path / "t.json", shapes), _write(tmp_path / "v.json", shapes)
    rows[0] = _dense(0.9, {"shape": 0.9}, "1" * n + "1" * 80 + "0" * 10)
    assert set_checks(rows, *files)["pass"] is True


def test_the_one_frame_evaluation_shows_the_model_the_middle_frame_in_every_position(tmp_path: Path) -> None:
    """Before: nothing checked that the temporal questions need more than one frame. Now: the dense
    model is evaluated on clips whose 8 frames are all the middle one (the model is given identical
    frames, those of frame 4 of the real clip), on the first `limit` clips, scored per type."""
    model, processor = tiny.build("llava_next_video", image_size=32, patch_size=8)
    frames = np.stack([np.full((32, 32, 3), 25 * t, dtype=np.uint8) for t in range(8)])  # each frame its own grey
    records = []
    for i in range(3):
        write_video(tmp_path / f"{i}.mp4", frames, lossless=True)
        records.append({"id": str(i), "video": f"{i}.mp4", "meta": {"type": "direction"}, "conversations": [
            {"from": "human", "value": "<video>\nwhich direction is the red circle moving ?"},
            {"from": "gpt", "value": "left"}]})
    val = _write(tmp_path / "val.json", records)
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["pixel_values_videos"]) if kw.get("pixel_values_videos") is not None else None,
        with_kwargs=True)
    report = one_frame_report(model.eval(), processor, val, frames=8, limit=2, batch_size=2)
    assert len(report.samples) == 2 and set(report.accuracy_by_type) == {"direction"}
    real = LlavaDataset(records, processor, tmp_path, num_frames=8)[0]["pixel_values_videos"][0]  # [T, C, H, W]
    assert not torch.equal(real[0], real[7])  # the clip's frames differ
    assert seen and all(v.shape[1] == 8 for v in seen)
    for batch in seen:
        for clip in batch:
            assert all(torch.equal(clip[t], real[4]) for t in range(8))


def test_answer_blanking_replaces_each_pictures_answer_tokens_by_the_mean_of_its_others(tmp_path: Path) -> None:
    """Before: nothing asked whether a fine-detail answer rests on its own tokens, and on the glyph
    set the dense model still answered 82.2% with them blanked, as dense (its tower spreads each
    glyph over every token), so no choice of tokens could discriminate. Now the answer's projected
    tokens are replaced by the mean of the picture's others (same tokens, no answer there), every
    other token untouched, and the check fails a type the model still answers."""
    from vlmod.data.detail import generate_detail

    generate_detail(tmp_path, num_train=0, num_val=3, seed=1, scale=2, question_types=("digit",))
    model, processor = tiny.build("llava", image_size=96, patch_size=8)
    model.eval()
    records = json.loads((tmp_path / "val.json").read_text())
    data = LlavaDataset(records, processor, tmp_path)
    pixels = torch.stack([data[i]["pixel_values"].reshape(-1, 3, 96, 96)[0] for i in range(3)])
    answers = {_digest(p): r["meta"]["answer_patches"] for p, r in zip(pixels, records, strict=True)}

    def features() -> torch.Tensor:
        with torch.no_grad():
            out = model.model.get_image_features(pixels, vision_feature_layer=model.config.vision_feature_layer,
                                                 vision_feature_select_strategy="default", return_dict=True)
        return torch.stack(list(out.pooler_output)).reshape(3, 144, -1)

    plain = features()
    with blanking_answers(model, answers):
        blanked = features()
    assert torch.equal(features(), plain)  # the hooks are gone
    for i, r in enumerate(records):
        at = r["meta"]["answer_patches"]
        others = [p for p in range(144) if p not in at]
        assert len(at) == 4 and torch.equal(blanked[i, others], plain[i, others])
        assert torch.allclose(blanked[i, at], plain[i, others].mean(0).expand(4, -1), atol=1e-5)
        assert not torch.allclose(blanked[i, at], plain[i, at])
    with blanking_answers(model, {}), pytest.raises(ValueError, match="not in the set whose answers were read"):
        features()
    report = answer_blanked_report(model, processor, tmp_path / "val.json", limit=2, batch_size=2)
    assert len(report.samples) == 2 and set(report.accuracy_by_type) == {"digit"}
    train = _write(tmp_path / "t.json", records)
    dense = _dense(0.9, {"digit": 0.9}, "1" * 3)
    checks = {c["name"]: c for c in set_checks([dense], train, train, answer_blanked={"digit": 0.95},
                                               answer_blanked_samples=3)["checks"]}
    assert checks["answer_tokens"]["pass"] is False and checks["answer_tokens"]["threshold"] == {"digit": 20.0}
    assert "answer tokens: dense, the answer's tokens blanked (first 3 questions)" in format_set_checks(
        {"checks": list(checks.values()), "verdict": True})


def test_a_tiny_llava_can_read_its_patch_embeddings_where_a_patch_changes_its_own_token_only() -> None:
    """Before: `vision_feature_layer=0` (the tower's embeddings) failed inside transformers 5, which
    asks the tower for its hidden states only when the index is truthy. Now it is given by its
    negative twin, and there each token holds its own patch alone: painting one patch changes that
    token and no other, where the last layer's tokens all change (the tower mixes every patch)."""
    for layer, local in ((0, True), (-1, False)):
        model, _ = tiny.build("llava", image_size=32, patch_size=8, vision_feature_layer=layer, seed=0)
        assert model.config.vision_feature_layer == (-3 if layer == 0 else -1)
        pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        painted = pixels.clone()
        painted[:, :, 8:16, 16:24] += 1.0  # patch (1, 2): token 6 of the 4 x 4 grid
        with torch.no_grad():
            a, b = (torch.stack(list(model.model.get_image_features(
                p, vision_feature_layer=model.config.vision_feature_layer, vision_feature_select_strategy="default",
                return_dict=True).pooler_output))[0] for p in (pixels, painted))
        changed = [i for i in range(16) if not torch.allclose(a[i], b[i])]
        assert changed == ([6] if local else list(range(16)))
    with pytest.raises(ValueError, match="indexes the tower's 3 hidden states"):
        tiny.build("llava", vision_feature_layer=3)
