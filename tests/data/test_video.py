"""Video: frame loading and sampling, video prompts through tiny video LLaVA models, the video benchmark."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
from helpers.inputs import chat_prompt

import vlmod
from vlmod import TokenType
from vlmod.cli import main
from vlmod.data.video import VideoError, load_video, sample_indices, write_video
from vlmod.models import tiny

FPS = 10
FRAMES = 20
LEVEL = 12  # frame k is a flat grey of k * LEVEL: which frame was decoded survives the compression


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory):
    """20 frames at 10 fps (timestamps k / 10), each frame a different grey level."""
    frames = np.broadcast_to(
        (np.arange(FRAMES) * LEVEL).astype(np.uint8)[:, None, None, None], (FRAMES, 48, 64, 3)
    )
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames, fps=FPS)


@pytest.fixture(params=["decord", "pyav"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both decoders: decord, and the PyAV fallback used where decord has no wheel."""
    if request.param == "pyav":
        monkeypatch.setitem(sys.modules, "decord", None)  # `import decord` raises ImportError
    return request.param


def _frame_index(frames: np.ndarray) -> np.ndarray:
    return np.round(frames.reshape(len(frames), -1).mean(1) / LEVEL).astype(int)


def _check(video, expected: list[int]) -> None:
    assert video.frames.dtype == np.uint8 and video.frames.shape == (len(expected), 48, 64, 3)
    assert _frame_index(video.frames).tolist() == expected
    np.testing.assert_allclose(video.timestamps, np.array(expected) / FPS, atol=1e-3)
    assert video.total_frames == FRAMES and video.fps == pytest.approx(FPS)


# ----------------------------------------------------------------------------- loading


def test_uniform_sampling_takes_segment_centres(clip, backend):
    _check(load_video(clip, num_frames=4), [2, 7, 12, 17])
    _check(load_video(clip, num_frames=1), [10])


def test_fps_sampling(clip, backend):
    _check(load_video(clip, num_frames=8, fps=2), [0, 5, 10, 15])  # every 0.5 s
    _check(load_video(clip, num_frames=3, sample="fps", fps=5), [2, 10, 16])  # 10 candidates thinned to 3


def test_fewer_frames_than_asked_returns_each_frame_once(clip, backend):
    _check(load_video(clip, num_frames=30), list(range(FRAMES)))
    _check(load_video(clip, num_frames=8, fps=50), [1, 3, 6, 8, 11, 13, 16, 18])  # above the video's fps


def test_missing_file(tmp_path, backend):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_video(tmp_path / "nope.mp4")


@pytest.mark.parametrize("content", [os.urandom(4096), b""], ids=["corrupt", "empty"])
def test_unreadable_file(tmp_path, backend, content: bytes, capfd: pytest.CaptureFixture[str]):
    path = tmp_path / "bad.mp4"
    path.write_bytes(content)
    with pytest.raises(VideoError, match="not a readable video"):
        load_video(path)
    assert capfd.readouterr().err == ""  # decord's and ffmpeg's native log lines are kept out


def test_a_header_that_claims_billions_of_frames_is_refused_in_one_line(tmp_path):
    """A 5 KB mp4 whose `stts` box claims 2,000,000,000 frames used to abort the whole process
    inside decord (std::bad_alloc, exit 134, nothing printed). Read in a child process, so a
    regression fails this test instead of killing the suite."""
    import struct
    import subprocess
    import sys

    path = write_video(tmp_path / "clip.mp4", (np.random.default_rng(0).random((4, 32, 32, 3)) * 255).astype("uint8"))
    data = bytearray(path.read_bytes())
    box = data.index(b"stts")
    data[box + 12:box + 16] = struct.pack(">I", 2_000_000_000)  # the first entry's sample count
    forged = tmp_path / "forged.mp4"
    forged.write_bytes(bytes(data))
    code = "import sys; from vlmod.data.video import load_video; load_video(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(forged)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "VideoError" in done.stderr and "claims 2,000,000,000 frames" in done.stderr


def test_no_video_stream(tmp_path, backend):
    import av

    path = tmp_path / "audio.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        for i in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with pytest.raises(VideoError):
        load_video(path)


def test_write_video_rejects_no_frames(tmp_path):
    with pytest.raises(ValueError, match="T >= 1"):
        write_video(tmp_path / "x.mp4", np.zeros((0, 8, 8, 3), np.uint8))
    assert list(tmp_path.iterdir()) == []


