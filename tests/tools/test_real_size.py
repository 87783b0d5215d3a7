"""Real-size checkpoints: every loader keeps the checkpoint's dtype (`--dtype` overrides), convert
and load_pretrained map the weights instead of copying them (peak memory measured in a
subprocess), vlmod's writers lay safetensors out aligned, a fine-tune that cannot fit refuses
before it starts, and the 7B shapes' configs and processors are the real ones."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.inputs import chat_prompt
from safetensors.torch import load_file, save_file

import vlmod
from vlmod.cli import main
from vlmod.data.synthetic import generate
from vlmod.io.hf import loading_kwargs
from vlmod.io.safetensors_layout import align_file, is_aligned
from vlmod.models import tiny


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def low(request, tmp_path_factory) -> tuple[torch.dtype, Path]:
    """A tiny LLaVA saved in bfloat16 / float16, and the synthetic shapes data beside it."""
    root = tmp_path_factory.mktemp(str(request.param).removeprefix("torch."))
    model, processor = tiny.build("llava", image_size=32, patch_size=8)
    model.to(request.param).save_pretrained(root / "dense")
    processor.save_pretrained(root / "dense")
    generate(root / "data", 8, 4, image_size=32)
    return request.param, root


def _convert(src: Path, out: Path, *extra: str) -> None:
    assert main(["convert", "--model", str(src), "--out", str(out), "--layers", "1,3", *extra]) == 0


def _dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_convert_and_every_loader_keep_the_checkpoint_dtype(low, tmp_path) -> None:
    from vlmod.demo.model import load_model as demo_load
    from vlmod.evaluation.evaluate import load_model as eval_load
    from vlmod.tools.calibrate import load_model as rank_load

    dtype, root = low
    _convert(root / "dense", tmp_path / "mod")
    assert json.loads((tmp_path / "mod" / "vlmod_report.json").read_text())["dtype"] == str(dtype)[6:]
    assert _dtypes(vlmod.load_pretrained(tmp_path / "mod")) == {dtype}
    assert _dtypes(eval_load(str(tmp_path / "mod"))[0]) == {dtype}
    assert _dtypes(rank_load(str(root / "dense"), torch.device("cpu"), "auto")[0]) == {dtype}
    assert _dtypes(demo_load(tmp_path / "mod", dense_path=root / "dense").model) == {dtype}
    # --dtype overrides, for convert and for the loaders
    _convert(root / "dense", tmp_path / "mod32", "--dtype", "float32")
    assert _dtypes(vlmod.load_pretrained(tmp_path / "mod32")) == {torch.float32}
    assert _dtypes(eval_load(str(tmp_path / "mod"), dtype="float32")[0]) == {torch.float32}


def test_the_lmms_eval_model_keeps_the_checkpoint_dtype(low, tmp_path) -> None:
    pytest.importorskip("lmms_eval", reason="the lmms extra is not installed")
    from vlmod.evaluation.lmms import VLMod

    dtype, root = low
    assert _dtypes(VLMod(str(root / "dense"), device="cpu").model) == {dtype}
    assert _dtypes(VLMod(str(root / "dense"), device="cpu", dtype="float32").model) == {torch.float32}


def test_router_finetune_keeps_frozen_weights_and_trains_float32(low, tmp_path, capsys) -> None:
    from vlmod.training.train import TrainConfig, train

    dtype, root = low
    seen: list[set[torch.dtype]] = []
    cfg = TrainConfig(
        model=str(root / "dense"), data=str(root / "data" / "train.json"), output_dir=str(tmp_path / "run"),
        trainable="router", batch_size=2, max_steps=2, log_steps=1, mod={"capacity": 0.5, "layers": [1, 3]},
    )
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append({p.dtype for p in m.parameters(recurse=False) if not p.requires_grad})
        if isinstance(m, torch.nn.Linear) and not any(p.requires_grad for p in m.parameters(recurse=False)) else None
    )
    try:
        result = train(cfg, progress=False)
    finally:
        hook.remove()
    assert set().union(*seen) == {dtype}  # the frozen projections ran in the checkpoint's dtype
    assert "frozen in " + str(dtype)[6:] in capsys.readouterr().out
    saved = vlmod.load_pretrained(result.model_dir)
    assert _dtypes(saved) == {dtype} and vlmod.mod_layers(saved)
    assert result.loss is not None and result.loss == result.loss  # finite, not NaN


def test_trainable_weights_are_float32_master_weights(low, tmp_path) -> None:
    from vlmod.training.setup import cast_trainable, load_model, set_trainable, weights_dtype
    from vlmod.training.train import TrainConfig

    dtype, root = low
    cfg = TrainConfig(model=str(root / "dense"), data="unused", output_dir=str(tmp_path), trainable="router",
                      mod={"capacity": 0.5, "layers": [1, 3]})
    assert weights_dtype(cfg) == dtype
    assert weights_dtype(TrainConfig(model=str(root / "dense"), data="x", output_dir="y", dtype="float32")) == torch.float32
    model, _ = load_model(cfg, weights_dtype(cfg))
    set_trainable(model, "router")
    assert cast_trainable(model, torch.float32) > 0
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {dtype}


def test_a_finetune_that_cannot_fit_refuses_in_one_line(low, tmp_path, monkeypatch, capsys) -> None:
    from vlmod.training import memory as train_memory

    _, root = low
    monkeypatch.setattr(train_memory, "available_bytes", lambda device: 1 << 20)
    rc = main(["finetune", "--model", str(root / "dense"), "--data", str(root / "data" / "train.json"),
               "--output-dir", str(tmp_path / "run"), "--trainable", "full", "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err
    assert "needs about" in errors[0] and "GiB free" in errors[0] and "trainable: router or lora" in errors[0]
    assert not (tmp_path / "run" / "model").exists()


def test_the_estimate_counts_master_weights_optimizer_and_checkpointing() -> None:
    from vlmod.training.memory import HEADROOM, HEADROOM_CPU, estimate, headroom

    model, _ = tiny.build("llava")
    model.requires_grad_(False)
    frozen = estimate(model, 100, longest=50, compute_dtype=torch.float32, gradient_checkpointing=False)
    assert frozen.trainable_state == 0 and frozen.frozen_weights == sum(p.numel() * 4 for p in model.parameters())
    model.model.language_model.requires_grad_(True)
    full = estimate(model, 100, longest=50, compute_dtype=torch.float32, gradient_checkpointing=False)
    lm = sum(p.numel() for p in model.model.language_model.parameters())
    assert full.trainable_state == 16 * lm
    saved = estimate(model, 100, longest=50, compute_dtype=torch.float32, gradient_checkpointing=True)
    assert saved.activations < full.activations
    # Headroom on a CPU: 0.5 GiB and 10% of everything (no foreach temporaries there: torch's AdamW runs them on
    # CUDA tensors only); on a GPU: those temporaries (8 bytes a trained parameter), a fixed margin
    # and 10% of the rest.
    rest = full.trainable_state + full.activations + full.process
    assert full.headroom == HEADROOM_CPU + (rest + full.frozen_weights) // 10
    assert full.total == full.frozen_weights + rest + full.headroom
    assert headroom(lm, rest, full.frozen_weights, "cuda") == 8 * lm + HEADROOM + rest // 10


def test_align_file_keeps_every_tensor_and_aligns_the_matrices(tmp_path) -> None:
    tensors = {
        "odd": torch.arange(3, dtype=torch.float32), "b.weight": torch.randn(16, 16).to(torch.bfloat16),
        "a.bias": torch.randn(5).to(torch.float16), "c.weight": torch.randn(64, 8),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    assert not is_aligned(path)
    assert align_file(path) and is_aligned(path) and not align_file(path)  # the second call writes nothing
    loaded = load_file(path)
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    assert (8 + size) % 64 == 0 and json.loads(raw[8:8 + size])["__metadata__"] == {"format": "pt"}


def test_converted_files_are_aligned_sharded_and_load_back_exactly(tmp_path) -> None:
    src = tiny.save("llava_next", tmp_path / "dense")
    _convert(src, tmp_path / "mod", "--max-shard-size", "200KB")
    files = sorted((tmp_path / "mod").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "mod" / "model.safetensors.index.json").is_file()
    assert all(is_aligned(f) for f in files)
    model = vlmod.load_pretrained(tmp_path / "mod")
    with torch.no_grad():
        model.model.language_model.mod_router.weight.normal_()
    from vlmod.io.files import save_pretrained_atomic

    processor = __import__("transformers").AutoProcessor.from_pretrained(tmp_path / "mod")
    save_pretrained_atomic(model, processor, tmp_path / "again")
    assert all(is_aligned(f) for f in (tmp_path / "again").glob("*.safetensors"))
    from PIL import Image

    text = chat_prompt(processor, "what color")
    inputs = processor(images=[Image.new("RGB", (40, 64), (200, 30, 30))], text=[text], return_tensors="pt")
    loaded = vlmod.load_pretrained(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    assert main(["convert", "--model", str(src), "--out", str(tmp_path / "bad"), "--max-shard-size", "lots"]) == 2


PROBE = textwrap.dedent("""
    import json, sys
    from vlmod.cli import main
    from vlmod.io.hf import load_vlm

    def status(key):  # kB lines of /proc/self/status; VmHWM is the peak RSS of this process image
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

    def run(model, out):
        if sys.argv[1] == "convert":
            assert main(["convert", "--model", model, "--out", out, "--layers", "1,3", "--overwrite"]) == 0
        else:  # load as the commands do (every weight read by the finiteness check)
            assert load_vlm(model, ValueError, "the probe loads")[0] is not None

    run(sys.argv[2], sys.argv[4])  # the same path on a tiny model first: every import and cache made
    open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here (the baseline)
    base = status("VmRSS")
    run(sys.argv[3], sys.argv[5])
    print(json.dumps({"growth": status("VmHWM") - base}))
