"""Fine-tuning: what trains, that a step learns, resume, saving, config errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT

import vlmod
from vlmod.cli import main as cli_main
from vlmod.training.setup import load_model
from vlmod.training.train import (
    EpochSampler,
    TrainConfig,
    TrainError,
    latest_checkpoint,
    set_trainable,
    train,
)


@pytest.fixture(scope="module")
def workdir(llava_workdir: Callable[..., Path]) -> Path:
    return llava_workdir("train", train=24, val=6)


def _cfg(workdir: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        model=str(workdir / "dense"), data=str(workdir / "data" / "train.json"), output_dir=str(out),
        batch_size=4, lr=1e-3, max_steps=4, log_steps=1, cache_data=True,
        mod={"capacity": 0.5, "layers": [1, 2], "routable": ["image"]},
    )
    base.update(kw)
    return TrainConfig(**base)


def _trainable_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_trainable_modes(workdir: Path, tmp_path: Path) -> None:
    model, _ = load_model(_cfg(workdir, tmp_path))
    groups = set_trainable(model, "router")
    assert set(groups) == {"router"} and all("mod_router" in n for n in _trainable_names(model))
    groups = set_trainable(model, "language")
    assert set(groups) == {"router", "projector", "language"}
    assert not any("vision_tower" in n for n in _trainable_names(model))
    groups = set_trainable(model, "full", train_vision_tower=True)
    assert "vision" in groups
    assert len(_trainable_names(model)) == len(list(model.parameters()))


def test_one_step_lowers_the_loss_on_a_fixed_batch(workdir: Path, tmp_path: Path) -> None:
    cfg = _cfg(workdir, tmp_path)
    model, processor = load_model(cfg)
    ds = vlmod.data.LlavaDataset(cfg.data, processor)
    batch = ds.collate([ds[i] for i in range(4)])
    set_trainable(model, "language")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    before = model(**batch).loss
    before.backward()
    opt.step()
    with torch.no_grad():
        after = model(**batch).loss
    assert after < before


def test_train_saves_a_model_that_load_pretrained_reads(workdir: Path, tmp_path: Path) -> None:
    cfg = _cfg(workdir, tmp_path, trainable="router", lr=1e-2, aux_loss=None)
    result = train(cfg, progress=False)
    assert result.step == 4 and result.model_dir == tmp_path / "model"
    assert [h["step"] for h in result.history] == [1, 2, 3, 4]
    assert all(0.0 < h["skip_rate"] < 1.0 for h in result.history)
    loaded = vlmod.load_pretrained(result.model_dir)
    assert vlmod.mod_layers(loaded) == {("language", 1): 0.5, ("language", 2): 0.5}
    router = loaded.model.language_model.mod_router
    assert router.weight.abs().sum() > 0, "the router did not move from its zero init"
    dense = vlmod.load_pretrained(workdir / "dense")
    for name, p in dense.named_parameters():  # router-only: every other weight as it was
        torch.testing.assert_close(loaded.get_parameter(name), p, rtol=0, atol=0)
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["config"]["trainable"] == "router" and len(log["history"]) == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_continues_with_the_same_step_optimizer_and_data(workdir: Path, tmp_path: Path) -> None:
    # 24 samples in batches of 4: 6 steps an epoch, so the resumed run crosses into epoch 1.
    straight = train(_cfg(workdir, tmp_path / "a", max_steps=9, save_steps=3, seed=3), progress=False)
    checkpoint = tmp_path / "a" / "checkpoints" / "step-3"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert {k: state[k] for k in ("step", "epoch", "batch_in_epoch")} == {"step": 3, "epoch": 0, "batch_in_epoch": 3}
    assert state["run"]["seed"] == 3 and "output_dir" not in state["run"]  # the run it belongs to
    assert latest_checkpoint(tmp_path / "a").name == "step-6"
    # A second run that only has the step-3 checkpoint picks up from there.
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    checkpoint.rename(tmp_path / "b" / "checkpoints" / "step-3")
    resumed = train(_cfg(workdir, tmp_path / "b", max_steps=9, save_steps=3, seed=3, resume="latest"), progress=False)
    assert resumed.step == 9
    # The whole loss history, the steps before the resume too (saved with the checkpoint), as the
    # straight run logged it; only the resumed steps were timed.
    log = json.loads((tmp_path / "b" / "train_log.json").read_text())
    assert [h["step"] for h in resumed.history] == [h["step"] for h in log["history"]] == list(range(1, 10))
    assert [h["loss"] for h in log["history"]] == pytest.approx([h["loss"] for h in straight.history], rel=1e-5)
    assert log["history"][:3] == state["history"] and log["cost"]["steps_timed"] == 6
    a = vlmod.load_pretrained(straight.model_dir).state_dict()
    b = vlmod.load_pretrained(resumed.model_dir).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_train_log_records_each_step_time_and_the_tokens_trained(workdir: Path, tmp_path: Path) -> None:
    # One epoch exactly (24 samples, 6 steps of 4): every sample's tokens trained once.
    result = train(_cfg(workdir, tmp_path, max_steps=6, trainable="router"), progress=False)
    cost = json.loads((tmp_path / "train_log.json").read_text())["cost"]
    assert cost == result.cost and cost["steps_timed"] == len(cost["step_seconds"]) == 6
    assert all(t > 0 for t in cost["step_seconds"]) and cost["samples"] == 24
    _, processor = load_model(_cfg(workdir, tmp_path))
    ds = vlmod.data.LlavaDataset(str(workdir / "data" / "train.json"), processor)
    assert cost["tokens"] == sum(int(ds.collate([ds[i]])["attention_mask"].sum()) for i in range(len(ds)))
    assert cost["tokens_per_second"] == pytest.approx(cost["tokens"] / sum(cost["step_seconds"]), rel=1e-4)
    assert min(cost["step_seconds"]) <= cost["step_seconds_median"] <= max(cost["step_seconds"])


def test_epochs_count_partial_accumulation_steps(workdir: Path, tmp_path: Path) -> None:
    # 6 batches an epoch, accumulating 4: steps after batches 4 and 6, so 2 epochs are 4 steps.
    result = train(_cfg(workdir, tmp_path, max_steps=None, epochs=2, gradient_accumulation_steps=4,
                        trainable="router"), progress=False)
    assert result.step == 4


def test_yaml_values_are_typed_or_named_errors() -> None:
    cfg = TrainConfig.from_dict({"model": "m", "data": "d.json", "output_dir": "o", "lr": "2e-5", "max_steps": 10.0})
    assert cfg.lr == 2e-5 and cfg.max_steps == 10 and isinstance(cfg.max_steps, int)
    with pytest.raises(TrainError, match="mod must be"):
        TrainConfig.from_dict({"model": "m", "data": "d.json", "output_dir": "o", "mod": 0.5})
    with pytest.raises(TrainError, match="lr must be"):
        TrainConfig.from_dict({"model": "m", "data": "d.json", "output_dir": "o", "lr": "fast"})
    # A union: one keep, or a list of them paired with the capacities.
    paths = {"model": "m", "data": "d.json", "output_dir": "o"}
    assert TrainConfig.from_dict({**paths, "reduce_keep": "0.5"}).reduce_keep == 0.5
    assert TrainConfig.from_dict({**paths, "reduce_keep": [0.5, 0.25], "capacities": [0.4, 0.2]}).reduce_keep == [0.5, 0.25]
    with pytest.raises(TrainError, match=r"reduce_keep must be float \| list\[float\] or empty"):
        TrainConfig.from_dict({**paths, "reduce_keep": {"a": 1}})


def test_lora_is_merged_into_the_saved_model(workdir: Path, tmp_path: Path) -> None:
    result = train(_cfg(workdir, tmp_path, trainable="lora", lora_r=4, max_steps=2), progress=False)
    loaded = vlmod.load_pretrained(result.model_dir)
    assert not any("lora" in n for n in loaded.state_dict())
    dense = vlmod.load_pretrained(workdir / "dense")
    q = "model.language_model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(loaded.get_parameter(q), dense.get_parameter(q)), "LoRA update was not merged"
    v = "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(loaded.get_parameter(v), dense.get_parameter(v), rtol=0, atol=0)


def test_epoch_sampler_order_depends_on_seed_and_epoch_only() -> None:
    a, b = EpochSampler(20, seed=1), EpochSampler(20, seed=1)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b) and sorted(a) == list(range(20))
    b.set_epoch(3)
    assert list(a) != list(b)


def test_cli_finetune_with_yaml_and_overrides(workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(workdir / "dense"), "data": str(workdir / "data" / "train.json"),
        "val_data": str(workdir / "data" / "val.json"), "output_dir": str(tmp_path / "run"),
        "trainable": "full", "max_steps": 50, "batch_size": 4, "eval_steps": 1,
    }))
    assert cli_main(["finetune", "--config", str(config), "--max-steps", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1 steps" in out and "validation loss" in out
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nonsense": 1}, "unknown finetune setting"),
        ({"data": "missing.json"}, "does not exist"),
        ({"trainable": "everything"}, "trainable must be one of"),
        ({"mod": {"capacity": 1.5}}, "capacity"),
        ({"mod": {"layers": "arank:2"}}, "vlmod convert"),
        ({"resume": "latest"}, "no complete checkpoint"),
        # Before: kept the -(-1) = 1 oldest "too many", i.e. deleted every checkpoint right after saving it.
        ({"save_total_limit": -1, "save_steps": 1}, "save_total_limit is how many of the newest checkpoints to keep, "
                                                    ">= 1 (0 or empty: every one), got -1"),
    ],
)
def test_bad_settings_are_one_error_line(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, settings: dict, message: str
) -> None:
    run = {"model": str(workdir / "dense"), "data": str(workdir / "data" / "train.json"), "output_dir": str(tmp_path / "o")}
    run.update(settings)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(run))
    assert cli_main(["finetune", "--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_save_total_limit_keeps_the_newest_checkpoints_and_zero_keeps_every_one(workdir: Path, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from vlmod.training.checkpoints import save_checkpoint

    accelerator = SimpleNamespace(  # what save_checkpoint asks of Accelerate, one process
        is_main_process=True, wait_for_everyone=lambda: None,
        save_state=lambda folder: (Path(folder) / "model.safetensors").write_bytes(b"state"))
    for limit, kept in ((2, ["step-2", "step-3"]), (0, ["step-1", "step-2", "step-3"]), (None, ["step-1", "step-2", "step-3"])):
        cfg = _cfg(workdir, tmp_path / f"limit-{limit}", save_steps=1, save_total_limit=limit)
        for step in (1, 2, 3):
            save_checkpoint(accelerator, cfg, {"step": step})
        assert sorted(p.name for p in (tmp_path / f"limit-{limit}" / "checkpoints").iterdir()) == kept, limit
    with pytest.raises(TrainError, match="save_total_limit is how many"):  # as the config loads: nothing ran
        _cfg(workdir, tmp_path / "negative", save_steps=1, save_total_limit=-1)


def test_training_behind_a_pre_llm_reduction(workdir: Path, tmp_path: Path) -> None:
    """reduce_keep: each step's loss is the reduced model's (the MoD model stacked on the
    reduction, as the recipe evaluates it), and the language model and routers learn from it."""
    from vlmod.tools.reduction import PreLLMReduction
    from vlmod.training.setup import EpochSampler as Sampler

    cfg = _cfg(workdir, tmp_path / "run", max_steps=2, reduce_keep=0.5)
    model, processor = load_model(cfg)
    ds = vlmod.data.LlavaDataset(cfg.data, processor)
    first = list(Sampler(len(ds), cfg.seed))[: cfg.batch_size]  # the run's first batch
    batch = ds.collate([ds[i] for i in first])
    reducer = PreLLMReduction(model, 0.5, "mean")
    with torch.no_grad():
        expected = reducer(**batch).loss
        full = model(**batch).loss
    assert reducer.last_length < batch["input_ids"].shape[1]
    result = train(cfg, progress=False)
    assert result.history[0]["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert abs(float(expected) - float(full)) > 1e-4  # the reduction changes what the step sees
    # The LM head ran on the reduced sequences only.
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["cost"]["logit_rows"] < 2 * cfg.batch_size * batch["input_ids"].shape[1]
    trained = vlmod.load_pretrained(result.model_dir).state_dict()
    before = model.state_dict()
    changed = {k for k in trained if not torch.equal(trained[k], before[k])}
    assert any("mod_router" in k for k in changed) and any("layers.1.mlp" in k for k in changed)


def test_keeps_pair_with_capacities(workdir: Path, tmp_path: Path) -> None:
    """A list of keeps: each step runs the keep paired with its capacity draw (one compute point
    of MoD stacked on the reduction), and its loss is that reduced model's."""
    from vlmod.api import set_capacity
    from vlmod.tools.reduction import PreLLMReduction
    from vlmod.training.loop import step_capacities, step_keep
    from vlmod.training.setup import EpochSampler as Sampler

    keeps, capacities = [0.25, 0.75, 1.0], [0.3, 0.6, 0.9]
    cfg = _cfg(workdir, tmp_path / "run", max_steps=1, reduce_keep=keeps, capacities=capacities)
    drawn = [(step_keep(cfg, step), step_capacities(cfg, {"language": 0.5}, step, 10)["language"]) for step in range(40)]
    assert {(k, c) for k, c in drawn} == set(zip(keeps, capacities, strict=True))  # paired, and every pair drawn
    # One keep runs every step; no reduction, no keep.
    assert step_keep(_cfg(workdir, tmp_path / "one", reduce_keep=0.4), 7) == 0.4
    assert step_keep(_cfg(workdir, tmp_path / "none"), 7) is None
    model, processor = load_model(cfg)
    ds = vlmod.data.LlavaDataset(cfg.data, processor)
    batch = ds.collate([ds[i] for i in list(Sampler(len(ds), cfg.seed))[: cfg.batch_size]])
    keep, capacity = drawn[0]
    set_capacity(model, capacity)
    with torch.no_grad():
        expected = PreLLMReduction(model, keep, "mean")(**batch).loss
    assert train(cfg, progress=False).history[0]["loss"] == pytest.approx(float(expected), rel=1e-5)
    # Behind pooling: each step's loss is the pooled reduction's.
    pooled = _cfg(workdir, tmp_path / "pooled", max_steps=1, reduce_keep=0.25, reduce_pool=2, reduce_scoring="deviation")
    set_capacity(model, 0.5)
    with torch.no_grad():
        expected = PreLLMReduction(model, 0.25, "deviation", pool=2)(**batch).loss
        plain = PreLLMReduction(model, 0.25, "deviation")(**batch).loss
    assert abs(float(expected) - float(plain)) > 1e-4
    assert train(pooled, progress=False).history[0]["loss"] == pytest.approx(float(expected), rel=1e-5)
    # Behind merging: the merged reduction's.
    merged = _cfg(workdir, tmp_path / "merged", max_steps=1, reduce_keep=0.25, reduce_merge=True,
                  reduce_scoring="deviation")
    with torch.no_grad():
        expected = PreLLMReduction(model, 0.25, "deviation", merge=True)(**batch).loss
    assert abs(float(expected) - float(plain)) > 1e-4
    assert train(merged, progress=False).history[0]["loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"reduce_keep": 1.5}, "reduce_keep is the fraction of vision tokens kept"),
        ({"reduce_keep": [0.5, 0.0], "capacities": [0.5, 0.5]}, "reduce_keep is the fraction of vision tokens kept"),
        ({"reduce_keep": [0.5, 0.4], "capacities": [0.5]}, "pairs each with a capacity"),
        ({"reduce_keep": [0.5, 0.4]}, "pairs each with a capacity"),
        ({"reduce_keep": 0.5, "reduce_scoring": "max"}, "reduce_scoring must be one of"),
        ({"reduce_keep": 0.5, "reduce_contextual": 1.0}, "reduce_contextual is the share of the kept slots"),
        ({"reduce_scoring": "cls"}, "reduce_keep is not"),
        ({"reduce_keep": 0.2, "reduce_pool": 0}, "reduce_pool is the side of the square"),
        ({"reduce_keep": 0.5, "reduce_pool": 2}, r"pooling 2 x 2 leaves 1/4 of the vision tokens; give keeps <= 0.25"),
        ({"reduce_keep": 0.2, "reduce_pool": 2, "reduce_contextual": 0.1}, "two ways of merging"),
        ({"reduce_keep": 0.2, "reduce_pool": 2, "reduce_merge": True}, "each a way of merging the tokens"),
        ({"reduce_keep": 0.2, "reduce_merge": "yes"}, "reduce_merge is true or false"),
        ({"reduce_keep": 0.2, "reduce_scoring": "query"}, "give reduce_scorer \\(its folder\\) with it"),
        ({"reduce_keep": 0.2, "reduce_scorer": "keep"}, "give reduce_scorer \\(its folder\\) with it, and only with it"),
    ],
)
def test_reduction_settings_are_checked(workdir: Path, tmp_path: Path, settings: dict, message: str) -> None:
    with pytest.raises(TrainError, match=message):
        _cfg(workdir, tmp_path, **settings)


