"""Tower pretraining: every patch's target comes from the scene's objects; the stage trains the
tower alone and keeps the rest of the LLaVA as it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmod.data.scenes import COLORS, SHAPES
from vlmod.errors import InputError
from vlmod.training.tower_pretrain import patch_targets, pretrain_tower, scene_images


def test_patch_targets_mark_the_patches_an_object_covers() -> None:
    square = {"shape": "square", "color": "blue", "center": [12.0, 4.0], "radius": 4.0}  # x 8.6-15.4, y 0.6-7.4
    t = patch_targets([square], image_size=16, patch_size=4)
    assert t.shape == (2, 16)
    grid = t[0].reshape(4, 4)
    # Covered patches (>= 20% of their pixels): columns 2-3, rows 0-1; everything else background.
    expected = np.full((4, 4), len(SHAPES))
    expected[0:2, 2:4] = SHAPES.index("square")
    assert (grid == expected).all()
    assert set(t[1][t[0] != len(SHAPES)]) == {list(COLORS).index("blue")}
    # Where two objects share a patch, the one covering more of it names it.
    big = {"shape": "square", "color": "red", "center": [10.0, 4.0], "radius": 4.0}
    both = patch_targets([square, big], image_size=16, patch_size=4)
    assert both[1].reshape(4, 4)[0, 2] == list(COLORS).index("red")  # red covers all of it, blue part
    with pytest.raises(InputError, match="not a multiple of patch size"):
        patch_targets([square], image_size=18, patch_size=4)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from vlmod.data.synthetic import generate
    from vlmod.io.files import save_pretrained_atomic
    from vlmod.models import tiny

    root = tmp_path_factory.mktemp("tower")
    generate(root / "data", 48, 0, image_size=32, distractors=1, seed=0, progress=False)
    save_pretrained_atomic(*tiny.build("llava", width=32, layers=2, vision_width=32, image_size=32, patch_size=8,
                                       vision_feature_layer=-1, seed=0), root / "init")
    return root / "data" / "train.json", root / "init"


def test_scene_images_label_every_distinct_image(scenes: tuple[Path, Path]) -> None:
    data, _ = scenes
    images, targets = scene_images(data, image_size=32, patch_size=8)
    records = json.loads(data.read_text())
    assert len(images) == len({r["image"] for r in records}) and targets.shape == (len(images), 2, 16)
    # Each image shows its objects: as many shapes among its labels as it has kinds of objects.
    first = next(r for r in records if r["image"] == records[0]["image"])
    kinds = {o["shape"] for o in first["meta"]["objects"]}
    assert {SHAPES[i] for i in targets[0, 0] if i < len(SHAPES)} == kinds
    with pytest.raises(InputError, match="the tower reads 64 px"):
        scene_images(data, image_size=64, patch_size=8)


def test_solid_only_leaves_the_faint_pictures_labels_out(tmp_path: Path) -> None:
    """`--tower-solid`: a faint picture's labels name shapes the noise may hide, so the tower can
    learn on the solid pictures alone; the labels of those it keeps are the same."""
    from vlmod.data.synthetic import generate

    generate(tmp_path, 40, 0, image_size=32, distractors=1, seed=0, faint=0.5, progress=False)
    records = json.loads((tmp_path / "train.json").read_text())
    solid = [r for r in records if all(o.get("contrast", 1.0) == 1.0 for o in r["meta"]["objects"])]
    assert 0 < len(solid) < len(records)
    every, every_targets = scene_images(tmp_path / "train.json", image_size=32, patch_size=8)
    kept, kept_targets = scene_images(tmp_path / "train.json", image_size=32, patch_size=8, solid_only=True)
    assert len(every) == len(records) and len(kept) == len(solid)
    rows = [i for i, r in enumerate(records) if r in solid]
    assert (kept_targets == every_targets[rows]).all()


def test_pretraining_trains_the_tower_alone_and_saves_the_whole_model(scenes: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    import vlmod

    data, init = scenes
    log = pretrain_tower(init, data, tmp_path / "tower", steps=60, batch_size=16, lr=3e-3, progress=False)
    before, after = vlmod.load_pretrained(init).state_dict(), vlmod.load_pretrained(tmp_path / "tower" / "model").state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".vision_tower." in k for k in changed)
    assert all(any(k.startswith(p) for k in changed) for p in ("model.vision_tower.encoder.layers.0",
                                                                 "model.vision_tower.embeddings"))
    saved = json.loads((tmp_path / "tower" / "log.json").read_text())
    assert saved["steps"] == 60 and saved["train_images"] + saved["val_images"] == 48 and saved["val_images"] == 6
    assert saved["losses"][-1]["loss"] < 0.5 * saved["losses"][0]["loss"]  # it learns
    assert 0.0 <= log["val_patch_color_accuracy"] <= 1.0 and 0.0 <= log["val_patch_shape_accuracy"] <= 1.0
    again = pretrain_tower(init, data, tmp_path / "again", steps=60, batch_size=16, lr=3e-3, progress=False)
    assert again["losses"] == log["losses"]  # the same seed, the same run


def test_pretraining_refuses_data_that_is_not_synthetic_scenes(scenes: tuple[Path, Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    from vlmod.cli import main

    data, init = scenes
    plain = tmp_path / "plain.json"
    records = json.loads(data.read_text())[:2]
    for r in records:
        r.pop("meta")
        r["image"] = str(data.parent / r["image"])
    plain.write_text(json.dumps(records))
    assert main(["pretrain-tower", "--model", str(init), "--data", str(plain), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    assert "record 0 is not a synthetic scene" in capsys.readouterr().err
    assert not (tmp_path / "o" / "model").exists()
    assert main(["pretrain-tower", "--model", str(init), "--data", str(data), "--out", str(tmp_path / "ok"),
                 "--steps", "2", "--no-progress"]) == 0
    assert "held-out patches' shape" in capsys.readouterr().out and (tmp_path / "ok" / "model" / "config.json").is_file()