""")


def _peak_growth(mode: str, warm: Path, model: Path, out: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(warm), str(model), str(out / "warm"), str(out / "real")],
        capture_output=True, text=True, timeout=600, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


@pytest.mark.slow
def test_convert_and_load_map_the_weights_instead_of_copying_them(tmp_path) -> None:
    """A ~210 MB bfloat16 checkpoint: convert holds at most 1.3x its bytes above the process's
    baseline (the same command run once on a tiny model), loading (every weight read) at most 1.1x."""
    model, processor = tiny.build("llava", width=1024, layers=8, heads=8, kv_heads=8, mlp_ratio=2.75,
                                  vision_width=256, vision_layers=2)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    processor.save_pretrained(tmp_path / "dense")
    del model
    size = sum(f.stat().st_size for f in (tmp_path / "dense").glob("*.safetensors"))
    assert size > 150e6
    warm = tiny.save("llava", tmp_path / "tiny")
    model, processor = tiny.build("llava")
    model.to(torch.bfloat16).save_pretrained(warm)
    convert_growth = _peak_growth("convert", warm, tmp_path / "dense", tmp_path / "converted")
    print(f"convert {convert_growth / size:.2f}x of {size / 1e6:.0f} MB")
    assert convert_growth <= 1.3 * size, f"convert grew {convert_growth / size:.2f}x the checkpoint"
    load_growth = _peak_growth("load", tmp_path / "converted" / "warm", tmp_path / "converted" / "real", tmp_path)
    print(f"load {load_growth / size:.2f}x")
    # plus 16 MB for what does not grow with the model: the processor, the finiteness check's temporaries
    assert load_growth <= 1.1 * size + 16e6, f"loading grew {load_growth / size:.2f}x the checkpoint"


def test_loaders_pass_a_gpu_device_as_device_map(monkeypatch) -> None:
    assert loading_kwargs("auto", "cuda:1") == {"dtype": "auto", "device_map": "cuda:1"}
    assert loading_kwargs("bfloat16", "cpu") == {"dtype": torch.bfloat16}
    seen = {}

    def fake_load_vlm(path, error, purpose, converted=True, **kwargs):
        seen.update(kwargs)
        raise error("stop here")

    import vlmod.io.hf
    from vlmod.evaluation.evaluate import EvalError, load_model

    monkeypatch.setattr(vlmod.io.hf, "load_vlm", fake_load_vlm)
    with pytest.raises(EvalError, match="stop here"):
        load_model("any", device="cuda", dtype="float16")
    assert seen == {"dtype": torch.float16, "device_map": "cuda"}


@pytest.mark.parametrize("shape", ["llava-1.5-7b", "llava-next-video-7b"])
def test_the_7b_shapes_have_the_real_config_and_processor(shape) -> None:
    import numpy as np
    from PIL import Image

    from vlmod.models.scale import config_and_processor

    config, processor = config_and_processor(shape)
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size, text.vocab_size) == (4096, 32, 11008, 32064)
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (336, 14)
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids("<image>") == config.image_token_index
    assert len(tok) == 32064
    prompt = chat_prompt(processor, "what color ?")
    batch = processor(images=[Image.fromarray(np.zeros((336, 336, 3), np.uint8))], text=[prompt], return_tensors="pt")
    n_image = int((batch["input_ids"] == config.image_token_index).sum())
    assert n_image == 576 if shape == "llava-1.5-7b" else n_image > 576  # anyres adds tiles
    if shape == "llava-next-video-7b":
        assert tok.convert_tokens_to_ids("<video>") == config.video_token_index == 32000


def test_a_stage_is_measured_in_its_own_process(tmp_path) -> None:
    from vlmod.recipes.scale_check import run_measured

    grab = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('held')"
    seconds, peak, rc, _ = run_measured([sys.executable, "-c", grab], tmp_path / "log")
    assert rc == 0 and seconds > 0 and (tmp_path / "log").read_text().strip() == "held"
    assert 300 * 2**20 <= peak < 300 * 2**20 + 200 * 2**20  # the child's own peak, not this process's


def test_a_stage_rerun_replaces_its_row_only(tmp_path) -> None:
    from vlmod.recipes.scale_check import StageResult, _write

    def row(stage: str, seconds: float) -> StageResult:
        return StageResult(stage, f"vlmod {stage}", seconds, 3 * 2**30, 2 * 2**30, 0, 2**30)

    _write(tmp_path, "llava-1.5-7b", 2, [row("convert", 10.0), row("eval", 20.0)])
    _write(tmp_path, "llava-1.5-7b", 2, [row("build", 5.0), row("convert", 11.0)])
    table = json.loads((tmp_path / "scale_check.json").read_text())["stages"]
    assert [(r["stage"], r["seconds"]) for r in table] == [("build", 5.0), ("convert", 11.0), ("eval", 20.0)]
    assert table[0]["ratio"] == 1.5 and table[0]["ratio_above_baseline"] == 1.0
    assert "| convert | 11 | 3.0 | 2.0 | 1.50 | 1.00 | ok |" in (tmp_path / "scale_check.md").read_text()
    assert main(["scale-check", "--workdir", str(tmp_path), "--stages", "convert,teleport"]) == 2


def test_scale_check_replaces_and_deletes_only_what_it_made(tmp_path, monkeypatch, capsys) -> None:
    """Before: a failed fine-tune stage deleted its whole folder, a user's file in `ft-router/`
    included, and the convert stage's --overwrite replaced a user's `converted/`. Now the run
    folder's marker lists what scale-check made; a run whose stages would write over anything
    else is refused before any stage starts, and a stage's folder is deleted only when made here."""
    import vlmod.recipes.scale_check as sc

    ran: list[list[str]] = []

    def stage(argv, log, env=None, while_running=None):  # every stage "runs": it writes its folder, then fails
        ran.append(argv)
        if "--output-dir" in argv:
            out = Path(argv[argv.index("--output-dir") + 1])
            out.mkdir(exist_ok=True)
            (out / "train_log.json").write_text("{}")
        log.write_text("")
        return 0.1, 2**20, 1, ""

    monkeypatch.setattr(sc, "run_measured", stage)
    root = tmp_path / "llava-1.5-7b-2"
    (root / "ft-router").mkdir(parents=True)
    (root / "ft-router" / "notes.txt").write_text("a user's notes")
    (root / "converted").mkdir()
    (root / "converted" / "config.json").write_text("a user's model")
    argv = ["scale-check", "--workdir", str(tmp_path), "--layers", "2", "--stages", "convert,finetune-router",
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --workdir: {root} holds converted, ft-router, which scale-check did not make and its "
                   "stages would replace or delete; move them away or choose another --workdir\n")
    assert not ran and sorted(p.name for p in root.iterdir()) == ["converted", "ft-router"]
    assert (root / "ft-router" / "notes.txt").read_text() == "a user's notes"
    assert (root / "converted" / "config.json").read_text() == "a user's model"
    # Moved away: the stages run; the folder a stage made is deleted once measured, the rest kept.
    for name in ("ft-router", "converted"):
        (root / name).rename(tmp_path / name)
    (root / "notes.txt").write_text("beside the run")
    assert main(argv) == 1  # the stages "failed"
    assert len(ran) == 3 and not (root / "ft-router").exists() and (root / "notes.txt").read_text() == "beside the run"
    assert main(argv) == 1  # a rerun owns what the first run made
    assert len(ran) == 6