def test_lossless_write_keeps_small_coloured_shapes(tmp_path, backend):
    """A synthetic clip (9 px shapes on 32 px noisy frames) comes back within 2 levels when
    written lossless; the default 4:2:0 encoding smears the colours by tens of levels, which is
    why the synthetic set is written lossless (its models could not learn shapes otherwise)."""
    from vlmod.data.synthetic_video import video_sample

    frames, _, _ = video_sample(np.random.default_rng(0), "shape", "star", 32, 6)
    exact = load_video(write_video(tmp_path / "lossless.mp4", frames, lossless=True), num_frames=6).frames
    lossy = load_video(write_video(tmp_path / "default.mp4", frames), num_frames=6).frames
    assert np.abs(exact.astype(int) - frames).max() <= 2
    assert np.abs(lossy.astype(int) - frames).max() > 20


def test_sample_indices():
    assert sample_indices(5, 8).tolist() == [0, 1, 2, 3, 4]
    assert sample_indices(100, 4).tolist() == [12, 37, 62, 87]
    assert sample_indices(30, 8, "fps", fps=5, video_fps=30).tolist() == [0, 6, 12, 18, 24]
    # 25 candidates (one every 4 frames) thinned uniformly to 5
    assert sample_indices(100, 5, "fps", fps=7.5, video_fps=30).tolist() == [8, 28, 48, 68, 88]
    with pytest.raises(VideoError, match="no frames"):
        sample_indices(0, 8)
    with pytest.raises(VideoError, match="frame rate"):
        sample_indices(10, 8, "fps", fps=2, video_fps=0)
    with pytest.raises(ValueError, match="fps > 0"):
        sample_indices(10, 8, "fps")
    with pytest.raises(ValueError, match="num_frames"):
        sample_indices(10, 0)
    with pytest.raises(ValueError, match="'uniform' or 'fps'"):
        sample_indices(10, 4, "random")


# ----------------------------------------------------------------------------- video prompts

# The LLaVA variants of the plugin registry (llava.VARIANTS) whose processors take clips; the
# registry does not say which take video, so a new video variant is added here.
VIDEO_FAMILIES = ["llava_next_video", "llava_onevision"]


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def video_model(request: pytest.FixtureRequest):
    model, processor = tiny.build(request.param)
    mod = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=0.5))
    return model, mod, processor


