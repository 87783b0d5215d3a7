"""The fine-detail set (`vlmod.data.detail`): answers that rest on at most 5% of the vision tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmod.data.detail import (
    DETAIL_ANSWERS,
    DETAIL_TYPES,
    MAX_ANSWER_SHARE,
    answer_share,
    box_patches,
    check_resolution,
    generate_detail,
    glyph_mask,
)
from vlmod.errors import InputError


@pytest.fixture(scope="module")
def detail_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("detail")
    generate_detail(out, num_train=60, num_val=30, seed=3)
    return out


def _records(folder: Path, split: str) -> list[dict]:
    return json.loads((folder / f"{split}.json").read_text())


def test_the_same_seed_writes_the_same_bytes(detail_set: Path, tmp_path: Path) -> None:
    generate_detail(tmp_path / "again", num_train=60, num_val=30, seed=3)
    generate_detail(tmp_path / "other", num_train=60, num_val=30, seed=4)
    files = sorted(p.relative_to(detail_set) for p in detail_set.rglob("*") if p.is_file())
    assert len(files) == 60 + 30 + 3
    for rel in files:
        assert (tmp_path / "again" / rel).read_bytes() == (detail_set / rel).read_bytes(), rel
    assert (tmp_path / "other" / "train.json").read_bytes() != (detail_set / "train.json").read_bytes()


def test_every_answer_rests_on_at_most_5_percent_of_the_vision_tokens(detail_set: Path) -> None:
    """Every record of both splits, at the set's resolution (96 px, 8 px patches: 144 tokens):
    the patches its answer boxes touch are the ones it records, at most 5% of the tokens."""
    meta = json.loads((detail_set / "meta.json").read_text())
    size, patch = meta["image_size"], meta["patch_size"]
    assert (size, patch) == (96, 8)
    for split in ("train", "val"):
        for r in _records(detail_set, split):
            m = r["meta"]
            assert answer_share(m, size, patch) <= MAX_ANSWER_SHARE
            assert len(m["answer_patches"]) / (size // patch) ** 2 == answer_share(m, size, patch)
            assert sorted({p for b in m["answer_boxes"] for p in box_patches(b, size, patch)}) == m["answer_patches"]
            # One patch an item: a glyph or marker never straddles two patches.
            assert all(len(box_patches(b, size, patch)) == 1 for b in m["answer_boxes"])
            answer = r["conversations"][-1]["value"]
            expected_items = DETAIL_ANSWERS["count_small"].index(answer) if m["type"] == "count_small" else 1
            assert len(m["answer_patches"]) == expected_items


def test_answers_are_in_the_vocabulary_balanced_and_in_the_tiny_tokenizer(detail_set: Path) -> None:
    from vlmod.models.tiny import WORDS

    records = _records(detail_set, "train")
    assert [r["meta"]["type"] for r in records[:6]] == list(DETAIL_TYPES) * 2
    for qtype in DETAIL_TYPES:
        answers = [r["conversations"][-1]["value"] for r in records if r["meta"]["type"] == qtype]
        assert set(answers) <= set(DETAIL_ANSWERS[qtype])
        counts = [answers.count(a) for a in DETAIL_ANSWERS[qtype]]
        assert max(counts) - min(counts) <= 1
    words = {w for r in records for turn in r["conversations"] for w in turn["value"].replace("<image>", "").split()}
    assert words <= set(WORDS)


def test_the_question_names_one_item_and_its_box_holds_the_answer(detail_set: Path) -> None:
    """The asked colour names one glyph (digit), the asked digit one glyph (small_color), the asked
    colour only the markers counted (count_small); the answer's boxes are where those items were
    drawn (a glyph's pixels are its bitmap in its colour), so the share is computed from the
    geometry the answer rests on."""
    _check_answers(detail_set)


def _check_answers(detail_set: Path, scale: int = 1) -> None:
    from vlmod.data.scenes import COLORS

    for r in _records(detail_set, "train") + _records(detail_set, "val"):
        m, answer = r["meta"], r["conversations"][-1]["value"]
        words = r["conversations"][0]["value"].split()
        img = np.asarray(Image.open(detail_set / r["image"]), dtype=np.int16)
        if m["type"] == "count_small":
            color = words[words.index("small") + 1]
            counted = [o for o in m["objects"] if o.get("small") and o["color"] == color]
            assert len(counted) == DETAIL_ANSWERS["count_small"].index(answer)
            assert sorted(o["box"] for o in counted) == sorted(m["answer_boxes"])
            assert all(g["color"] != color for g in m["glyphs"])
            continue
        if m["type"] == "digit":
            (target,) = [g for g in m["glyphs"] if g["color"] == words[words.index("the") + 1]]
            assert DETAIL_ANSWERS["digit"][target["digit"]] == answer
        else:
            (target,) = [g for g in m["glyphs"] if DETAIL_ANSWERS["digit"][g["digit"]] == words[words.index("the") + 1]]
            assert target["color"] == answer
        assert m["answer_boxes"] == [target["box"]]
        x0, y0, x1, y1 = target["box"]
        drawn = (img[y0:y1, x0:x1] == np.array(COLORS[target["color"]])).all(axis=-1)
        assert np.array_equal(drawn, glyph_mask(target["digit"], scale))


def test_a_resolution_whose_answers_exceed_5_percent_is_refused_in_one_line(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """64 px at 8 px patches is 64 tokens: four markers would be 6.2% of them. The recipe refuses
    it before any stage (no folder made), as the generator does."""
    from vlmod.cli import main

    with pytest.raises(InputError, match=r"up to 6.2% of the 64 vision tokens, over 5%: give an image size of at least 72"):
        check_resolution(64, 8)
    with pytest.raises(InputError, match="patch size >= 8"):
        generate_detail(tmp_path / "set", 3, 3, image_size=96, patch_size=4)
    check_resolution(72, 8)
    assert main(["recipe", "--task", "detail", "--quick", "--image-size", "64", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    # The recipe's set (a glyph over 2 x 2 patches): 4 of 64 tokens, 6.2% too; its cells are 16 px.
    assert err.startswith("error: at image 64 px, patch 8 px, glyph scale 2 the fine-detail answers cover up to 6.2% of "
                          "the 64 vision tokens, over 5%: give an image size of at least 80 px")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_the_tower_learns_each_patchs_digit_on_a_detail_set(detail_set: Path) -> None:
    """Tower pretraining reads a detail set's glyphs as a third label row (each patch's digit, 10:
    none), and a glyph's patch is labelled with the glyph's colour, which the questions name it by."""
    from vlmod.data.scenes import COLORS
    from vlmod.training.tower_pretrain import NO_DIGIT, scene_images

    images, targets = scene_images(detail_set / "train.json", 96, 8)
    records = _records(detail_set, "train")
    assert len(images) == len(records) and targets.shape == (len(records), 3, 144)
    for r, t in zip(records, targets, strict=True):
        expected = np.full(144, NO_DIGIT)
        for g in r["meta"]["glyphs"]:
            expected[box_patches(g["box"], 96, 8)] = g["digit"]
            assert t[1, box_patches(g["box"], 96, 8)].tolist() == [list(COLORS).index(g["color"])]
        assert np.array_equal(t[2], expected)
    assert sum((t[2] != NO_DIGIT).sum() for t in targets) == sum(len(r["meta"]["glyphs"]) for r in records)


def test_chance_of_the_detail_types_is_known() -> None:
    """So a detail run's verdict rule counts points above chance, as on the shapes set."""
    from vlmod.evaluation.evidence import chance_accuracy

    assert chance_accuracy(DETAIL_TYPES) == pytest.approx((1 / 10 + 1 / 5 + 1 / 6) / 3)


