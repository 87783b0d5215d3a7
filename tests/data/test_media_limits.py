"""What a picture or a clip may cost before it reaches a model, wherever it is loaded (evaluation,
fine-tuning, ranking, the demo): upright by its EXIF orientation, a pixel limit read from the
header, a FIFO refused without being opened, frames scaled by the decoder within a frames x pixels
budget, a question longer than the model's positions refused, a JSON nested too deep for the
reader refused, each in one line."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmod.data import DataError, LlavaDataset, load_image, read_json_records
from vlmod.data.llava_format import MAX_PIXELS
from vlmod.data.video import MAX_CLIP_PIXELS, decode_size, load_video, write_video
from vlmod.models import tiny

ORIENTATION = 0x0112


def _rotated_jpeg(path: Path) -> Path:
    """A 40x20 landscape JPEG, left half blue, tagged "rotate 90 clockwise to view" (EXIF 6), as a
    phone stores a portrait photo: viewed upright it is 20x40 with blue on top."""
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    img.save(path, exif=exif, quality=95)
    return path


def _records(tmp_path: Path, media: dict[str, str], question: str = "what is it ?") -> Path:
    records = [{"id": name, key: value, "conversations": [
        {"from": "human", "value": f"<{key}>\n{question}"}, {"from": "gpt", "value": "a cat"}]}
        for name, (key, value) in media.items()]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    return path


# ----------------------------------------------------------------------------- transparency


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_reach_the_model_on_white(tmp_path, mode):
    """Before: `convert("RGB")` dropped alpha, and transparent pixels (stored black) reached the
    model, and the demo's stage, as black: dark text on a transparent sheet became unreadable."""
    from vlmod.demo.media import decode_media

    img = Image.new("RGBA", (20, 20), (0, 0, 0, 0))
    img.paste((0, 0, 0, 255), (5, 5, 15, 15))  # an opaque black square on a transparent sheet
    path = tmp_path / f"sheet-{mode}.png"
    (img.convert(mode) if mode != "P" else img.convert("P", palette=Image.Palette.ADAPTIVE)).save(
        path, **({"transparency": 0} if mode == "P" else {})
    )
    for picture in (load_image(path), decode_media(path).frames[0]):
        pixels = np.asarray(picture)
        assert pixels.shape[-1] == 3
        assert pixels[1, 1].min() == 255 and pixels[10, 10].max() == 0  # white sheet, the black square kept


# ----------------------------------------------------------------------------- EXIF orientation


def test_a_rotated_photo_loads_upright(tmp_path):
    """Before: the landscape pixels reached the model sideways (40x20, blue on the left)."""
    picture = load_image(_rotated_jpeg(tmp_path / "rotated.jpg"))
    assert picture.size == (20, 40)
    top, bottom = np.asarray(picture)[5, 10], np.asarray(picture)[35, 10]
    assert top[2] > 200 and top[0] < 60 and bottom[0] > 200 and bottom[2] < 60  # blue on top, red below


def test_the_demo_decodes_a_rotated_photo_upright(tmp_path):
    from vlmod.demo.media import decode_media

    media = decode_media(_rotated_jpeg(tmp_path / "rotated.jpg"))
    assert media.kind == "image" and media.size == (20, 40)
    assert np.asarray(media.frames[0])[5, 10][2] > 200


def test_the_dataset_feeds_the_model_the_upright_photo(tmp_path):
    _rotated_jpeg(tmp_path / "rotated.jpg")
    _, processor = tiny.build("llava", image_size=32, patch_size=8)
    seen = []
    real = processor.image_processor.__class__.__call__

    def spy(self, images, *args, **kwargs):
        seen.extend(images if isinstance(images, list) else [images])
        return real(self, images, *args, **kwargs)

    processor.image_processor.__class__.__call__ = spy
    try:
        ds = LlavaDataset(_records(tmp_path, {"r": ("image", "rotated.jpg")}), processor)
        ds[0]
    finally:
        processor.image_processor.__class__.__call__ = real
    assert seen and all(getattr(i, "size", None) == (20, 40) for i in seen if hasattr(i, "size"))


# ----------------------------------------------------------------------------- pixel limit


def _huge_png(path: Path) -> Path:
    """A PNG of a few KB whose header claims just over MAX_PIXELS (1-bit, so writing it is cheap)."""
    side = int(MAX_PIXELS ** 0.5) + 100
    Image.new("1", (side, side)).save(path)
    return path


def test_a_picture_over_the_pixel_limit_is_refused_before_decoding(tmp_path, monkeypatch):
    """Before: eval, finetune and rank decoded any size (a 500 KB 165-megapixel PNG took eval to 3 GB)."""
    huge = _huge_png(tmp_path / "huge.png")
    assert huge.stat().st_size < 1_000_000

    def no_decoding(self, *args, **kwargs):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(Image.Image, "convert", no_decoding)
    with pytest.raises(DataError, match=r"huge.png is \d+x\d+ pixels \(\d+ MP\); at most 40 MP"):
        load_image(huge)


