"""Data layer: the synthetic set (determinism, balance, vocabulary, answers checked against the
pixels) and the LLaVA dataset/collator (answer-only labels, left padding, token types through a
converted model, skipped media, video, multi-turn, template fallbacks, one training step)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT
from PIL import Image

import vlmod
from vlmod import TokenType
from vlmod.cli import data as data_cli
from vlmod.data import DataError, LlavaDataset, collate, exact_match, load_records, normalize_answer
from vlmod.data import synthetic as syn
from vlmod.data.answers import IGNORE_INDEX
from vlmod.data.chat import to_messages
from vlmod.data.llava_format import parse_record
from vlmod.data.synthetic_video import FAINT_CONTRAST
from vlmod.data.video import load_video
from vlmod.models import tiny

IMAGE_TOKEN_ID = tiny.tokenizer().convert_tokens_to_ids("<image>")


def _tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    syn.generate(out, 72, 24, seed=0, video=True, num_videos=16, num_val_videos=4)
    return out


@pytest.fixture(scope="module")
def llava():
    return tiny.build("llava")


def _records(data_dir: Path, name: str = "train") -> list[dict]:
    return json.loads((data_dir / f"{name}.json").read_text())


# ----------------------------------------------------------------------------- synthetic set


def test_generate_is_deterministic(tmp_path):
    kwargs = dict(num_train=12, num_val=4, video=True, num_videos=4, num_val_videos=2)
    syn.generate(tmp_path / "a", seed=0, **kwargs)
    syn.generate(tmp_path / "b", seed=0, **kwargs)
    syn.generate(tmp_path / "c", seed=1, **kwargs)
    assert _tree_hash(tmp_path / "a") == _tree_hash(tmp_path / "b")
    assert _tree_hash(tmp_path / "a") != _tree_hash(tmp_path / "c")
    # A smaller rerun into the same folder leaves the same bytes as a fresh run, no stale files.
    syn.generate(tmp_path / "c", seed=0, **kwargs)
    syn.generate(tmp_path / "d", seed=0, **{**kwargs, "num_train": 20})
    syn.generate(tmp_path / "d", seed=0, **kwargs)
    assert _tree_hash(tmp_path / "c") == _tree_hash(tmp_path / "a") == _tree_hash(tmp_path / "d")
    assert not list((tmp_path / "a").rglob(".*"))  # no temp files left behind


def test_files_and_balance(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["seed"] == 0 and meta["image_size"] == 64
    for name, qtypes, n in [
        ("train", syn.IMAGE_QUESTION_TYPES, 72),
        ("val", syn.IMAGE_QUESTION_TYPES, 24),
        ("video_train", syn.VIDEO_QUESTION_TYPES, 16),
        ("video_val", syn.VIDEO_QUESTION_TYPES, 4),
    ]:
        records = load_records(data_dir / f"{name}.json")
        assert len(records) == n and len({r.id for r in records}) == n
        types = Counter(r.raw["meta"]["type"] for r in records)
        assert set(types) == set(qtypes[:n]) and max(types.values()) - min(types.values()) <= 1
        for qtype in qtypes:
            answers = Counter(r.conversations[-1]["value"] for r in records if r.raw["meta"]["type"] == qtype)
            counts = [answers.get(a, 0) for a in syn.ANSWERS[qtype]]
            assert max(counts) - min(counts) <= 1, (name, qtype, answers)
            assert set(answers) <= set(syn.ANSWERS[qtype])
        assert meta["splits"][name]["records"] == n
        for r in records:
            assert (r.images[0] if r.images else r.video_path).is_file()
    train = {r["id"] for r in _records(data_dir)}
    assert not train & {r["id"] for r in _records(data_dir, "val")}


def test_every_word_is_in_the_tiny_vocabulary(data_dir):
    vocab = set(tiny.WORDS)
    tok = tiny.tokenizer()
    texts = []
    for name in ("train", "val", "video_train", "video_val"):
        for r in _records(data_dir, name):
            texts += [t["value"].replace("<image>", "").replace("<video>", "") for t in r["conversations"]]
    # Every template with every colour and shape, and every answer, not only the drawn ones.
    for template in syn.QUESTIONS.values():
        for c in syn.COLORS:
            for s in syn.SHAPES:
                texts.append(template.format(color=c, shape=s, color2=c, shape2=s))
    texts += [a for answers in syn.ANSWERS.values() for a in answers]
    for text in texts:
        assert set(text.split()) <= vocab, text
        assert tok.unk_token_id not in tok(text)["input_ids"], text


def _saturated(img: np.ndarray) -> np.ndarray:
    img = img.astype(np.int32)
    return img.max(-1) - img.min(-1) > 80


def _nearest_color(rgb: np.ndarray) -> str:
    return min(syn.COLORS, key=lambda c: float(np.abs(np.asarray(syn.COLORS[c]) - rgb).sum()))


def _occupied_cells(img: np.ndarray) -> list[int]:
    size = img.shape[0]
    mask = _saturated(img)
    ys, xs = np.nonzero(mask)
    return sorted({syn.cell_of(x + 0.5, y + 0.5, size) for x, y in zip(xs, ys, strict=True)})


def test_answers_match_the_pixels(data_dir):
    """Recompute every answer from the decoded image, not from the generator's bookkeeping."""
    checked = Counter()
    for r in _records(data_dir):
        img = np.asarray(Image.open(data_dir / r["image"]).convert("RGB"))
        assert img.shape == (64, 64, 3)
        meta, answer = r["meta"], r["conversations"][-1]["value"]
        question = r["conversations"][0]["value"]
        cells = _occupied_cells(img)
        assert cells == sorted(o["cell"] for o in meta["objects"])  # shapes stay in their cells
        for o in meta["objects"]:
            x, y = (int(round(v)) for v in o["center"])
            assert _nearest_color(img[y, x]) == o["color"]
        if meta["type"] == "count":
            assert syn.COUNTS[len(cells) - 1] == answer
        else:
            target = meta["objects"][meta["target"]]
            x, y = (int(round(v)) for v in target["center"])
            if meta["type"] == "color":
                assert _nearest_color(img[y, x]) == answer and f"the {target['shape']} ?" in question
                assert [o["shape"] for o in meta["objects"]].count(target["shape"]) == 1
            elif meta["type"] == "position":
                # the target's colour is in the answer's cell, and the target's centre is in it
                near = np.abs(img.astype(int) - np.asarray(syn.COLORS[target["color"]])).sum(-1) < 90
                ys, xs = np.nonzero(near & _saturated(img))
                assert syn.POSITIONS.index(answer) in {syn.cell_of(i + 0.5, j + 0.5, 64) for i, j in zip(xs, ys, strict=True)}
                assert syn.POSITIONS[syn.cell_of(x, y, 64)] == answer
            else:  # shape: of all outlines drawn at that spot, the answer's fits the pixels best
                assert [o["color"] for o in meta["objects"]].count(target["color"]) == 1
                sat = _saturated(img) & _cell_mask(syn.cell_of(x, y, 64))
                ious = {}
                for s in syn.SHAPES:
                    ref = syn.shape_alpha(s, *target["center"], target["radius"], 64) > 0.5
                    ious[s] = (ref & sat).sum() / (ref | sat).sum()
                assert max(ious, key=ious.get) == answer and ious[answer] > 0.8, ious
        checked[meta["type"]] += 1
    assert set(checked) == set(syn.IMAGE_QUESTION_TYPES)


