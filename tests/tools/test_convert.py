"""The convert script on tiny checkpoints saved to temp dirs, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from helpers.inputs import chat_prompt
from transformers import CLIPVisionConfig, CLIPVisionModel

import vlmod
from vlmod.cli import main
from vlmod.models import tiny


def _inputs(processor) -> dict:
    from PIL import Image

    text = chat_prompt(processor, "what color is the circle")
    return dict(processor(images=[Image.new("RGB", (40, 32), (200, 30, 30))], text=[text], return_tensors="pt"))


def test_script_converts_and_load_pretrained_gives_it_back(llava_checkpoint, tmp_path):
    out = tmp_path / "mod"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convert_llava.py"), "--model", str(llava_checkpoint), "--out", str(out),
         "--capacity", "0.5", "--layers", "1,3", "--vision-capacity", "0.5", "--vision-layers", "1"],
        capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert "converted LlavaForConditionalGeneration" in result.stdout
    report = json.loads((out / "vlmod_report.json").read_text())
    assert report["layers"] == {"language": {"1": 0.5, "3": 0.5}, "vision": {"1": 0.5}}
    assert report["parameters"]["added"] == (64 + 1) + (32 + 1)  # one shared router per part
    prediction = report["prediction"]
    assert prediction["image_tokens"] == 16 and prediction["predicted_speedup"] > 1.0
    assert 0.0 < prediction["kv_cache_reduction"] < 1.0
    assert (out / "tokenizer.json").is_file() and (out / "processor_config.json").is_file()

    loaded = vlmod.load_pretrained(out)
    assert vlmod.mod_layers(loaded) == {("vision", 1): 0.5, ("language", 1): 0.5, ("language", 3): 0.5}
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(out)
    expected, _ = tiny.build("llava")
    vlmod.apply_mod(expected, vlmod.MoDConfig(capacity=0.5, layers=[1, 3]))
    vlmod.apply_mod(expected, vlmod.MoDConfig(capacity=0.5, layers=[1]), part="vision")
    inputs = _inputs(processor)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, expected(**inputs).logits)


def test_yaml_config_and_flag_override(llava_checkpoint, tmp_path):
    config = tmp_path / "convert.yaml"
    config.write_text(f"model: {llava_checkpoint}\nout: {tmp_path / 'from-yaml'}\ncapacity: 0.25\nlayers: all\n")
    assert main(["convert", "--config", str(config), "--capacity", "0.5"]) == 0
    report = json.loads((tmp_path / "from-yaml" / "vlmod_report.json").read_text())
    assert report["layers"]["language"] == {"1": 0.5, "2": 0.5, "3": 0.5}


def test_layers_from_a_ranks_file(llava_checkpoint, tmp_path):
    from vlmod.tools.arank import LayerRanks

    ranks = LayerRanks(
        part="language", mean=[9.0, 3.0, 8.0, 1.0], std=[0.0] * 4, normalized=[0.9, 0.3, 0.8, 0.1],
        normalized_std=[0.0] * 4, num_samples=4, tokens=[10] * 4, family="llava", dense_layers=[0],
    )
    ranks.to_json(tmp_path / "ranks.json")
    out = tmp_path / "arank"
    assert main(["convert", "--model", str(llava_checkpoint), "--out", str(out), "--layers", "arank:2",
                 "--ranks", str(tmp_path / "ranks.json")]) == 0
    report = json.loads((out / "vlmod_report.json").read_text())
    assert set(report["layers"]["language"]) == {"1", "3"}


def test_layers_ranked_on_the_fly(llava_checkpoint, tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        Image.new("RGB", (32 + 8 * i, 32), (40 * i, 200, 90)).save(images / f"{i}.png")
    out = tmp_path / "arank-calib"
    argv = ["convert", "--model", str(llava_checkpoint), "--out", str(out), "--layers", "arank:2",
            "--calib-data", str(images), "--calib-prompt", "what color is the image ?", "--calib-samples", "3"]
    assert main(argv) == 0
    report = json.loads((out / "vlmod_report.json").read_text())
    assert len(report["layers"]["language"]) == 2 and "0" not in report["layers"]["language"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--capacity", "0"], "capacity must be in (0, 1]"),
        (["--layers", "0,1"], "layer 0 must stay dense"),
        (["--layers", "1,9"], "out of range"),
        (["--layers", "arank:2"], "needs --ranks"),
        (["--dtype", "int8"], "invalid choice"),
    ],
)
def test_bad_input_is_one_error_line(llava_checkpoint, tmp_path, capsys, args, message):
    argv = ["convert", "--model", str(llava_checkpoint), "--out", str(tmp_path / "out"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not (tmp_path / "out").exists()


def test_not_a_llava_checkpoint(tmp_path, capsys):
    clip = tmp_path / "clip"
    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=32, patch_size=8)).save_pretrained(clip)
    assert main(["convert", "--model", str(clip), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a LLaVA checkpoint" in err and "clip_vision_model" in err


def test_existing_output_is_kept_without_overwrite_and_replaced_with_it(llava_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main(["convert", "--model", str(llava_checkpoint), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"
    assert main(["convert", "--model", str(llava_checkpoint), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "vlmod_report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_nothing_half_written_when_saving_fails(llava_checkpoint, tmp_path, monkeypatch, capsys):
    """A full disk is one `error:` line (exit 2), and the old --out is untouched."""
    from transformers import LlavaForConditionalGeneration

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old result")

    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(LlavaForConditionalGeneration, "save_pretrained", broken_save)
    assert main(["convert", "--model", str(llava_checkpoint), "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: could not save the converted model") and "disk full" in line
    assert "Traceback" not in err
    assert (out / "keep.txt").read_text() == "old result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