def test_the_dataset_skips_or_refuses_a_picture_over_the_limit(tmp_path):
    _huge_png(tmp_path / "huge.png")
    Image.new("RGB", (32, 32)).save(tmp_path / "small.png")
    _, processor = tiny.build("llava", image_size=32, patch_size=8)
    data = _records(tmp_path, {"huge": ("image", "huge.png"), "small": ("image", "small.png")})
    with pytest.warns(UserWarning, match="skipped 1 of 2"):
        ds = LlavaDataset(data, processor)
    assert [r.id for r in ds.records] == ["small"] and "at most 40 MP" in ds.skipped[0].reason
    with pytest.raises(DataError, match="record 'huge'.*at most 40 MP"):
        LlavaDataset(data, processor, strict=True)


# ----------------------------------------------------------------------------- FIFO


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("verify", [True, False])
def test_a_fifo_as_an_image_or_video_is_refused_without_opening_it(tmp_path, verify):
    """Before: checking the dataset opened the FIFO for reading and waited for a writer forever."""
    os.mkfifo(tmp_path / "pipe.png")
    os.mkfifo(tmp_path / "pipe.mp4")
    _, processor = tiny.build("llava_next_video", image_size=32, patch_size=8)
    data = _records(tmp_path, {"img": ("image", "pipe.png"), "vid": ("video", "pipe.mp4")})
    outcome: dict[str, object] = {}

    def build() -> None:
        try:
            LlavaDataset(data, processor, strict=True, verify=verify)
        except DataError as e:
            outcome["error"] = str(e)

    worker = threading.Thread(target=build, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the dataset check is waiting on the FIFO"
    assert "pipe.png is a FIFO" in str(outcome.get("error")), outcome
    with pytest.raises(DataError, match="pipe.mp4 is a FIFO"):
        load_video(tmp_path / "pipe.mp4")


# ----------------------------------------------------------------------------- video size


def test_decode_size_keeps_the_aspect_and_the_budget():
    assert decode_size(6000, 6000, 12, short_side=336) == (336, 336)
    assert decode_size(1280, 720, 8, short_side=336) == (596, 336)
    assert decode_size(320, 240, 8, short_side=336) == (320, 240)  # never up
    w, h = decode_size(6000, 6000, 12)  # no processor size: the budget alone
    assert 12 * w * h <= MAX_CLIP_PIXELS and w == h


def test_frames_are_decoded_at_the_size_the_processor_needs(tmp_path):
    """Before: every frame was decoded at full size (12 frames of 6000x6000: 1.3 GB) and resized after."""
    clip = write_video(tmp_path / "big.mp4", np.random.default_rng(0).integers(0, 256, (12, 600, 800, 3), np.uint8))
    video = load_video(clip, 8, short_side=60)
    assert video.frames.shape == (8, 60, 80, 3)
    budget = load_video(clip, 8, max_pixels=8 * 100 * 100)
    assert 8 * budget.frames.shape[1] * budget.frames.shape[2] <= 8 * 100 * 100
    _, processor = tiny.build("llava_next_video", image_size=32, patch_size=8)
    from vlmod.data.video import processor_short_side

    assert processor_short_side(processor) == 32


def test_the_demo_decodes_a_large_clip_small(tmp_path):
    from vlmod.demo.media import SHOWN_SHORT_SIDE, decode_media

    clip = write_video(tmp_path / "big.mp4", np.random.default_rng(0).integers(0, 256, (12, 1200, 1600, 3), np.uint8))
    media = decode_media(clip, num_frames=8, resized_pixels=lambda w, h: 336 * 336)
    assert media.kind == "video" and len(media.frames) == 8
    assert min(media.size) == SHOWN_SHORT_SIDE and media.size[0] * 3 == media.size[1] * 4
    assert media.source_size == (1600, 1200)  # the page says "your 1600x1200 frame, decoded at ..."


# ----------------------------------------------------------------------------- text


def test_a_question_longer_than_the_models_positions_is_refused_in_one_line(tmp_path):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    _, processor = tiny.build("llava", image_size=32, patch_size=8)
    data = _records(tmp_path, {"long": ("image", "a.png")}, question="what " * 300)
    with pytest.raises(DataError, match=r"record 'long' is \d+ text tokens, more than the model's 200 positions"):
        LlavaDataset(data, processor, max_tokens=200)
    assert len(LlavaDataset(data, processor, max_tokens=2048)) == 1


def test_a_json_nested_too_deep_is_one_error(tmp_path):
    """Before: RecursionError and its traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="nests its JSON lists or objects too deeply"):
        read_json_records(deep)
