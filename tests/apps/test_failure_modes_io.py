"""Failure modes around files, each reproduced: a full disk at every output a command writes (the
results kept, nothing half-written), an output path that is an image the data points to, Ctrl-C,
unreadable inputs (a non-UTF-8 config, a JSON nested too deep, a checkpoint without its weights),
an output folder that cannot be written. Each is one `error:` line and the right exit status.

A full disk is simulated at `fsync` (the atomic writers' last step before the rename) or at the
writer itself, raising OSError(ENOSPC) as the kernel does."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from PIL import Image

from vlmod.cli import main as cli_main

MOD = {"capacity": 0.5, "layers": [1, 2], "routable": ["image"]}


@pytest.fixture(scope="module")
def work(llava_workdir: Callable[..., Path]) -> Path:
    return llava_workdir("failures-io", train=8, val=2)


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one `error:` line of a command, and no traceback."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _disk_full_under(folder: Path, monkeypatch: pytest.MonkeyPatch, suffix: str = "") -> None:
    """fsync of any file under `folder` (whose name holds `suffix`) fails as on a full disk."""
    real = os.fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.startswith(str(folder)) and suffix in Path(name).name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _finetune_yaml(work: Path, path: Path, out: Path, **kw) -> Path:
    settings = dict(model=str(work / "dense"), data=str(work / "data" / "train.json"), output_dir=str(out),
                    batch_size=4, lr=1e-3, max_steps=3, save_steps=1, log_steps=1, cache_data=True, mod=MOD)
    settings.update(kw)
    path.write_text(yaml.safe_dump(settings))
    return path


needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")


# ----------------------------------------------------------------------------- outputs that are inputs


def test_rank_refuses_to_write_over_an_image_the_data_points_to(work, tmp_path, capsys, monkeypatch):
    """Before: `rank --plots IMAGE` overwrote a training image (the data JSON and the model were
    protected, the files they point to were not)."""
    import vlmod.io.hf

    monkeypatch.setattr(vlmod.io.hf, "load_vlm", lambda *a, **k: pytest.fail("a model was loaded"))
    data = work / "data" / "val.json"
    image = data.parent / json.loads(data.read_text())[0]["image"]
    shutil.copy(image, tmp_path / "before.png")
    model = str(work / "dense")
    for flag in ("--plots", "--json"):
        assert cli_main(["rank", "--model", model, "--data", str(data), flag, str(image)]) == 2
        assert f"{flag} {image} is an input the data points to" in _error_line(capsys)
    assert cli_main(["eval", "--model", model, "--data", str(data), "--json", str(image)]) == 2
    assert "is an input the data points to" in _error_line(capsys)
    assert image.read_bytes() == (tmp_path / "before.png").read_bytes()


def test_bench_json_is_checked_as_every_json_before_the_benchmark(work, tmp_path, capsys, monkeypatch):
    """Before: `bench train|llava|video --json PATH` wrote over whatever PATH was (the model's
    weights, its config.json, the --video clip itself; exit 0), and a folder failed only after the
    benchmark had run. Now the rule of eval / audit / rank, before any work."""
    import vlmod.cli.bench as bench_cli
    import vlmod.cli.bench_train as bench_train_cli

    for module, name in ((bench_cli, "bench_vit"), (bench_cli, "bench_llava"), (bench_cli, "bench_video"),
                         (bench_train_cli, "bench_train")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the benchmark ran before --json was checked"))
    model = tmp_path / "model"
    shutil.copytree(work / "dense", model)
    weights = (model / "model.safetensors").read_bytes()
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"a user's clip")
    cases = [
        (["bench", "train", "--model", str(model), "--json", str(model / "model.safetensors")], "inside the input"),
        (["bench", "llava", "--model", str(model), "--json", str(model / "config.json")], "inside the input"),
        (["bench", "video", "--video", str(clip), "--json", str(clip)], "is the input"),
        (["bench", "train", "--json", str(tmp_path)], "is a folder"),
        (["bench", "llava", "--json", str(tmp_path)], "is a folder"),
        (["bench", "video", "--json", str(tmp_path)], "is a folder"),
        (["bench", "vit", "--model", "vit_tiny_patch16_224", "--json", str(tmp_path)], "is a folder"),
    ]
    for argv, message in cases:
        assert cli_main([*argv, "--no-progress"]) == 2, argv
        line = _error_line(capsys)
        assert line.startswith("error: --json ") and message in line, (argv, line)
    assert (model / "model.safetensors").read_bytes() == weights and clip.read_bytes() == b"a user's clip"


def test_data_synthetic_refuses_a_non_empty_out_unless_overwrite(tmp_path, capsys):
    """Before: `vlmod data synthetic --out DIR` wrote over a user's train.json in DIR (exit 0);
    `convert` and `tiny` refused a non-empty --out. Now it does too, unless --overwrite."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "train.json").write_text("a user's records")
    (out / "notes.txt").write_text("unrelated")
    argv = ["data", "synthetic", "--out", str(out), "--train", "2", "--val", "1", "--no-progress"]
    assert cli_main(argv) == 2
    assert _error_line(capsys) == (f"error: --out {out} exists and is not empty; pass --overwrite to write the set "
                                   "over what it holds, or choose a new --out")
    assert (out / "train.json").read_text() == "a user's records" and sorted(p.name for p in out.iterdir()) == [
        "notes.txt", "train.json"]
    assert cli_main([*argv, "--overwrite"]) == 0  # said so: the set's files are written, the rest left alone
    assert len(json.loads((out / "train.json").read_text())) == 2 and (out / "notes.txt").read_text() == "unrelated"
    assert cli_main(["data", "synthetic", "--out", str(tmp_path / "new"), "--train", "2", "--val", "1",
                     "--no-progress"]) == 0


