"""Failure modes a user met, each reproduced: runs that own their folders, output paths checked
before work, convert that cannot delete its input, damaged checkpoints as one line, resume past a
damaged checkpoint, a full disk, mixed frame counts, bad flags and settings refused up front."""

from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import vlmod
from vlmod.cli import main as cli_main
from vlmod.models import tiny
from vlmod.training.train import TrainConfig, TrainError, train

MOD = {"capacity": 0.5, "layers": [1, 2], "routable": ["image"]}


@pytest.fixture(scope="module")
def work(llava_workdir: Callable[..., Path]) -> Path:
    return llava_workdir("failures", train=8, val=2)


def _cfg(work: Path, out: Path, **kw) -> TrainConfig:
    base = dict(model=str(work / "dense"), data=str(work / "data" / "train.json"), output_dir=str(out), batch_size=4,
                lr=1e-3, max_steps=3, save_steps=1, save_total_limit=None, log_steps=1, cache_data=True, mod=MOD)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def first_run(work: Path) -> Path:
    """A finished run with checkpoints step-1 and step-2 (3 steps, a save every step)."""
    train(_cfg(work, work / "run-a"), progress=False)
    return work / "run-a"


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one `error:` line of a command, and no traceback."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails the test: the command must stop before its work starts. The demo's
    model module is imported first and patched too: imported under the patch, it would keep the
    refusing loader for the rest of the session (it binds `load_vlm` by name), as would the recipe's
    modules (`load_pretrained`), imported first for that reason."""
    import vlmod.demo.model
    import vlmod.io.hf
    import vlmod.recipes.isoflop
    import vlmod.recipes.methods
    import vlmod.recipes.recipe  # noqa: F401

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the output path was checked")

    monkeypatch.setattr(vlmod.io.hf, "load_vlm", refuse)
    monkeypatch.setattr(vlmod.io.hf, "load_pretrained", refuse)
    monkeypatch.setattr(vlmod.demo.model, "load_vlm", refuse)


# ----------------------------------------------------------------------------- a run owns its folder


def test_finetune_refuses_a_folder_holding_another_runs_checkpoints(work, first_run, tmp_path, capsys):
    out = _copy(first_run, tmp_path / "run")
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert before == ["step-1", "step-2"] and (out / "run.json").is_file()
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump({**_cfg(work, out, lr=5e-4, seed=7).to_dict(), "resume": None}))
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 2
    line = _error_line(capsys)
    assert "already holds the checkpoints of another run" in line and "lr: 0.001 -> 0.0005" in line
    assert "--resume latest" in line and "--overwrite" in line
    # Continuing it under other settings is refused too, naming what differs.
    with pytest.raises(TrainError, match=r"other settings.*lr: 0.001 -> 0.0005.*seed: 0 -> 7"):
        train(_cfg(work, out, lr=5e-4, seed=7, resume="latest"), progress=False)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    # --overwrite starts over: the old run's checkpoints are gone, the new run owns the folder.
    train(_cfg(work, out, lr=5e-4, seed=7, max_steps=2, overwrite=True), progress=False)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    assert json.loads((out / "run.json").read_text())["settings"]["seed"] == 7


def test_resume_and_overwrite_together_are_refused(work, tmp_path):
    with pytest.raises(TrainError, match="contradict"):
        _cfg(work, tmp_path, resume="latest", overwrite=True)


# -------------------------------------------------------------- resume past a damaged checkpoint, a full disk


def test_resume_latest_falls_back_past_a_damaged_checkpoint(work, first_run, tmp_path, capsys):
    out = _copy(first_run, tmp_path / "run")
    weights = out / "checkpoints" / "step-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(TrainError, match=r"step-2 is damaged \(model.safetensors"):
        train(_cfg(work, out, resume=str(out / "checkpoints" / "step-2")), progress=False)
    capsys.readouterr()
    result = train(_cfg(work, out, resume="latest"), progress=False)
    printed = capsys.readouterr().out
    assert "warning: checkpoint" in printed and "step-2 is damaged" in printed
    assert "step-1 (the newest intact checkpoint): step 1" in printed
    # The history goes on from the checkpoint's: step 1 from it, steps 2 and 3 resumed.
    assert result.step == 3 and [h["step"] for h in result.history] == [1, 2, 3]


def test_resume_latest_with_a_broken_state_file_and_rng_state(work, first_run, tmp_path, capsys):
    out = _copy(first_run, tmp_path / "run")
    (out / "checkpoints" / "step-2" / "trainer_state.json").write_text("{")
    (out / "checkpoints" / "step-1" / "random_states_0.pkl").write_bytes(b"not a pickle")
    result = train(_cfg(work, out, resume="latest"), progress=False)
    printed = capsys.readouterr().out
    assert "trainer_state.json is unreadable" in printed
    assert "the random state in" in printed and "could not be restored" in printed
    assert result.step == 3


def test_a_full_disk_at_the_final_save_is_one_line(work, tmp_path, capsys, monkeypatch):
    from transformers import LlavaForConditionalGeneration

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LlavaForConditionalGeneration, "save_pretrained", disk_full)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**_cfg(work, tmp_path / "run", max_steps=1, save_steps=0).to_dict()}))
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 2
    line = _error_line(capsys)
    assert "could not save the model" in line and "No space left on device" in line
    assert "saved no checkpoint" in line and "--resume" not in line  # none to resume from: it says so
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / "model.tmp").exists()
    config.write_text(yaml.safe_dump({**_cfg(work, tmp_path / "kept", max_steps=2, save_steps=1).to_dict()}))
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 2
    line = _error_line(capsys)
    assert "--resume latest" in line and "checkpoint step-1 is kept" in line
    assert (tmp_path / "kept" / "checkpoints" / "step-1").is_dir()


# ----------------------------------------------------------------------------- outputs checked first


def test_output_paths_fail_before_any_work(work, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    data = str(work / "data" / "val.json")
    model = str(work / "dense")
    cases = [
        (["finetune", "--model", model, "--data", data, "--output-dir", str(a_file)], "is a file"),
        (["finetune", "--model", model, "--data", data, "--output-dir", str(a_file / "sub")], "cannot be created"),
        (["eval", "--model", model, "--data", data, "--json", str(tmp_path)], "is a folder"),
        (["eval", "--model", model, "--data", data, "--json", str(a_file / "r.json")], "cannot be created"),
        (["eval", "--model", model, "--data", data, "--json", data], "is the input"),
        (["audit", "--model", model, "--data", data, "--plots", str(a_file)], "is a file"),
        (["audit", "--model", model, "--data", data, "--json", str(work / "dense" / "r.json")], "inside the input"),
        (["rank", "--model", model, "--data", data, "--out", str(tmp_path)], "is a folder"),
        (["rank", "--model", model, "--data", data, "--out", str(a_file / "ranks.json")], "cannot be created"),
    ]
    for argv, message in cases:
        assert cli_main(argv) == 2, argv
        assert message in _error_line(capsys), argv
    assert a_file.read_text() == "x"


# ----------------------------------------------------------------------------- convert


def test_convert_refuses_an_out_that_holds_or_is_its_model(work, tmp_path, capsys):
    parent = tmp_path / "parent"
    model = _copy(work / "dense", parent / "model")
    (parent / "notes.txt").write_text("unrelated")
    for out in (parent, model, model / "sub"):
        assert cli_main(["convert", "--model", str(model), "--out", str(out), "--overwrite"]) == 2
        assert "input" in _error_line(capsys)
    assert (model / "config.json").is_file() and (parent / "notes.txt").read_text() == "unrelated"


def test_convert_cleans_leftovers_and_gives_normal_permissions(work, tmp_path, capsys):
    leftover = tmp_path / ".mod.tmp-killed1"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    out = tmp_path / "mod"
    assert cli_main(["convert", "--model", str(work / "dense"), "--out", str(out), "--layers", "1,2"]) == 0
    printed = capsys.readouterr()
    assert not leftover.exists() and "left by an interrupted convert" in printed.out + printed.err
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_second_convert_to_the_same_out_is_refused_and_deletes_nothing(work, tmp_path, capsys):
    """While one convert writes --out, another to the same --out stops in one line and leaves the
    first one's temp folder alone (it used to take it for a killed run's leftover)."""
    fcntl = pytest.importorskip("fcntl")
    out = tmp_path / "mod"
    running = tmp_path / ".mod.tmp-running1"
    running.mkdir()
    fd = os.open(tmp_path / ".mod.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the first convert holds while it saves
        assert cli_main(["convert", "--model", str(work / "dense"), "--out", str(out), "--layers", "1,2"]) == 2
        assert "being written by another process" in _error_line(capsys)
        assert running.is_dir() and not out.exists()
    finally:
        os.close(fd)
    assert cli_main(["convert", "--model", str(work / "dense"), "--out", str(out), "--layers", "1,2"]) == 0
    assert (out / "config.json").is_file() and not (tmp_path / ".mod.lock").exists()


def test_a_safetensors_write_error_is_one_line(work, tmp_path, capsys, monkeypatch):
    """The safetensors writer's own error (a full disk mid-shard) has no strerror: still one line,
    and --out is not created."""
    from safetensors import SafetensorError

    import vlmod.tools.convert as convert_module

    def full_disk(folder):
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr(convert_module, "align_folder", full_disk)
    out = tmp_path / "mod"
    assert cli_main(["convert", "--model", str(work / "dense"), "--out", str(out), "--layers", "1,2"]) == 2
    line = _error_line(capsys)
    assert "No space left on device" in line and "not created" in line
    assert not out.exists() and not list(tmp_path.glob(".mod.tmp-*"))


BILLION_LAUGHS = "".join(
    [f"l0: &l0 [{', '.join(['lol'] * 9)}]\n"]
    + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9)]
)


def test_a_config_of_nested_aliases_is_refused_in_one_short_line(work, tmp_path, capsys):
    """A few hundred bytes of YAML aliases of aliases stand for 9^9 values: refused as read, in a
    line that does not print them."""
    for command, section in (("finetune", "mod: {capacity: *l8}\n"), ("convert", "mod: {capacity: *l8}\n")):
        config = tmp_path / f"{command}.yaml"
        config.write_text(BILLION_LAUGHS + section)
        argv = [command, "--config", str(config)]
        argv += ["--model", str(work / "dense"), "--out", str(tmp_path / "mod")] if command == "convert" else []
        assert cli_main(argv) == 2, command
        line = _error_line(capsys)
        assert "expands to more than 100,000 values" in line and len(line) < 400, line


# ----------------------------------------------------------------------------- damaged / foreign checkpoints


@pytest.fixture(scope="module")
def converted(work: Path) -> Path:
    model = vlmod.load_pretrained(work / "dense")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1, 2]))
    out = work / "converted"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        if (work / "dense" / name).is_file():
            shutil.copy(work / "dense" / name, out / name)
    return out


def _with_vlmod(src: Path, dst: Path, section) -> Path:
    _copy(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["vlmod"] = section
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_damaged_checkpoints_are_one_line_naming_the_file(work, converted, tmp_path, capsys):
    data = str(work / "data" / "val.json")
    truncated = _copy(converted, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    bad = {
        truncated: "model.safetensors",
        _with_vlmod(converted, tmp_path / "as-list", [1, 2]): "'vlmod' must map a part",
        _with_vlmod(converted, tmp_path / "as-str", "mod"): "got a str",
        _with_vlmod(converted, tmp_path / "str-capacity", {"language": {"capacity": "0.5"}}): "vlmod.language: capacity",
    }
    for path, message in bad.items():
        assert cli_main(["eval", "--model", str(path), "--data", data, "--no-progress", "--device", "cpu"]) == 2
        line = _error_line(capsys)
        assert message in line and str(path) in line, line
    nan = _copy(converted, tmp_path / "nan")
    model = vlmod.load_pretrained(converted)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.save_pretrained(nan)
    assert cli_main(["eval", "--model", str(nan), "--data", data, "--no-progress", "--device", "cpu"]) == 2
    assert "NaN or infinite" in _error_line(capsys)


def test_missing_router_weights_load_as_zero_routers_with_a_warning(work, converted, tmp_path):
    """Before: transformers initialised the missing routers at random, silently."""
    routerless = _copy(work / "dense", tmp_path / "routerless")
    shutil.copy(converted / "config.json", routerless / "config.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = vlmod.load_pretrained(routerless)
    assert any("load as zero routers" in str(w.message) for w in caught)
    routers = [p for n, p in model.named_parameters() if "mod_router" in n]
    assert routers and all(torch.count_nonzero(p) == 0 for p in routers)


# ----------------------------------------------------------------------------- mixed frame counts


def test_a_one_frame_clip_batches_with_longer_ones(tmp_path):
    from vlmod.data import LlavaDataset
    from vlmod.data.video import write_video

    rng = np.random.default_rng(0)
    records = []
    for name, frames in (("one", 1), ("eight", 8), ("three", 3)):
        write_video(tmp_path / f"{name}.mp4", rng.integers(0, 256, (frames, 32, 32, 3), dtype=np.uint8))
        records.append({"id": name, "video": f"{name}.mp4", "conversations": [
            {"from": "human", "value": "<video>\nwhat moves ?"}, {"from": "gpt", "value": "a circle"}]})
    (tmp_path / "data.json").write_text(json.dumps(records))
    _, processor = tiny.build("llava_next_video")
    ds = LlavaDataset(tmp_path / "data.json", processor, num_frames=4)
    batch = ds.collate([ds[i] for i in range(3)])
    assert batch["pixel_values_videos"].shape[:2] == (3, 4)
    assert not ds.skipped


# ----------------------------------------------------------------------------- bad flags and settings


@pytest.mark.parametrize("kwargs", [
    {"gate_alpha": float("nan")}, {"seed": "x"}, {"aux_loss_weight": -1}, {"share_router": "no"},
    {"gate_alpha": float("inf")}, {"seed": True},
])
def test_modconfig_validates_at_construction(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        vlmod.MoDConfig(**kwargs)


def test_bad_flags_are_one_error_line(work, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    data = str(work / "data" / "val.json")
    model = str(work / "dense")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        cases = [
            ["demo", "--port", "70000"],
            ["demo", "--max-upload-mb", "inf"],
            ["demo", "--max-upload-mb", "nan"],
            ["demo", "--device", "bogus"],
            ["demo", "--port", str(busy.getsockname()[1])],  # bound before the model loads
            ["eval", "--model", model, "--data", data, "--device", "bogus"],
            ["rank", "--model", model, "--data", data, "--device", "bogus"],
            ["finetune", "--model", model, "--data", data, "--output-dir", str(tmp_path / "o"), "--epochs", "inf"],
        ]
        if not torch.cuda.is_available():
            cases += [["eval", "--model", model, "--data", data, "--device", "cuda"], ["demo", "--device", "cuda"]]
        for argv in cases:
            assert cli_main(argv) == 2, argv
            _error_line(capsys)
    for key, value in (("warmup", ".nan"), ("max_grad_norm", ".nan"), ("lr", ".inf")):
        config = tmp_path / f"{key}.yaml"
        config.write_text(f"model: {model}\ndata: {data}\noutput_dir: {tmp_path / 'o'}\n{key}: {value}\n")
        assert cli_main(["finetune", "--config", str(config)]) == 2
        assert key in _error_line(capsys)


def test_devices_torch_knows_but_vlmod_does_not_run_on_are_refused_in_the_flag(work, capsys, monkeypatch):
    """Before: --device meta and --device xpu passed the device check (torch knows both), then failed
    deep, in a traceback: "Tensor.item() cannot be called on meta tensors" after the model loaded,
    "Torch not compiled with XPU enabled". Now the flag refuses them."""
    _no_loading(monkeypatch)
    model, data = str(work / "dense"), str(work / "data" / "val.json")
    for device, reason in (("meta", "the meta device holds shapes, not values, so no model runs on it; use cpu, "
                                    "cuda or mps"),
                           ("xpu", "vlmod runs on cpu, cuda and mps, not xpu; use one of those")):
        for argv in (["eval", "--model", model, "--data", data], ["bench", "llava", "--preset", "tiny"],
                     ["bench", "train", "--preset", "tiny"], ["demo"]):
            assert cli_main([*argv, "--device", device]) == 2, argv
            assert _error_line(capsys) == (f"error: argument --device: --device {device}: {reason} (see vlmod "
                                           f"{' '.join(a for a in argv[:2] if not a.startswith('-'))} --help)"), argv


def test_threads_above_the_cores_are_refused_by_every_command(tmp_path, capsys, monkeypatch):
    """Before: `--threads 512` on a 2-core machine was accepted (every thread past the cores only
    contends for them). Now each command that takes --threads refuses more than the cores."""
    import vlmod.bench.timing
    import vlmod.cli.argtypes
    import vlmod.cli.bench
    import vlmod.cli.bench_train
    import vlmod.recipes.recipe

    _no_loading(monkeypatch)
    monkeypatch.chdir(tmp_path)
    for module, name in ((vlmod.cli.bench, "bench_vit"), (vlmod.cli.bench, "bench_llava"),
                         (vlmod.cli.bench, "bench_video"), (vlmod.cli.bench_train, "bench_train"),
                         (vlmod.recipes.recipe, "generate")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the command ran"))
    monkeypatch.setattr(vlmod.bench.timing, "available_cores", lambda: 2)
    for argv in (["recipe", "--quick"], ["bench", "vit"], ["bench", "llava"], ["bench", "video"], ["bench", "train"]):
        assert cli_main([*argv, "--threads", "512"]) == 2, argv
        assert _error_line(capsys) == (f"error: argument --threads: expected at most 2 (this machine's cores), got "
                                       f"512 (see vlmod {' '.join(a for a in argv if not a.startswith('-'))} --help)")
    assert vlmod.cli.argtypes.threads("2") == 2


def test_finetune_settings_are_checked_when_the_config_loads(work, tmp_path, capsys, monkeypatch):
    """Before: `lora_dropout: 1.5` was refused in peft's words after the model had loaded, and
    `num_frames: 0` skipped every video record as unreadable. Now both, and LoRA's other settings,
    are refused in one line when the config is read, before any loading."""
    _no_loading(monkeypatch)
    for key, value, message in (
        ("lora_dropout", 1.5, "lora_dropout is the share of LoRA inputs dropped in training, in [0, 1); got 1.5"),
        ("lora_dropout", -0.1, "lora_dropout is the share of LoRA inputs dropped in training, in [0, 1); got -0.1"),
        ("lora_alpha", 0, "lora_alpha must be > 0, got 0"),
        ("lora_targets", [], "lora_targets must name one or more module names (e.g. q_proj, k_proj); got []"),
        ("num_frames", 0, "num_frames must be > 0, got 0"),
    ):
        with pytest.raises(TrainError) as caught:
            _cfg(work, tmp_path / "o", trainable="lora", **{key: value})
        assert str(caught.value) == message
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({**_cfg(work, tmp_path / "o").to_dict(), "trainable": "lora", key: value}))
        assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 2
        assert _error_line(capsys) == f"error: {message}"
    assert not (tmp_path / "o").exists()


def test_a_resumed_finetune_counts_only_the_steps_it_ran(work, first_run, tmp_path, capsys):
    """Before: resumed at step 2 of 3, the summary said "3 steps in 1 s", counting the two steps an
    earlier process ran. Now it counts this process's step and says where it resumed."""
    out = _copy(first_run, tmp_path / "run")
    config = tmp_path / "resume.yaml"
    config.write_text(yaml.safe_dump({**_cfg(work, out).to_dict(), "resume": "latest"}))
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("1 step in ") and " s (resumed from step 2, now at step 3), loss " in summary, summary


