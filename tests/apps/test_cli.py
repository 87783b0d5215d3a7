"""The `vlmod` command and the benchmark scripts, as a user runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from vlmod.cli import main


def test_bench_vit_script_writes_json(tmp_path):
    out = tmp_path / "vit.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_vit.py"), "--model", "vit_tiny_patch16_224", "--batch", "2",
         "--image-size", "64", "--capacity", "0.25", "--warmup", "0", "--repeats", "2", "--json", str(out),
         "--no-progress"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "predicted speedup" in result.stdout
    data = json.loads(out.read_text())
    assert data["mod_layers"] == [1, 3, 5, 7, 9, 11]
    assert set(data["processed_tokens"].values()) == {1 + 4}  # CLS + ceil(0.25 * 16) patches
    assert data["dense"]["flops_per_image"] > data["mod"]["flops_per_image"] > 0
    assert data["predicted_speedup"] == pytest.approx(data["dense"]["flops_per_image"] / data["mod"]["flops_per_image"])
    for key in ("images_per_s", "latency_s"):
        assert data["dense"][key] > 0 and data["mod"][key] > 0


def test_profile_train_step_script_profiles_both_models():
    """scripts/profile_train_step.py (the GPU profile of docs/gpu.md) runs on the CPU too: each
    model's step under torch.profiler, in the checkpoint's dtype."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "profile_train_step.py"), "--preset", "tiny-video", "--device", "cpu",
         "--dtype", "bfloat16", "--batch-size", "1", "--steps", "1", "--top", "3"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    for name in ("dense", "MoD"):
        assert f"===== {name}: " in result.stdout and "kernels a step" in result.stdout


def test_bench_llava_tiny_preset_writes_json(tmp_path, capsys):
    out = tmp_path / "llava.json"
    argv = ["bench", "llava", "--preset", "tiny", "--warmup", "0", "--repeats", "1", "--new-tokens", "3",
            "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "predicted prefill speedup" in capsys.readouterr().out
    data = json.loads(out.read_text())
    for part in ("dense", "mod"):
        assert {"prefill_s", "decode_tokens_per_s", "kv_cache_bytes", "flops"} <= set(data[part])
    assert data["image_tokens"] == 16
    assert data["mod"]["kv_cache_bytes"] < data["dense"]["kv_cache_bytes"]
    assert data["mod"]["flops"] < data["dense"]["flops"]
    assert data["predicted_speedup"] == pytest.approx(data["dense"]["flops"] / data["mod"]["flops"])
    assert 0 < data["kv_cache_reduction"] < 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "vit", "--model", "no_such_vit"], "unknown timm model"),
        (["bench", "vit", "--model", "vit_tiny_patch16_224", "--capacity", "2"], "capacity must be in (0, 1]"),
        (["bench", "vit", "--model", "vit_tiny_patch16_224", "--layers", "40"], "out of range"),
        (["bench", "llava", "--model", "/no/such/checkpoint"], "does not exist"),
        (["convert"], "--model and --out are required"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_error_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_console_script_is_installed():
    exe = shutil.which("vlmod") or str(Path(sys.executable).parent / "vlmod")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("convert", "rank", "bench"):
        assert command in result.stdout


def test_probe_query_keep_script_fits_scores_and_trains_behind_the_keep(tmp_path):
    """scripts/probe_query_keep.py (docs/results-history.md, the crowded page's keep that reads the
    question) on a quick crowded run: it fits the scorer, writes the recall of the asked glyph and
    the accuracies behind each keep, and with --train-out trains the stacked stage again behind the
    scorer's keep in a copy (dropping, not merging) without touching the run it read."""
    run = tmp_path / "run"
    assert main(["recipe", "--task", "detail", "--layout", "crowded", "--quick", "--threads", "1", "--no-progress",
                 "--out", str(run)]) == 0
    stack_before = (run / "stack" / "model" / "model.safetensors").read_bytes()
    script = [sys.executable, str(ROOT / "scripts" / "probe_query_keep.py"), str(run), "--fit-samples", "16",
              "--steps", "5", "--num-samples", "8", "--batch-size", "8"]
    out = tmp_path / "probe.json"
    result = subprocess.run([*script, "--json", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert set(data["recall"]) == {"query scorer", "its target (the MoD layers, every token in)", "deviation"}
    assert all(0.0 <= v <= 1.0 for v in data["recall"].values())
    assert len(data["accuracy"]) == 3 and len({r["language_gflops"] for r in data["accuracy"].values()}) == 1

    train = tmp_path / "train"
    result = subprocess.run([*script, "--quick", "--train-out", str(train)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    config = json.loads((train / "stack" / "train_log.json").read_text())["config"]
    assert (config["reduce_merge"], config["reduce_pool"], config["reduce_scoring"]) == (False, 1, "deviation")
    assert (train / "results.json").is_file()
    assert (run / "stack" / "model" / "model.safetensors").read_bytes() == stack_before
    again = subprocess.run([*script, "--quick", "--train-out", str(train)], capture_output=True, text=True)
    assert again.returncode == 2 and "exists; give a new folder" in again.stderr