def test_a_scale_check_workdir_that_is_a_file_or_read_only_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    """Issue 58 reported a pathlib traceback for both; `--workdir` is checked before anything is
    created (`vlmod.io.paths.check_output_dir`), so each is one line and no stage runs."""
    import os

    import vlmod.recipes.scale_check as sc

    monkeypatch.setattr(sc, "run_measured", lambda *a, **k: pytest.fail("a stage ran"))
    afile = tmp_path / "afile"
    afile.write_text("a user's file")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    real = os.access  # root writes anywhere: the folder reads as read-only to this check, as it would to a user
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked and mode & os.W_OK
                        else real(p, mode, **kw))
    for workdir, reason in ((afile, f"{afile} is a file, so {afile / 'llava-1.5-7b-2'} cannot be created"),
                            (locked, f"the folder {locked} is not writable")):
        assert main(["scale-check", "--workdir", str(workdir), "--layers", "2", "--no-progress"]) == 2
        assert capsys.readouterr().err == (f"error: --workdir {workdir / 'llava-1.5-7b-2'}: {reason}; choose another "
                                           "path\n")
    assert afile.read_text() == "a user's file" and list(locked.iterdir()) == []


def test_scale_check_refuses_an_empty_stage_list(tmp_path, monkeypatch, capsys) -> None:
    """Before: `--stages ,` ran no stage, still printed a table and "wrote .../scale_check.md", a
    file it had not written (exit 0). Now one line naming the stages, and nothing is created."""
    import vlmod.recipes.scale_check as sc

    monkeypatch.setattr(sc, "run_measured", lambda *a, **k: pytest.fail("a stage ran"))
    for stages in (",", " , ", ""):
        assert main(["scale-check", "--workdir", str(tmp_path / "sc"), "--layers", "2", "--stages", stages,
                     "--no-progress"]) == 2
        assert capsys.readouterr() == ("", f"error: --stages names no stage; give one or more of {', '.join(sc.STAGES)}\n")
    assert not (tmp_path / "sc").exists()