def test_max_shard_size_must_be_a_positive_size(work, tmp_path, capsys, monkeypatch):
    """Before: `--max-shard-size -5GB` was taken for an unknown flag ("expected one argument"), and
    `0GB` passed the check. Now each is refused as the size it is, in one line, before any work."""
    from vlmod.tools.convert import ConvertError, _check_shard_size

    _no_loading(monkeypatch)
    for size in ("-5GB", "0GB", "0", "1.5", "5XB"):
        argv = ["convert", "--model", str(work / "dense"), "--out", str(tmp_path / "c"), "--capacity", "0.5"]
        assert cli_main([*argv, "--max-shard-size", size]) == 2, size
        assert _error_line(capsys) == (f"error: argument --max-shard-size: expected a size > 0 such as 5GB, 500MB or a "
                                       f"number of bytes, got {size!r} (see vlmod convert --help)")
    with pytest.raises(ConvertError, match="--max-shard-size must be a size such as 5GB"):
        _check_shard_size("0GB")
    _check_shard_size("500MB")
    _check_shard_size(10**9)
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------- errors that say exactly what is wrong


def test_jsonl_error_names_the_files_line(tmp_path):
    from vlmod.data.llava_format import DataError, read_json_records

    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a"}\n\n{"id": "b"}\n{"id": \n')
    with pytest.raises(DataError, match="at line 4, column"):
        read_json_records(path)


def test_rank_selection_that_keeps_every_layer_is_an_error(tmp_path):
    from vlmod.tools.arank import LayerRanks
    from vlmod.tools.arank import check_selection as _check_selection

    with pytest.raises(ValueError, match="keep all 4 layers dense"):
        _check_selection(4, None, None, 99, 0)
    with pytest.raises(ValueError, match="only 2 of 4"):
        _check_selection(4, 3, None, 1, 1)
    binary = tmp_path / "ranks.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match="ranks.json is not a ranks JSON file"):
        LayerRanks.from_json(binary)