def _check_routing(model, mod, inputs: dict) -> None:
    """Every MoD layer processes every text token and ceil(capacity * video tokens) video tokens per
    sequence; padding never runs."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    video = (ids == model.config.video_token_id) & mask
    n_video, n_text = video.sum(1), (mask & ~video).sum(1)
    assert (n_video > 0).all()
    expected = n_text + torch.ceil(0.5 * n_video).long()
    with vlmod.trace_routing(mod) as trace, torch.no_grad():
        logits = mod(**inputs).logits
    assert torch.isfinite(logits[mask]).all()
    types = trace.token_types
    assert torch.equal(types == TokenType.VIDEO, video)
    assert torch.equal(types == TokenType.PADDING, ~mask)
    assert set(trace.processed) == {("language", 1), ("language", 3)}
    for key, processed in trace.processed.items():
        assert torch.equal(processed.sum(1), expected), key
        assert processed[types == TokenType.INSTRUCTION].all(), key
        assert not processed[~mask].any(), key
        assert processed[video].sum() == int(torch.ceil(0.5 * n_video).sum()), key


@pytest.mark.parametrize("num_frames", [4, 8])
def test_video_prompt_routes_video_tokens(clip, video_model, num_frames: int):
    model, mod, processor = video_model
    frames = load_video(clip, num_frames=num_frames).frames
    inputs = dict(
        processor(videos=[frames], text=[chat_prompt(processor, "what color is it", "video")], return_tensors="pt")
    )
    assert inputs["pixel_values_videos"].shape[:2] == (1, num_frames)
    _check_routing(model, mod, inputs)


def test_video_batch_with_prompts_of_different_lengths(clip, video_model):
    """Two clips (different frames of the file) with prompts of different lengths: left padding, so
    rows differ in length. (The processors stack clips into one [B, T, 3, H, W] tensor, so a batch's
    clips must have the same frame count.)"""
    model, mod, processor = video_model
    videos = [load_video(clip, num_frames=6).frames, load_video(clip, num_frames=6, fps=3).frames]
    questions = ["what color", "where is the square moving in this video ? answer with one word"]
    prompts = [chat_prompt(processor, q, "video") for q in questions]
    inputs = dict(processor(videos=videos, text=prompts, return_tensors="pt", padding=True))
    assert (inputs["attention_mask"] == 0).any()
    _check_routing(model, mod, inputs)


# ----------------------------------------------------------------------------- benchmark

REQUIRED = ("frames_per_s", "prefill_s", "decode_tokens_per_s", "kv_cache_bytes", "flops")


def test_bench_video_tiny_preset(tmp_path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "bench.json"
    args = ["bench", "video", "--preset", "tiny", "--repeats", "1", "--warmup", "0", "--new-tokens", "2", "--control"]
    assert main([*args, "--no-progress", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "frames/s" in printed and "predicted speedup" in printed
    result = json.loads(out.read_text())
    # --control: a second dense model in the prefill rotation, its ratio to dense the noise floor.
    assert "dense / a second dense (same weights, the noise floor)" in printed
    dense, control = result["dense"]["prefill_samples_s"], result["prefill_control"]["samples_s"]
    assert len(control) == len(dense) == 1
    assert result["prefill_control"]["ratio"] == pytest.approx(dense[0] / control[0])
    assert result["prefill_speedup_paired"] == pytest.approx(dense[0] / result["mod"]["prefill_samples_s"][0])
    for name in ("dense", "mod"):
        for key in REQUIRED:
            assert math.isfinite(result[name][key]) and result[name][key] > 0, (name, key)
        split = result[name]["time_split"]
        assert set(split) == {
            "decode_video_s",
            "preprocess_s",
            "generate_s",
            "first_token_s",
            "decode_steps_s",
        }
        assert (
            0 < split["first_token_s"] < split["generate_s"]
            and 0 < split["decode_steps_s"] < split["generate_s"]
        )
    for key in (
        "predicted_speedup",
        "speedup",
        "prefill_speedup",
        "prefill_efficiency",
        "decode_only_frames_per_s",
        "predicted_speedup_causal_attention",
    ):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["mod"]["flops"] < result["dense"]["flops"]
    assert result["mod"]["kv_cache_bytes"] < result["dense"]["kv_cache_bytes"]
    assert result["predicted_speedup"] == pytest.approx(result["dense"]["flops"] / result["mod"]["flops"])
    assert result["mod_layers"] == {"language:2": 0.5}  # 4 layers: all but the first two and the last
    assert result["frames"] == 8 and result["video_tokens"] == 8 * 4


def test_bench_video_given_file_onevision_batch(clip, tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "video",
        "--preset",
        "tiny-onevision",
        "--video",
        str(clip),
        "--frames",
        "4",
        "--batch",
        "2",
    ]
    args += ["--layers", "all", "--repeats", "1", "--warmup", "0", "--new-tokens", "2", "--no-progress"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["video"] == str(clip) and result["batch"] == 2 and result["frames"] == 4
    assert set(result["mod_layers"]) == {"language:1", "language:2", "language:3"}
    assert result["dense"]["frames_per_s"] > 0 and result["mod"]["flops"] < result["dense"]["flops"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--video", "/no/such/clip.mp4"], "does not exist"),
        (["--video", "CORRUPT"], "not a readable video"),
        (["--preset", "no-such-preset"], "unknown video preset"),
        (["--layers", "x,y"], "layers must be"),
        (["--capacity", "1.5"], "capacity must be in"),
    ],
)
def test_bench_video_bad_input(tmp_path, capfd: pytest.CaptureFixture[str], extra: list[str], message: str):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(os.urandom(2048))
    extra = [str(corrupt) if a == "CORRUPT" else a for a in extra]
    assert main(["bench", "video", *extra, "--no-progress"]) == 2
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert captured.out == ""


def test_bench_video_checkpoint(tmp_path, capfd: pytest.CaptureFixture[str]):
    """--model loads a saved checkpoint with its processor; an image-only LLaVA is refused."""
    video_dir = tiny.save("llava_next_video", tmp_path / "video")
    args = ["--repeats", "1", "--warmup", "0", "--new-tokens", "2", "--no-progress", "--json"]
    assert main(["bench", "video", "--model", str(video_dir), *args, str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["model"] == str(video_dir) and result["video_tokens"] == 8 * 4
    image_dir = tiny.save("llava", tmp_path / "image")
    capfd.readouterr()
    assert main(["bench", "video", "--model", str(image_dir), *args, str(tmp_path / "x.json")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "takes no video" in err[0]