def test_training_clutter_runs_from_none_and_validation_keeps_the_busy_pictures(detail_set: Path, tmp_path: Path) -> None:
    """The curriculum (on by default) draws the training pictures' clutter glyphs from 0 up;
    validation keeps 5-8 wherever they fit. Off, training is drawn as validation is."""
    def clutter(records: list[dict]) -> list[int]:
        return [len(r["meta"]["glyphs"]) - (r["meta"]["type"] != "count_small") for r in records]

    train, val = clutter(_records(detail_set, "train")), clutter(_records(detail_set, "val"))
    assert min(train) == 0 and np.mean(train) < np.mean(val) and min(val) >= 3
    generate_detail(tmp_path / "flat", num_train=60, num_val=0, seed=3, curriculum=False)
    assert min(clutter(_records(tmp_path / "flat", "train"))) >= 3
    assert (tmp_path / "flat" / "train.json").read_bytes() != (detail_set / "train.json").read_bytes()


def test_caption_records_name_every_glyph_and_marker_in_reading_order(tmp_path: Path) -> None:
    from vlmod.models.tiny import WORDS

    generate_detail(tmp_path / "set", num_train=9, num_val=3, seed=5, captions=True)
    train = _records(tmp_path / "set", "train")
    assert len(train) == 18 and len(_records(tmp_path / "set", "val")) == 3
    for question, described in zip(train[:9], train[9:], strict=True):
        m = question["meta"]
        assert described["image"] == question["image"] and described["meta"]["type"] == "caption"
        said = described["conversations"][-1]["value"].split(" , ")
        by_words = {f"{g['color']} {DETAIL_ANSWERS['digit'][g['digit']]}": g["box"] for g in m["glyphs"]}
        markers = [o for o in m["objects"] if o.get("small")]
        assert sorted(said) == sorted([*by_words, *(f"small {o['color']}" for o in markers)])
        # Reading order: the glyphs' cells (row, column) in the order the caption names them.
        cells = [(by_words[w][1] // 8, by_words[w][0] // 8) for w in said if w in by_words]
        assert cells == sorted(cells)
        assert set(" ".join(said).split()) <= set(WORDS)
    meta = json.loads((tmp_path / "set" / "meta.json").read_text())
    assert meta["captions"] is True and meta["splits"]["train"]["records"] == 18


def test_the_detail_recipe_refuses_the_shapes_sets_distractors() -> None:
    """Before: `--task detail --distractors 2` ran and ignored the flag. Now one line says why."""
    from vlmod.recipes.settings import RecipeSettings

    with pytest.raises(InputError, match="the fine-detail set draws its own clutter: leave it out of --task detail"):
        RecipeSettings.for_task("detail", distractors=2)
    assert RecipeSettings.for_task("detail").dense_tower is False and RecipeSettings.for_task("image").dense_tower


def test_glyphs_over_2x2_patches_rest_on_4_tokens_and_count_small_is_refused_there(tmp_path: Path) -> None:
    """`scale=2`: each glyph is its bitmap at twice the size in a 16 px cell aligned to 2 x 2 of the
    8 px patches, so a glyph question rests on exactly 4 of the 144 tokens (2.8%); four markers of
    that size would be 11%, so count_small at that scale is refused (one line naming the way out)."""
    from vlmod.data.scenes import COLORS

    with pytest.raises(InputError, match=r"glyph scale 2 .* up to 11.1% .* at least 144 px or leave count_small out"):
        generate_detail(tmp_path / "refused", 6, 3, scale=2)
    assert not (tmp_path / "refused").exists()
    with pytest.raises(InputError, match="cells of 8 x scale px tile the 96 px picture, got 5"):
        check_resolution(96, 8, 5, ("digit",))
    out = tmp_path / "big"
    generate_detail(out, num_train=20, num_val=10, seed=3, scale=2, question_types=("digit", "small_color"))
    assert json.loads((out / "meta.json").read_text())["glyph_scale"] == 2
    for r in _records(out, "train") + _records(out, "val"):
        m = r["meta"]
        assert m["type"] in ("digit", "small_color") and m["cell_size"] == 16 and m["patch_size"] == 8
        assert len(m["answer_patches"]) == 4 and answer_share(m, 96, 8) == 4 / 144
        img = np.asarray(Image.open(out / r["image"]), dtype=np.int16)
        for g in m["glyphs"]:
            x0, y0, x1, y1 = g["box"]
            assert (x1 - x0, y1 - y0) == (10, 14) and x0 // 16 == (x1 - 1) // 16 and y0 // 16 == (y1 - 1) // 16
            drawn = (img[y0:y1, x0:x1] == np.array(COLORS[g["color"]])).all(axis=-1)
            assert np.array_equal(drawn, glyph_mask(g["digit"], 2))


def test_the_recipe_takes_the_glyph_scale_and_types_for_the_detail_task_only(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    from vlmod.cli import main
    from vlmod.recipes.settings import RecipeSettings

    s = RecipeSettings.for_task("detail", glyph_scale=2, types=("digit", "small_color"))
    assert (s.glyph_scale, s.types) == (2, ("digit", "small_color"))
    with pytest.raises(InputError, match="--types takes distinct fine-detail question types out of"):
        RecipeSettings.for_task("detail", types=("digit", "colour"))
    for task in ("image", "video"):
        with pytest.raises(InputError, match=f"give them with --task detail, not --task {task}"):
            RecipeSettings.for_task(task, glyph_scale=2)
        with pytest.raises(InputError, match=f"give them with --task detail, not --task {task}"):
            RecipeSettings.for_task(task, question_first=True)
    # the recipe's set: a page of glyphs over 2 x 2 patches off the pooling windows, the question first, the digit
    # question, 20% faint; the stack on merging
    detail = RecipeSettings.for_task("detail")
    assert (detail.glyph_scale, detail.types, detail.question_first, detail.layout, detail.faint, detail.unaligned,
            detail.dense_steps, detail.stack_merge, detail.stack_pool) == (2, ("digit",), True, "page", 0.2, True, 4000,
                                                                           True, 1)
    # 8x: merging takes 0.6 of the FLOPs reduction, the stacked stage trains it at 0.5
    assert [detail.share_at(t, training) for t in (3.0, 5.0, 8.0) for training in (False, True)] == [0.5, 0.5, 0.5, 0.5,
                                                                                                   0.6, 0.5]
    # without merging the stack pools as on the aligned set: 8x's 0.3, trained where each point runs
    pooled = RecipeSettings.for_task("detail", stack_merge=False)
    assert (pooled.stack_pool, pooled.unaligned) == (2, True)
    assert [pooled.share_at(t, training) for t in (5.0, 8.0) for training in (False, True)] == [0.5, 0.5, 0.3, 0.3]
    assert not RecipeSettings.for_task("detail", glyph_scale=1, types=("digit",)).unaligned  # one patch: no grid to leave
    run = ["recipe", "--task", "detail", "--quick", "--types", "digit,count_small", "--out", str(tmp_path / "run")]
    assert main(run) == 2  # the page draws no markers to count
    err = capsys.readouterr().err
    assert err.startswith("error: the page layout draws no markers, so it asks the glyph types only: give --types "
                          "digit,small_color or --layout scene (got digit,count_small)")
    assert main([*run, "--layout", "scene"]) == 2  # the scene's four markers over 2 x 2 patches cover too much
    err += capsys.readouterr().err
    assert err.splitlines()[1].startswith("error: at image 96 px, patch 8 px, glyph scale 2 the fine-detail answers cover "
                                          "up to 11.1%")
    assert len(err.strip().splitlines()) == 2 and not (tmp_path / "run").exists()


def test_question_first_puts_the_question_before_the_picture(detail_set: Path, tmp_path: Path) -> None:
    """The same pictures and questions; only each prompt's order changes, so every vision token can
    attend to the words naming what to find."""
    generate_detail(tmp_path / "first", num_train=60, num_val=30, seed=3, question_first=True)
    for split in ("train", "val"):
        after, first = _records(detail_set, split), _records(tmp_path / "first", split)
        for a, f in zip(after, first, strict=True):
            question = a["conversations"][0]["value"].removeprefix("<image>\n")
            assert f["conversations"][0]["value"] == f"{question}\n<image>" and question != a["conversations"][0]["value"]
            assert f["conversations"][1:] == a["conversations"][1:] and f["meta"] == a["meta"]
    assert json.loads((tmp_path / "first" / "meta.json").read_text())["question_first"] is True
    for rel in ("images/train/000007.png", "images/val/000003.png"):
        assert (tmp_path / "first" / rel).read_bytes() == (detail_set / rel).read_bytes()


def test_reuse_dense_refuses_a_dense_model_of_another_detail_set() -> None:
    """The glyph scale, the types and the prompt order change the data the dense model learned, so
    `--reuse-dense` must not keep a model trained on another of them (a record without the keys,
    from before them, counts as their defaults: one patch, every type, the question after)."""
    from dataclasses import asdict

    from vlmod.recipes.reuse import DENSE_SETTINGS, changed_settings
    from vlmod.recipes.settings import RecipeSettings

    now = RecipeSettings.for_task("detail")
    assert changed_settings(asdict(now), now, DENSE_SETTINGS) == []
    old = {k: v for k, v in asdict(now).items() if k not in ("glyph_scale", "types", "question_first")}
    assert changed_settings(old, now, DENSE_SETTINGS) == ["glyph_scale", "types", "question_first"]
    assert changed_settings({**asdict(now), "layout": "scene"}, now, DENSE_SETTINGS) == ["layout"]
    assert changed_settings({**asdict(now), "faint": 0.5}, now, DENSE_SETTINGS) == ["faint"]


def test_a_page_fills_the_picture_with_glyphs_each_question_still_naming_one(tmp_path: Path) -> None:
    """The page layout: 10-14 clutter glyphs a validation picture (as many as find room), digits
    repeating, cells touching and on the border, at most 2 large shapes; the question still names
    one glyph, its answer on 4 of the 144 tokens; no markers, so count_small is refused."""
    from vlmod.data.detail import LAYOUTS, check_layout

    with pytest.raises(InputError, match="the page layout draws no markers, so it asks the glyph types only"):
        generate_detail(tmp_path / "refused", 6, 3, scale=2, question_types=("digit", "count_small"), layout="page")
    with pytest.raises(InputError, match="--layout takes one of scene, page, crowded, got 'book'"):
        check_layout("book")
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "page"
    generate_detail(out, num_train=40, num_val=40, seed=3, scale=2, question_types=("digit", "small_color"),
                    question_first=True, layout="page")
    assert json.loads((out / "meta.json").read_text())["layout"] == "page"
    _check_answers(out, scale=2)
    val = _records(out, "val")
    glyphs = [len(r["meta"]["glyphs"]) for r in val]
    assert min(glyphs) >= 1 + LAYOUTS["page"].glyphs[0] - 4 and np.mean(glyphs) > 11  # ~36% of the tokens
    cells = [{(g["box"][1] // 16, g["box"][0] // 16) for g in r["meta"]["glyphs"]} for r in val]
    assert all(len(c) == len(r["meta"]["glyphs"]) for c, r in zip(cells, val, strict=True))  # one glyph a cell
    assert any((0 in {a for a, _ in c}) or (5 in {b for _, b in c}) for c in cells)  # the border is used
    assert any(any((a + 1, b) in c or (a, b + 1) in c for a, b in c) for c in cells)  # cells touch
    assert any(len({g["digit"] for g in r["meta"]["glyphs"]}) < len(r["meta"]["glyphs"]) for r in val)  # digits repeat
    assert all(len(r["meta"]["objects"]) <= 2 and not any(o.get("small") for o in r["meta"]["objects"]) for r in val)
    for r in val:
        assert len(r["meta"]["answer_patches"]) == 4 and answer_share(r["meta"], 96, 8) == 4 / 144
    train = [len(r["meta"]["glyphs"]) for r in _records(out, "train")]
    assert min(train) == 1 and np.mean(train) < np.mean(glyphs)  # the curriculum: from none up


def test_a_crowded_page_covers_more_tokens_with_glyphs_than_a_3x_reduction_keeps(tmp_path: Path) -> None:
    """The crowded layout (unaligned, as the recipe runs it): ~20 glyphs a validation picture, their
    patches over half of the 144 tokens, so a reduction keeping a third must lose glyph tokens;
    the asked glyph still covers 4 patches (2.8%) and one glyph takes a cell."""
    from vlmod.data.detail import LAYOUTS, box_patches

    out = tmp_path / "crowded"
    generate_detail(out, num_train=10, num_val=30, seed=5, scale=2, question_types=("digit",), question_first=True,
                    layout="crowded", unaligned=True)
    _check_answers(out, scale=2)
    val = _records(out, "val")
    glyphs = [len(r["meta"]["glyphs"]) for r in val]
    assert min(glyphs) >= 1 + LAYOUTS["crowded"].glyphs[0] - 4 and np.mean(glyphs) > 18
    covered = [len({p for g in r["meta"]["glyphs"] for p in box_patches(g["box"], 96, 8)}) / 144 for r in val]
    assert np.mean(covered) > 0.5 and min(covered) > 1 / 3
    assert all(len(r["meta"]["answer_patches"]) == 4 for r in val)
    cells = [{(g["box"][1] // 16, g["box"][0] // 16) for g in r["meta"]["glyphs"]} for r in val]
    assert all(len(c) == len(r["meta"]["glyphs"]) for c, r in zip(cells, val, strict=True))


def test_faint_pictures_are_the_same_pictures_with_their_glyphs_and_markers_faint(detail_set: Path,
                                                                                  tmp_path: Path) -> None:
    """`faint`: that share of each split's pictures draws every glyph and marker at a contrast in
    FAINT_CONTRAST, the rest solid; everything else (layout, questions, other pixels) is as without."""
    from vlmod.data.detail import FAINT_CONTRAST

    out = tmp_path / "faint"
    generate_detail(out, num_train=60, num_val=30, seed=3, faint=0.5)
    assert json.loads((out / "meta.json").read_text())["faint"] == 0.5
    faint = 0
    for split in ("train", "val"):
        for solid_rec, rec in zip(_records(detail_set, split), _records(out, split), strict=True):
            assert rec["conversations"] == solid_rec["conversations"]
            solid = np.asarray(Image.open(detail_set / solid_rec["image"]), dtype=np.int16)
            img = np.asarray(Image.open(out / rec["image"]), dtype=np.int16)
            k = rec["meta"].get("contrast", 1.0)
            items = rec["meta"]["glyphs"] + [o for o in rec["meta"]["objects"] if o.get("small")]
            assert all(item.get("contrast", 1.0) == k for item in items)
            if k == 1.0:
                assert rec["meta"] == solid_rec["meta"] and np.array_equal(img, solid)
                continue
            faint += 1
            assert FAINT_CONTRAST[0] <= k <= FAINT_CONTRAST[1]
            inside = np.zeros(img.shape[:2], dtype=bool)
            for item in items:
                x0, y0, x1, y1 = item["box"]
                inside[y0:y1, x0:x1] = True
                assert not np.array_equal(img[y0:y1, x0:x1], solid[y0:y1, x0:x1])  # the glyph drawn fainter
            assert np.array_equal(img[~inside], solid[~inside])
    assert 25 <= faint <= 65  # about half of the 90
    with pytest.raises(ValueError, match="faint is the share of pictures drawn faint, 0 to 1, got 1.5"):
        generate_detail(tmp_path / "refused", 6, 3, faint=1.5)


def test_the_recipe_takes_faint_for_the_picture_tasks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vlmod.cli import main
    from vlmod.recipes.settings import RecipeSettings

    assert RecipeSettings.for_task("detail", faint=0.3).faint == 0.3
    with pytest.raises(InputError, match="--faint is the share of pictures drawn faint, 0 to 1, got 1.5"):
        RecipeSettings.for_task("detail", faint=1.5)
    # The image recipe draws half its colour, count and position pictures faint; its isoFLOP check keeps the solid set.
    assert RecipeSettings.for_task("image").faint == 0.5 and RecipeSettings.for_task("image", isoflop=True).faint == 0.0
    with pytest.raises(InputError, match="the video task's clips draw their own faint fifth: leave it out"):
        RecipeSettings.for_task("video", faint=0.2)
    assert main(["recipe", "--task", "detail", "--quick", "--faint", "2", "--out", str(tmp_path / "run")]) == 2
    assert "expected a number in [0, 1], got 2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_unaligned_cells_straddle_the_pooling_windows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`unaligned`: each picture's cells start 0 or 1 patch in on each axis (drawn per picture), so
    a glyph still covers 2 x 2 patches (4 of 144 tokens) but mostly not one 2 x 2 pooling window;
    off, the set is as before (no offset in any record or in meta.json)."""
    from vlmod.cli import main
    from vlmod.recipes.settings import RecipeSettings

    out = tmp_path / "unaligned"
    generate_detail(out, num_train=20, num_val=40, seed=3, scale=2, question_types=("digit",), layout="page",
                    unaligned=True)
    assert json.loads((out / "meta.json").read_text())["unaligned"] is True
    _check_answers(out, scale=2)
    offsets = []
    for r in _records(out, "val"):
        dy, dx = r["meta"].get("grid_offset", [0, 0])
        offsets.append((dy, dx))
        assert len(r["meta"]["answer_patches"]) == 4 and answer_share(r["meta"], 96, 8) == 4 / 144
        for g in r["meta"]["glyphs"]:  # inside its cell of the shifted grid
            x0, y0, x1, y1 = g["box"]
            assert (x0 - dx) // 16 == (x1 - 1 - dx) // 16 and (y0 - dy) // 16 == (y1 - 1 - dy) // 16
        rows = {p // 12 for p in r["meta"]["answer_patches"]}
        cols = {p % 12 for p in r["meta"]["answer_patches"]}
        assert min(rows) % 2 == dy // 8 and min(cols) % 2 == dx // 8  # off the windows where the grid is off
    assert set(offsets) == {(0, 0), (0, 8), (8, 0), (8, 8)}
    aligned = tmp_path / "aligned"
    generate_detail(aligned, num_train=4, num_val=4, seed=3, scale=2, question_types=("digit",), layout="page")
    assert "unaligned" not in json.loads((aligned / "meta.json").read_text())
    assert not any("grid_offset" in r["meta"] for r in _records(aligned, "val"))
    assert RecipeSettings.for_task("detail", unaligned=True).unaligned
    with pytest.raises(InputError, match="give them with --task detail, not --task image"):
        RecipeSettings.for_task("image", unaligned=True)
    with pytest.raises(InputError, match="a cell of one patch has no grid to leave: give --glyph-scale 2"):
        RecipeSettings.for_task("detail", unaligned=True, glyph_scale=1, types=("digit",))
    assert main(["recipe", "--task", "detail", "--quick", "--unaligned", "--glyph-scale", "1",
                 "--out", str(tmp_path / "run")]) == 2
    assert "a cell of one patch has no grid to leave" in capsys.readouterr().err