def _cell_mask(cell: int, size: int = 64) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    c = size / syn.GRID
    return ((yy // c).astype(int) * syn.GRID + (xx // c).astype(int)) == cell


def test_video_answers_match_the_frames(data_dir):
    for r in _records(data_dir, "video_train"):
        frames = load_video(data_dir / r["video"], 8).frames
        assert frames.shape == (8, 64, 64, 3)
        meta, answer = r["meta"], r["conversations"][-1]["value"]
        target = meta["objects"][0]

        def centroid(frame, color=target["color"], meta=meta):
            near = np.abs(frame.astype(int) - np.asarray(syn.COLORS[color])).sum(-1) < 90
            for other in meta["objects"][1:] if meta["type"] == "direction" else ():
                (cx, cy), r = other["start"], other["radius"] + 2  # a static distractor may share the colour
                near[max(int(cy - r), 0): int(cy + r) + 1, max(int(cx - r), 0): int(cx + r) + 1] = False
            ys, xs = np.nonzero(near & _saturated(frame))
            return (xs.mean(), ys.mean()) if len(xs) else None

        if meta["type"] == "direction":
            (x0, y0), (x1, y1) = centroid(frames[0]), centroid(frames[-1])
            dx, dy = x1 - x0, y1 - y0
            seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert seen == answer and max(abs(dx), abs(dy)) > 20
        else:  # every other object is drawn exactly in the frames its meta names, its colour exact
            for obj in meta["objects"]:  # (the clips are lossless: a lossy 4:2:0 mp4 misses by tens)
                a, b = obj["frames"]
                (cx, cy) = obj["center"]
                misses = [np.abs(frame[int(cy), int(cx)].astype(int) - np.asarray(syn.COLORS[obj["color"]])).max()
                          for frame in frames]
                if obj["contrast"] < 1.0:  # a faint clip's object: blended in, nearer its colour in its frames only
                    assert FAINT_CONTRAST[0] <= obj["contrast"] <= FAINT_CONTRAST[1]
                    shown = [m for t, m in enumerate(misses) if a <= t <= b]
                    absent = [m for t, m in enumerate(misses) if not a <= t <= b]
                    assert not absent or np.mean(shown) < np.mean(absent), (r["id"], obj, misses)
                    continue
                for t, miss in enumerate(misses):
                    assert (miss <= 2) == (a <= t <= b) and (a <= t <= b or miss > 40), (r["id"], obj, t, miss)


def test_captions_name_every_object_of_the_training_samples_only(tmp_path, data_dir):
    out = tmp_path / "captioned"
    summary = syn.generate(out, 72, 24, seed=0, video=True, num_videos=16, num_val_videos=4, captions=True)
    for name, media in (("train", "image"), ("video_train", "video")):
        plain, captioned = _records(data_dir, name), _records(out, name)
        assert captioned[: len(plain)] == plain  # the questions are untouched
        captions = captioned[len(plain):]
        assert [c["id"] for c in captions] == [f"caption-{r['id']}" for r in plain]
        assert sum(sum(v.values()) for v in summary.answer_counts[name].values()) == len(plain)  # questions only
        for r, c in zip(plain, captions, strict=True):
            meta, answer = r["meta"], r["conversations"][1]["value"]
            assert c[media] == r[media] and c["conversations"][0]["value"] == f"<{media}>\ndescribe the {media} ."
            said = c["conversations"][1]["value"].split(" , ")
            named = {" ".join(x.split()[:2]): x for x in said}
            assert sorted(" ".join(x.split()[:2]) for x in said) == sorted(
                f"{o['color']} {o['shape']}" for o in meta["objects"])
            target = meta["objects"][meta.get("target", 0)]
            if media == "image":  # reading order, each with its cell
                assert said == [f"{o['color']} {o['shape']} {syn.POSITIONS[o['cell']]}"
                                for o in sorted(meta["objects"], key=lambda o: o["cell"])]
            elif meta["type"] in ("direction", "when"):  # how the object moves, or the third it is shown in
                assert named[f"{target['color']} {target['shape']}"].endswith(answer)
            elif meta["type"] in ("first", "last"):  # order of appearance
                assert said[0 if meta["type"] == "first" else -1].split()[1] == answer
    for name in ("val", "video_val"):
        assert _records(out, name) == _records(data_dir, name)
    assert json.loads((out / "meta.json").read_text())["captions"] is True


def test_generate_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="image_size"):
        syn.generate(tmp_path, 1, 1, image_size=8)
    with pytest.raises(ValueError, match="question types"):
        syn.generate(tmp_path, 1, 1, question_types=("colour",))
    with pytest.raises(ValueError, match="num_train"):
        syn.generate(tmp_path, -1, 1)
    with pytest.raises(ValueError, match="distractors"):
        syn.generate(tmp_path, 1, 1, distractors=5)


def test_faint_pictures_are_the_solid_ones_at_a_low_contrast(tmp_path):
    """`faint` draws that share of the colour, count and position pictures at a contrast in the video
    set's faint range, from a stream of its own: every other picture keeps the solid set's bytes, a
    faint one its scene; a shape question's picture is always solid."""
    syn.generate(tmp_path / "solid", 40, 8, distractors=2)
    syn.generate(tmp_path / "faint", 40, 8, distractors=2, faint=0.5)
    faint_count = 0
    for split in ("train", "val"):
        for solid, faint in zip(_records(tmp_path / "solid", split), _records(tmp_path / "faint", split), strict=True):
            assert solid["conversations"] == faint["conversations"]
            contrasts = {o.get("contrast", 1.0) for o in faint["meta"]["objects"]}
            assert len(contrasts) == 1  # one contrast a picture
            k = contrasts.pop()
            assert [{**o, "contrast": k} for o in solid["meta"]["objects"]] == [{**o, "contrast": k} for o in faint["meta"]["objects"]]
            a, b = (np.asarray(Image.open(tmp_path / d / r["image"]).convert("RGB"), dtype=float)
                    for d, r in (("solid", solid), ("faint", faint)))
            if k == 1.0:
                assert (a == b).all()
                continue
            assert faint["meta"]["type"] in ("color", "count", "position")  # a shape question: solid
            faint_count += 1
            assert FAINT_CONTRAST[0] <= k <= FAINT_CONTRAST[1]
            for o in faint["meta"]["objects"]:  # the shape's centre lies nearer the background than its colour
                x, y = (int(round(v)) for v in o["center"])
                color = np.asarray(syn.COLORS[o["color"]], dtype=float)
                assert np.abs(b[y, x] - color).sum() > np.abs(a[y, x] - color).sum() + 60
    assert 8 <= faint_count <= 28, faint_count  # half of the 36 colour, count and position pictures
    assert json.loads((tmp_path / "faint" / "meta.json").read_text())["faint"] == 0.5
    assert json.loads((tmp_path / "faint" / "meta.json").read_text())["faint_types"] == ["color", "count", "position"]
    assert "faint" not in json.loads((tmp_path / "solid" / "meta.json").read_text())
    with pytest.raises(ValueError, match="faint is the share of pictures drawn faint, 0 to 1, got 1.5"):
        syn.generate(tmp_path / "refused", 1, 1, faint=1.5)


def test_single_shape_scenes(tmp_path):
    syn.generate(tmp_path, 24, 0, distractors=0)
    for r in _records(tmp_path):
        n = len(r["meta"]["objects"])
        assert n == 1 if r["meta"]["type"] != "count" else 1 <= n <= 4
    assert json.loads((tmp_path / "meta.json").read_text())["distractors"] == 0


def test_script_writes_and_reports(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_synthetic_data", ROOT / "scripts" / "make_synthetic_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "syn"
    rc = module.main(["--out", str(out), "--train", "8", "--val", "4", "--image-size", "48", "--types",
                      "color,count", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0 and "train.json: 8 records" in printed and "val.json: 4 records" in printed
    records = _records(out)
    assert {r["meta"]["type"] for r in records} == {"color", "count"}
    assert Image.open(out / records[0]["image"]).size == (48, 48)
    assert module.main(["--out", str(out), "--no-progress"]) == 2  # the set it wrote is not written over unasked
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert module.main(["--out", str(out), "--overwrite", "--image-size", "10", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("error: image_size")


# ----------------------------------------------------------------------------- dataset + collator


def _check_labels(batch: dict, tokenizer, answers: list[str]) -> None:
    """labels == input_ids exactly on the answer tokens (+ the end-of-turn token), -100 elsewhere;
    left padding."""
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    for row, answer in enumerate(answers):
        keep = labels[row] != IGNORE_INDEX
        assert torch.equal(labels[row][keep], ids[row][keep])
        assert tokenizer.decode(ids[row][keep]) == f"{answer} </s>"
        expected = tokenizer(f"{answer} </s>", add_special_tokens=False)["input_ids"]
        assert ids[row][keep].tolist() == expected
        # the answer is the end of the sequence (left padding), contiguous
        positions = keep.nonzero().flatten()
        assert positions.tolist() == list(range(ids.shape[1] - len(expected), ids.shape[1]))
        pad = mask[row] == 0
        n_pad = int(pad.sum())
        assert pad[:n_pad].all() and not pad[n_pad:].any()
        assert (ids[row][:n_pad] == tokenizer.pad_token_id).all()
        assert (labels[row][pad] == IGNORE_INDEX).all()


def test_collator_masks_and_token_types(data_dir, llava):
    model, processor = llava
    ds = LlavaDataset(data_dir / "train.json", processor)
    assert len(ds) == 72 and ds.skipped == []
    items = [ds[i] for i in range(4)]
    batch = ds.collate(items)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "pixel_values"}
    assert batch["pixel_values"].shape == (4, 3, 32, 32)
    lengths = {len(i["input_ids"]) for i in items}
    assert len(lengths) > 1  # different question lengths: padding is exercised
    _check_labels(batch, processor.tokenizer, [r.conversations[-1]["value"] for r in ds.records[:4]])

    converted = vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, routable=("image",)))
    try:
        with torch.no_grad(), vlmod.trace_routing(converted) as trace:
            out = converted(**batch)
        assert torch.isfinite(out.loss)
        types = trace.token_types
        answer = batch["labels"] != IGNORE_INDEX
        real = batch["attention_mask"] == 1
        image = batch["input_ids"] == IMAGE_TOKEN_ID
        assert torch.equal(types == TokenType.RESPONSE, answer)
        assert torch.equal(types == TokenType.INSTRUCTION, real & ~answer & ~image)
        assert torch.equal(types == TokenType.IMAGE, image)
        assert torch.equal(types == TokenType.PADDING, ~real)
    finally:
        vlmod.remove_mod(converted)


def test_right_padding_and_collate_errors(data_dir, llava):
    _, processor = llava
    ds = LlavaDataset(data_dir / "train.json", processor)
    items = [ds[0], ds[1]]
    right = collate(items, pad_token_id=0, padding_side="right")
    n = min(len(i["input_ids"]) for i in items)
    short = int(np.argmin([len(i["input_ids"]) for i in items]))
    assert (right["attention_mask"][short, :n] == 1).all() and (right["attention_mask"][short, n:] == 0).all()
    assert (right["labels"][short, n:] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="empty"):
        collate([])
    with pytest.raises(ValueError, match="labels"):
        collate([items[0], {k: v for k, v in items[1].items() if k != "labels"}])
    bad = dict(items[1], pixel_values_videos=torch.zeros(1, 4, 3, 32, 32))
    with pytest.raises(ValueError, match="pixel_values_videos"):
        collate([dict(items[0], pixel_values_videos=torch.zeros(1, 8, 3, 32, 32)), bad])


def test_missing_and_corrupt_images_are_skipped(data_dir, llava, tmp_path):
    _, processor = llava
    raw = _records(data_dir)[:6]
    root = tmp_path / "root"
    shutil.copytree(data_dir / "images", root / "images")
    (root / raw[1]["image"]).unlink()  # missing
    (root / raw[3]["image"]).write_bytes(b"\x89PNG\r\n\x1a\n not really a png")  # corrupt
    with pytest.warns(UserWarning, match="skipped 2 of 6"):
        ds = LlavaDataset(raw, processor, image_root=root)
    assert len(ds) == 4 and [s.id for s in ds.skipped] == [raw[1]["id"], raw[3]["id"]]
    assert all(s.reason for s in ds.skipped) and ds.skipped[0].path.endswith(raw[1]["image"])
    assert [r.id for r in ds.records] == [raw[i]["id"] for i in (0, 2, 4, 5)]
    with pytest.raises(DataError, match=raw[1]["id"]):
        LlavaDataset(raw, processor, image_root=root, strict=True)

    # Without upfront verification: missing files still go at construction; a file that breaks
    # later is counted when it is read and the next record stands in.
    with pytest.warns(UserWarning, match="skipped 1 of 6"):
        lazy = LlavaDataset(raw, processor, image_root=root, verify=False)
    assert len(lazy) == 5
    with pytest.warns(UserWarning, match="next record"):
        item = lazy[2]  # the corrupt one
    assert len(lazy.skipped) == 2 and lazy.skipped[-1].id == raw[3]["id"]
    assert torch.equal(item["input_ids"], lazy[3]["input_ids"])
    with pytest.raises(IndexError):
        lazy[len(lazy)]
    assert len(list(iter(ds))) == len(ds)  # iteration stops at the end
    for r in raw:
        (root / r["image"]).unlink(missing_ok=True)
    with pytest.raises(DataError, match="no usable records"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlavaDataset(raw, processor, image_root=root)


def test_num_frames_is_refused_as_a_setting_and_a_short_clip_is_not_corrupt(data_dir):
    """Before: `num_frames: 0` skipped every video record as unreadable ("num_frames must be >= 1"
    once a record), and `num_frames: 100000` called the healthy 8-frame clips corrupt (the clip's
    pixel budget was shared among 100000 frames, each a few pixels wide, and decord failed). Now 0
    is refused once, as the setting; a clip shorter than asked gives every frame it has; padding
    it to 100000 frames is refused as the setting (over a clip's budget), never as a corrupt clip."""
    from vlmod.data.dataset import FrameCountError

    _, processor = tiny.build("llava_next_video")
    videos = data_dir / "video_train.json"
    with pytest.raises(DataError) as caught:
        LlavaDataset(videos, processor, num_frames=0)
    assert str(caught.value) == "num_frames must be a whole number >= 1 (frames sampled from each clip), got 0"
    clip = load_records(videos)[0].video_path
    frames = load_video(clip, num_frames=100_000).frames
    assert frames.shape == load_video(clip, num_frames=8).frames.shape == (8, 64, 64, 3)
    with pytest.raises(FrameCountError) as caught:
        LlavaDataset(videos, processor, num_frames=100_000)
    assert str(caught.value) == (f"num_frames 100,000 is more than {clip} has (8): repeated to 100,000, its 32x32 "
                                 "frames are over the 32,000,000-pixel budget of a clip; set num_frames to at most "
                                 "31,250")
    padded = LlavaDataset(videos, processor, num_frames=12)  # within the budget: each frame repeated, in order
    assert not padded.skipped and padded[0]["pixel_values_videos"].shape[1] == 12


def test_video_records_give_pixel_values_videos(data_dir):
    model, processor = tiny.build("llava_next_video")
    ds = LlavaDataset(data_dir / "video_train.json", processor, num_frames=8)
    batch = ds.collate([ds[0], ds[1], ds[2]])
    assert batch["pixel_values_videos"].shape == (3, 8, 3, 32, 32)
    assert "pixel_values" not in batch
    _check_labels(batch, processor.tokenizer, [r.conversations[-1]["value"] for r in ds.records[:3]])
    video_id = processor.tokenizer.convert_tokens_to_ids("<video>")
    assert ((batch["input_ids"] == video_id).sum(1) > 0).all()
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_anyres_images_of_different_sizes_batch(tmp_path, family):
    model, processor = tiny.build(family)
    rng = np.random.default_rng(0)
    raw = []
    for i, (h, w) in enumerate([(64, 64), (64, 128), (96, 48)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        raw.append({"id": str(i), "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nwhat color is the circle ?"}, {"from": "gpt", "value": "red"}]})
    ds = LlavaDataset(raw, processor, image_root=tmp_path)
    items = [ds[i] for i in range(3)]
    assert len({i["pixel_values"].shape[1] for i in items}) > 1  # different patch counts
    batch = ds.collate(items)
    assert batch["image_sizes"].tolist() == [[64, 64], [64, 128], [96, 48]]
    _check_labels(batch, processor.tokenizer, ["red"] * 3)
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


def test_multi_turn_labels_every_answer(data_dir, llava):
    _, processor = llava
    record = {"id": "mt", "image": str(data_dir / _records(data_dir)[0]["image"]), "conversations": [
        {"from": "system", "value": "answer with one word ."},
        {"from": "human", "value": "<image>\nwhat color is the star ?"},
        {"from": "gpt", "value": "red"},
        {"from": "human", "value": "how many objects are there ?"},
        {"from": "gpt", "value": "three"},
        {"from": "human", "value": "where is it ?"},  # trailing question: nothing to learn
    ]}
    ds = LlavaDataset([record], processor)
    item = ds[0]
    keep = item["labels"] != IGNORE_INDEX
    tok = processor.tokenizer
    assert tok.decode(item["labels"][keep]) == "red </s> three </s>"
    assert "where is it" not in tok.decode(item["input_ids"])
    assert tok.decode(item["input_ids"]).startswith("system : answer with one word . user : <image>")

    prompt = ds.prompt_inputs(0)
    assert prompt.answer == "three" and prompt.id == "mt" and "labels" not in prompt.inputs
    text = tok.decode(prompt.inputs["input_ids"])
    assert text.endswith("user : how many objects are there ? assistant :") and "red </s>" in text


GLUED_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}{% if message['role'] != 'assistant' %} : {% endif %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% if message['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def test_template_fallback_by_offsets_and_clear_error(data_dir, llava):
    _, processor = llava
    raw = _records(data_dir)[:2]
    saved = processor.chat_template
    try:
        # The generation prompt is not what the template renders before an answer.
        processor.chat_template = saved.replace(
            "{% if add_generation_prompt %}assistant : {% endif %}",
            "{% if add_generation_prompt %}assistant answer : {% endif %}",
        )
        ds = LlavaDataset(raw, processor, image_root=data_dir)
        batch = ds.collate([ds[0], ds[1]])
        _check_labels(batch, processor.tokenizer, [r["conversations"][-1]["value"] for r in raw])
        # The answer glued to the prompt: the prompt's last token merges with the answer's first
        # (what BPE does across a boundary), so the labels come from character offsets.
        processor.chat_template = GLUED_TEMPLATE
        ds = LlavaDataset(raw, processor, image_root=data_dir)
        item = ds[0]
        tok = processor.tokenizer
        keep = item["labels"] != IGNORE_INDEX
        # "assistantred" is one (unknown) word: it and the end-of-turn token are the labels
        assert item["labels"][keep].tolist() == [tok.unk_token_id, tok.eos_token_id]
        assert ds._encode_text(ds.records[0]).text.endswith(f"assistant{raw[0]['conversations'][-1]['value']} </s> ")
        # A template that drops the assistant's words cannot be labelled.
        processor.chat_template = saved.replace("{{ c['text'] }} {% endif %}", "{% endif %}")
        ds = LlavaDataset(raw, processor, image_root=data_dir)
        with pytest.raises(DataError, match="cannot find the answer"):
            ds[0]
    finally:
        processor.chat_template = saved


def test_malformed_records_are_errors(data_dir, llava):
    _, processor = llava
    image = str(data_dir / _records(data_dir)[0]["image"])
    two_placeholders = {"image": image, "conversations": [
        {"from": "human", "value": "<image> <image> what ?"}, {"from": "gpt", "value": "red"}]}
    with pytest.raises(DataError, match="2 <image> and 0 <video> placeholder"):
        LlavaDataset([two_placeholders], processor)
    no_answer = {"image": image, "conversations": [{"from": "human", "value": "<image>\nwhat ?"}]}
    with pytest.raises(DataError, match="no answer"):
        LlavaDataset([no_answer], processor)
    no_placeholder = parse_record({"image": image, "conversations": [
        {"from": "human", "value": "what color is the star ?"}, {"from": "gpt", "value": "red"}]}, 0, ".")
    assert to_messages(no_placeholder)[0]["content"][0] == {"type": "image"}
    video = parse_record({"video": "v.mp4", "conversations": [
        {"from": "human", "value": "<image>\nwhich direction ?"}, {"from": "gpt", "value": "up"}]}, 0, "/data")
    assert video.video_path == Path("/data/v.mp4") and video.video == "v.mp4"
    assert to_messages(video)[0]["content"][0] == {"type": "video"}


def test_prompt_inputs_batch_and_generate(data_dir, llava):
    model, processor = llava
    ds = LlavaDataset(data_dir / "val.json", processor)
    prompts = [ds.prompt_inputs(i) for i in range(3)]
    assert [p.answer for p in prompts] == [r.conversations[-1]["value"] for r in ds.records[:3]]
    batch = ds.collate([p.inputs for p in prompts])
    assert "labels" not in batch and (batch["attention_mask"][:, -1] == 1).all()
    tok = processor.tokenizer
    for row in batch["input_ids"]:
        assert tok.decode(row, skip_special_tokens=False).endswith("? assistant :")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape == (3, batch["input_ids"].shape[1] + 2)
    with pytest.raises(DataError, match="cannot load"):
        ds.prompt_inputs({"id": "x", "image": str(data_dir / "nope.png"), "conversations": [
            {"from": "human", "value": "<image>\nwhat ?"}, {"from": "gpt", "value": "red"}]})


def test_a_cached_set_decodes_each_video_once_and_eval_inputs_match_encode_and_prompt(data_dir, monkeypatch):
    """With `cache`, the check when the set is read decodes each clip once, and the training items
    and evaluation prompts of every record showing it read that decoding (a recipe trains five
    stages and evaluates ~60 models and points on its sets); without it an evaluation's item and
    prompt still share one decoding."""
    from vlmod.data import video

    processor = tiny.build("llava_next_video")[1]
    loads = []
    real = video.load_video
    monkeypatch.setattr(video, "load_video", lambda *a, **k: loads.append(str(a[0])) or real(*a, **k))
    records = _records(data_dir, "video_train")[:6]
    records += [dict(r, id=f"{r['id']}-again") for r in records[:3]]  # a clip asked about twice
    ds = LlavaDataset(records, processor, image_root=data_dir, num_frames=8, cache=True)
    assert sorted(loads) == sorted({str(r.video_path) for r in ds.records})  # each clip once
    loads.clear()
    items = [ds[i] for i in range(len(ds))]
    pairs = [ds.eval_inputs(r) for r in ds.records]
    assert loads == [] and ds.eval_inputs(ds.records[0])[0] is pairs[0][0]
    for record, item, (eval_item, prompt) in zip(ds.records, items, pairs, strict=True):
        expected_prompt = ds.prompt_inputs(record)
        for key, value in item.items():
            assert torch.equal(eval_item[key], value), key
        for key, value in expected_prompt.inputs.items():
            assert torch.equal(prompt.inputs[key], value), key
        assert prompt.answer == expected_prompt.answer
        assert prompt.inputs["pixel_values_videos"] is eval_item["pixel_values_videos"]  # one copy of the pixels
    uncached = LlavaDataset(records, processor, image_root=data_dir, num_frames=8)
    loads.clear()
    uncached.eval_inputs(uncached.records[0])
    uncached.eval_inputs(uncached.records[0])
    assert len(loads) == 2


def test_normalize_answer():
    assert normalize_answer("  The Circle. ") == "circle"
    assert normalize_answer("a red, square!") == "red square"
    assert normalize_answer("Top-left") == "top left"
    assert normalize_answer("an") == ""
    assert exact_match("Bottom  Right.", "bottom right") and not exact_match("right", "bottom right")


def test_one_step_lowers_the_loss(data_dir):
    model, processor = tiny.build("llava")
    ds = LlavaDataset(data_dir / "train.json", processor, cache=True)
    batch = ds.collate([ds[i] for i in range(8)])
    assert ds[3] is ds[3]  # cached items
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = model(**batch).loss
    assert after < loss.detach()


def test_make_data_refuses_a_file_as_its_folder(tmp_path, capsys):
    import argparse

    target = tmp_path / "a-file"
    target.write_text("keep me")
    parser = data_cli.add_make_data_arguments(argparse.ArgumentParser())
    assert data_cli.run_make_data(parser.parse_args(["--out", str(target), "--train", "1", "--val", "1"])) == 2
    assert "is a file" in capsys.readouterr().err and target.read_text() == "keep me"