def test_router_mode_needs_routers_and_a_llava_model(workdir: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="no MoD routers"):
        load_model(_cfg(workdir, tmp_path, mod=None, trainable="router"))
    from transformers import CLIPVisionConfig, CLIPVisionModel

    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, image_size=32, patch_size=8)).save_pretrained(tmp_path / "clip")
    with pytest.raises(TrainError, match="supports vision-language models"):
        load_model(_cfg(workdir, tmp_path, model=str(tmp_path / "clip")))


def test_two_process_data_parallel_run_is_the_standard_accelerate_path(workdir: Path, tmp_path: Path) -> None:
    """DDP over two CPU processes (gloo), launched by torchrun as on a multi-GPU machine."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ROOT / "scripts" / "finetune.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), str(script),
        "--model", str(workdir / "dense"), "--data", str(workdir / "data" / "train.json"),
        "--output-dir", str(tmp_path / "ddp"), "--trainable", "full", "--max-steps", "2", "--batch-size", "4",
        "--save-steps", "1", "--no-progress",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps of 8" in done.stdout, "two processes of 4 samples each make a global batch of 8"
    assert done.stdout.count("model saved to") == 1
    checkpoint = tmp_path / "ddp" / "checkpoints" / "step-1"
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    assert vlmod.mod_layers(vlmod.load_pretrained(tmp_path / "ddp" / "model")) == {}


def test_gradient_checkpointing_and_a_capacity_schedule_train(workdir: Path, tmp_path: Path) -> None:
    mod = {"capacity": 0.5, "layers": [1, 2, 3], "routable": ["image"], "capacity_schedule": "cosine", "aux_loss": "bce"}
    result = train(_cfg(workdir, tmp_path, mod=mod, gradient_checkpointing=True, max_steps=2), progress=False)
    loaded = vlmod.load_pretrained(result.model_dir)
    capacities = vlmod.mod_layers(loaded)
    assert sorted(capacities) == [("language", 1), ("language", 2), ("language", 3)]
    assert capacities[("language", 1)] > capacities[("language", 3)]
    assert loaded.config.vlmod["language"]["aux_loss"] == "bce"


def test_the_attention_aux_loss_trains_the_router(workdir: Path, tmp_path: Path) -> None:
    """aux_loss "attention" in `mod:` reaches the layers, is saved with the model, and moves the
    router otherwise than its gate alone does."""
    mod = {"capacity": 0.5, "layers": [1, 2], "routable": ["image"]}
    runs = {}
    for aux in (None, "attention"):
        kw = {"aux_loss": aux, "aux_loss_weight": 1.0} if aux else {}
        out = train(_cfg(workdir, tmp_path / str(aux), mod={**mod, **kw}, trainable="router", lr=1e-2, max_steps=2),
                    progress=False)
        runs[aux] = vlmod.load_pretrained(out.model_dir)
    assert runs["attention"].config.vlmod["language"]["aux_loss"] == "attention"
    gate_only, taught = (runs[k].model.language_model.mod_router.weight for k in (None, "attention"))
    assert not torch.allclose(gate_only, taught)


def _float16_copy(workdir: Path, out: Path) -> Path:
    """The tiny dense model saved in float16, as llava-hf's checkpoints are."""
    from transformers import AutoProcessor

    vlmod.load_pretrained(workdir / "dense").to(torch.float16).save_pretrained(out)
    AutoProcessor.from_pretrained(workdir / "dense").save_pretrained(out)
    return out


def test_a_float16_checkpoint_trains_under_bf16_and_float16_weights_are_refused(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before: both ended in a traceback, "Unexpected floating ScalarType in at::autocast::prioritize"
    (bfloat16 autocast meets the float16 weights). Now the float16 checkpoint loads in bfloat16, and
    an explicit float16 is one line before the model loads."""
    model = _float16_copy(workdir, tmp_path / "dense16")
    run = ["finetune", "--model", str(model), "--data", str(workdir / "data" / "train.json"), "--mixed-precision",
           "bf16", "--max-steps", "1", "--batch-size", "4", "--no-progress"]
    assert cli_main([*run, "--output-dir", str(tmp_path / "auto")]) == 0
    assert "weights: frozen in bfloat16" in capsys.readouterr().out
    assert (tmp_path / "auto" / "model" / "model.safetensors").is_file()
    assert cli_main([*run, "--output-dir", str(tmp_path / "f16"), "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: dtype float16 with mixed_precision bf16: the forward runs under bfloat16 autocast, which "
                   "cannot run float16 weights on cpu; set dtype to bfloat16 or float32, or mixed_precision to no "
                   "(--dtype / --mixed-precision)\n")
    assert not (tmp_path / "f16" / "model").exists()