# ----------------------------------------------------------------------------- a full disk


@needs_proc
def test_a_full_disk_at_rank_json_and_plots_is_one_line_and_keeps_the_ranks(work, tmp_path, capsys, monkeypatch):
    """Before: a traceback at --json, and a 0-byte PNG at --plots."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    out.mkdir()
    argv = ["rank", "--model", str(work / "dense"), "--data", str(work / "data" / "train.json"), "--num-samples", "2",
            "--batch-size", "2", "--device", "cpu", "--no-progress", "--json", str(out / "ranks.json")]
    _disk_full_under(out, monkeypatch)
    assert cli_main(argv) == 2
    line = _error_line(capsys)
    assert "could not write --json" in line and "No space left on device" in line, line
    kept = Path(line.split("it was written to ")[1].split(" instead")[0])
    try:
        assert json.loads(kept.read_text())["num_layers"] == 4
    finally:
        kept.unlink()
    assert list(out.iterdir()) == []  # nothing half-written
    monkeypatch.undo()
    _disk_full_under(out, monkeypatch, suffix=".png")
    assert cli_main([*argv, "--plots", str(out / "ranks.png")]) == 2
    line = _error_line(capsys)
    assert "could not write --plots" in line and "No space left on device" in line, line
    Path(line.split("it was written to ")[1].split(" instead")[0]).unlink()
    assert sorted(p.name for p in out.iterdir()) == ["ranks.json"]  # no 0-byte PNG, no temp file


@needs_proc
def test_a_full_disk_at_eval_json_keeps_the_results(work, tmp_path, capsys, monkeypatch):
    """Before: the traceback came after the whole evaluation, and its results were lost."""
    out = tmp_path / "out"
    out.mkdir()
    _disk_full_under(out, monkeypatch)
    argv = ["eval", "--model", str(work / "dense"), "--data", str(work / "data" / "val.json"), "--no-progress",
            "--device", "cpu", "--timing-runs", "0", "--json", str(out / "report.json")]
    assert cli_main(argv) == 2
    line = _error_line(capsys)
    assert "could not write --json" in line and "No space left on device" in line
    kept = Path(line.split("it was written to ")[1].split(" instead")[0])
    try:
        assert len(json.loads(kept.read_text())["reports"][0]["samples"]) == 2
    finally:
        kept.unlink()
    assert list(out.iterdir()) == []


def test_a_safetensors_error_at_a_checkpoint_save_is_one_line(work, tmp_path, capsys, monkeypatch):
    """Before: SafetensorError's traceback, and a half-written step-N.tmp."""
    from accelerate import Accelerator
    from safetensors import SafetensorError

    real, calls = Accelerator.save_state, []

    def save_state(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        if len(calls) == 2:
            (Path(output_dir) / "model.safetensors").write_bytes(b"half")
            raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    config = _finetune_yaml(work, tmp_path / "run.yaml", tmp_path / "run")
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 2
    line = _error_line(capsys)
    assert "could not save checkpoint step-2" in line and "No space left on device" in line, line
    assert "--resume latest (checkpoint step-1 is kept)" in line
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1"]


def test_a_full_disk_at_converts_tokenizer_json_is_one_line(work, tmp_path, capsys, monkeypatch):
    from transformers import LlavaProcessor

    def full(self, folder, *args, **kwargs):
        (Path(folder) / "tokenizer.json").write_text("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(folder) / "tokenizer.json"))

    monkeypatch.setattr(LlavaProcessor, "save_pretrained", full)
    out = tmp_path / "mod"
    assert cli_main(["convert", "--model", str(work / "dense"), "--out", str(out), "--layers", "1,2"]) == 2
    assert "No space left on device" in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


# A recipe small enough to reach its convert stage in seconds.
SMALL_RECIPE = ["recipe", "--quick", "--no-progress", "--num-train", "8", "--num-val", "2", "--baseline-samples", "2",
                "--tower-steps", "0", "--dense-steps", "1"]


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_in_the_recipe_is_one_line(tmp_path, capsys, monkeypatch):
    """Before: the safetensors layout's raw OSError (the init stage's save) and, at the convert
    stage, a ConvertError, each a traceback. Now one line and exit status 2 for both, naming what to
    do, and no temp file or half-written model left in --out."""
    import vlmod.io.safetensors_layout
    import vlmod.tools.convert

    out = tmp_path / "run"
    monkeypatch.setattr(vlmod.io.safetensors_layout, "_copy_range", _full)  # the init stage's layout rewrite
    assert cli_main([*SMALL_RECIPE, "--out", str(out)]) == 2
    assert _error_line(capsys) == (f"error: could not write under --out {out}: No space left on device; nothing was "
                                   "left half-written: free space or choose another --out, then run again with "
                                   "--overwrite (its dense stage had not finished)")
    assert sorted(p.name for p in out.iterdir()) == [".vlmod-made.json", "data"]  # no init/, no init.tmp/
    monkeypatch.undo()
    monkeypatch.setattr(vlmod.tools.convert, "align_folder", _full)
    assert cli_main([*SMALL_RECIPE, "--out", str(out), "--overwrite"]) == 2
    assert _error_line(capsys) == (f"error: could not save the converted model to {out / 'converted'}: No space left "
                                   "on device (not created); free space or choose another --out")
    assert not any("tmp" in p.name for p in out.rglob("*")) and not (out / "converted").exists()
    assert (out / "dense" / "model" / "model.safetensors").is_file()  # the stages before it are whole


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_finetune_exits_130_and_the_run_resumes(work, tmp_path, capsys, monkeypatch):
    """Before: a traceback and exit status 1."""
    from transformers import LlavaForConditionalGeneration

    real, calls = LlavaForConditionalGeneration.forward, []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LlavaForConditionalGeneration, "forward", forward)
    config = _finetune_yaml(work, tmp_path / "run.yaml", tmp_path / "run")
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 130
    line = _error_line(capsys)
    assert "interrupted (Ctrl-C)" in line and "checkpoint step-1 is kept: continue with --resume latest" in line
    monkeypatch.undo()
    assert cli_main(["finetune", "--config", str(config), "--no-progress", "--resume", "latest"]) == 0
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_ctrl_c_in_convert_exits_130_and_leaves_nothing(work, tmp_path, capsys, monkeypatch):
    import vlmod.tools.convert as convert_module

    def interrupted(folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "align_folder", interrupted)
    out = tmp_path / "mod"
    assert cli_main(["convert", "--model", str(work / "dense"), "--out", str(out), "--layers", "1,2"]) == 130
    assert "interrupted (Ctrl-C)" in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- unreadable inputs, outputs


def test_unreadable_inputs_are_one_line_each(work, tmp_path, capsys):
    """Before: tracebacks (RecursionError, UnicodeDecodeError, transformers' OSError)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    model = str(work / "dense")
    assert cli_main(["eval", "--model", model, "--data", str(deep), "--no-progress", "--device", "cpu"]) == 2
    assert "nests its JSON lists or objects too deeply" in _error_line(capsys)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(f"model: {model}\noutput_dir: {tmp_path / 'o'}\n# caf\xe9\n".encode("latin-1"))
    assert cli_main(["finetune", "--config", str(latin)]) == 2
    assert "latin.yaml is not UTF-8 text" in _error_line(capsys)
    weightless = tmp_path / "weightless"
    shutil.copytree(work / "dense", weightless)
    (weightless / "model.safetensors").unlink()
    data = str(work / "data" / "val.json")
    assert cli_main(["eval", "--model", str(weightless), "--data", data, "--no-progress", "--device", "cpu"]) == 2
    assert "has no weights file (model.safetensors)" in _error_line(capsys)
    from vlmod.demo.model import load_model

    with pytest.raises(ValueError, match="has no weights file"):  # what `vlmod demo` reports as its one line
        load_model(weightless, None, device="cpu")


def test_a_symlink_loop_is_named_as_one(work, tmp_path, capsys, monkeypatch):
    """Before: a symlink loop given as an input "does not exist" (or, for --model, a hub id not in
    the cache), and as an output (--out, --json, --output-dir) it ended in pathlib's "Symlink loop"
    RuntimeError traceback; as `bench video --video`, an OSError traceback. Now one line that says
    it is a symlink loop, before any work."""
    import vlmod.io.hf

    monkeypatch.setattr(vlmod.io.hf, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    model, data = str(work / "dense"), str(work / "data" / "val.json")
    inputs = "is a symlink loop (a link that leads back to itself); point it at a real path"
    outputs = "is a symlink loop (a link that leads back to itself); remove it or choose another path"
    for argv, line in (
        (["eval", "--model", str(loop), "--data", data], f"--model {loop} {inputs}"),
        (["eval", "--model", model, "--data", str(loop)], f"data file {loop} {inputs}"),
        (["audit", "--model", model, "--data", str(loop)], f"--data {loop} {inputs}"),
        (["finetune", "--model", model, "--data", str(loop), "--output-dir", str(tmp_path / "o")],
         f"data file {loop} {inputs}"),
        (["finetune", "--config", str(loop)], f"config file {loop} {inputs}"),
        (["bench", "video", "--video", str(loop)], f"video path {loop} {inputs}"),
        (["eval", "--model", model, "--data", data, "--json", str(loop)], f"--json {loop} {outputs}"),
        (["convert", "--model", model, "--out", str(loop), "--capacity", "0.5"], f"--out {loop} {outputs}"),
        (["tiny", "--out", str(loop)], f"--out {loop} {outputs}"),
        (["data", "synthetic", "--out", str(loop)], f"--out {loop} {outputs}"),
        (["finetune", "--model", model, "--data", data, "--output-dir", str(loop)], f"output_dir {loop} {outputs}"),
    ):
        assert cli_main([*argv, "--no-progress"] if argv[0] in ("eval", "finetune") else argv) == 2, argv
        assert _error_line(capsys) == f"error: {line}", argv


def test_bench_ops_checks_its_json_before_the_benchmark(tmp_path, capsys, monkeypatch):
    """`bench ops --json DIR`, as every other bench subcommand's (test above): refused before the
    benchmark runs, by the rule every --json follows."""
    import vlmod.bench.ops

    monkeypatch.setattr(vlmod.bench.ops, "host_cost", lambda *a, **k: pytest.fail("the benchmark ran first"))
    assert cli_main(["bench", "ops", "--families", "llava", "--json", str(tmp_path)]) == 2
    assert _error_line(capsys) == f"error: --json {tmp_path} is a folder; give a file name (e.g. {tmp_path / 'report.json'})"


def test_a_long_question_is_refused_before_any_work(work, tmp_path, capsys, monkeypatch):
    """Before: a 1 MB question (about 200k tokens; the model has 2,048 positions) kept eval busy for
    minutes; rank and finetune ran it too."""
    import vlmod.evaluation.evaluate as ev

    monkeypatch.setattr(ev, "greedy_generate", lambda *a, **k: pytest.fail("generation started"))
    records = json.loads((work / "data" / "val.json").read_text())
    records[1]["conversations"][0]["value"] += " why" * 5000
    for record in records:
        record["image"] = str(work / "data" / record["image"])
    data = tmp_path / "long.json"
    data.write_text(json.dumps(records))
    argv = ["eval", "--model", str(work / "dense"), "--data", str(data), "--no-progress", "--device", "cpu"]
    assert cli_main(argv) == 2
    line = _error_line(capsys)
    assert f"record {records[1]['id']!r} is" in line and "more than the model's 2,048 positions" in line, line
    argv = ["rank", "--model", str(work / "dense"), "--data", str(data), "--no-progress", "--device", "cpu",
            "--json", str(tmp_path / "ranks.json")]
    assert cli_main(argv) == 2
    assert "more than the model's 2,048 positions" in _error_line(capsys)
    config = _finetune_yaml(work, tmp_path / "run.yaml", tmp_path / "run", data=str(data))
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 2
    assert "more than the model's 2,048 positions" in _error_line(capsys)
    assert not (tmp_path / "ranks.json").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_tiny_out_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    import vlmod.cli.tiny as tiny_cli

    def denied(model, processor, folder):
        Path(str(folder) + ".tmp").mkdir()
        shutil.rmtree(Path(str(folder) + ".tmp"))  # as the atomic saver does when it fails
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))

    monkeypatch.setattr(tiny_cli, "save_pretrained_atomic", denied)
    assert cli_main(["tiny", "--out", str(tmp_path / "m")]) == 2
    assert "could not write --out" in _error_line(capsys) and not (tmp_path / "m").exists()
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert cli_main(["tiny", "--out", str(locked / "m")]) == 2
        assert "not writable" in _error_line(capsys)
    Image.new("RGB", (2, 2)).save(tmp_path / "a-file.png")
    assert cli_main(["tiny", "--out", str(tmp_path / "a-file.png")]) == 2
    assert "is a file" in _error_line(capsys)
