"""FSDP2 on this CPU: configs/accelerate/fsdp.yaml run by two processes over gloo trains what one
process trains, its sharded checkpoints resume exactly, and the gathered model loads bit for bit;
the layer classes to wrap come from the model.

The two-process runs share one process group (one torchrun of this file as a worker, running
every job in turn), started while the one-process runs they are compared with train in pytest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from helpers import ROOT
from safetensors.torch import load_file

import vlmod
from vlmod.errors import TrainError
from vlmod.models import tiny
from vlmod.training import memory
from vlmod.training.checkpoints import save_model
from vlmod.training.fsdp import layer_classes, set_layer_classes, shard_on_cpu
from vlmod.training.setup import check_lora_sharding
from vlmod.training.train import TrainConfig, train

MODES = ("router", "language", "full", "lora")


def launch_env(config_file: Path) -> dict[str, str]:
    """The variables `accelerate launch --config_file config_file --num_processes 2` gives each
    process (accelerate's own parsing of the YAML), plus the CPU: gloo, one thread a process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(config_file), "--num_processes", "2", "--mixed_precision", "no", "x.py"]
    )
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    keep = {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    return {**keep, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}


def _job(root: Path, mode: str, out: Path, **kw: Any) -> dict[str, Any]:
    """A fine-tune of root's vision-converted model: `mod:` converts language layers 1-2 (router:
    one shared router, in the root unit; language: one router per layer, in the layer's unit). No
    LoRA dropout: its draws differ between one process and two."""
    mod = {"capacity": 0.5, "layers": [1, 2], "routable": ["image"], "share_router": mode != "language"}
    return dict(
        model=str(root / "vision-mod"), data=str(root / "data" / "train.json"), trainable=mode, lr=1e-3,
        max_steps=2, log_steps=1, cache_data=True, seed=0, mod=mod, output_dir=str(out), lora_dropout=0.0, **kw,
    )


def _worker(jobs_file: str) -> None:
    """Run each job of `jobs_file` in this process group (torchrun), recording after the first
    `prepare` which modules became FSDP units and which unit holds each router."""
    from torch.distributed.fsdp import FSDPModule

    import vlmod.training.train as train_module

    torch.set_num_threads(1)
    jobs = json.loads(Path(jobs_file).read_text())
    prepare = train_module.prepare

    def recording(cfg: TrainConfig) -> Any:
        run = prepare(cfg)
        units = {n: type(m).__name__ for n, m in run.model.named_modules() if isinstance(m, FSDPModule)}
        routers = {}
        for name, _ in run.model.named_parameters():
            if "mod_router" in name:
                routers[name] = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        if run.accelerator.is_main_process:
            (Path(cfg.output_dir).parent / f"units-{cfg.trainable}.json").write_text(
                json.dumps({"units": units, "routers": routers})
            )
        return run

    train_module.prepare = recording
    for job in jobs:
        train(TrainConfig.from_dict(job), progress=False)


def _losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "train_log.json").read_text())["history"] if "loss" in h]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(llava_workdir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two processes (FSDP2, 2 samples each) and one process (4 samples) of each trainable mode,
    2 steps; the two-process full run checkpoints after step 1 and a fourth job resumes there."""
    root = llava_workdir("fsdp", train=24)
    model = vlmod.load_pretrained(root / "dense")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="all"), part="vision")
    model.save_pretrained(root / "vision-mod")
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(root / "dense").save_pretrained(root / "vision-mod")
    runs = tmp_path_factory.mktemp("fsdp-runs")
    jobs = [_job(root, m, runs / f"two-{m}", batch_size=2, save_steps=1 if m == "full" else 0) for m in MODES]
    jobs.append(_job(root, "full", runs / "resumed", batch_size=2, resume=str(runs / "two-full/checkpoints/step-1")))
    (runs / "jobs.json").write_text(json.dumps(jobs))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **launch_env(ROOT / "configs" / "accelerate" / "fsdp.yaml"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           __file__, "--worker", str(runs / "jobs.json")]
    with open(runs / "two.log", "w") as log:
        two = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            for m in MODES:
                train(TrainConfig.from_dict(_job(root, m, runs / f"one-{m}", batch_size=4)), progress=False)
            assert two.wait(timeout=600) == 0, (runs / "two.log").read_text()[-4000:]
        finally:
            two.kill()
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_two_fsdp2_processes_train_what_one_process_trains(runs: Path, mode: str) -> None:
    """Before: fsdp.yaml on a CPU was refused (accelerate runs it as DDP), so the sharded path had
    never run. Now: two gloo processes shard the model as Accelerate's FSDP2 preparation does (one
    unit per decoder and vision layer, MoD subclasses included, a shared router in the root unit),
    and 2 steps of each trainable mode give the losses and weights of one process to 1e-5. LoRA:
    before, refused under FSDP; now the adapters train on sharded weights and the saved model
    is merged from the gathered ones."""
    units = json.loads((runs / f"units-{mode}.json").read_text())
    kinds = sorted(units["units"].values())
    assert kinds.count("FSDPMoDCLIPEncoderLayer") == 2 and kinds.count("FSDPMoDLlamaDecoderLayer") == 2
    assert kinds.count("FSDPLlamaDecoderLayer") == 2 and "" in units["units"]
    for name, unit in units["routers"].items():  # a layer's router in its layer's unit, a shared one in the root
        owner = name.rsplit(".mod_router", 1)[0]
        assert unit == (owner if ".layers." in owner else ""), (name, unit)
    assert any(".layers." in n for n in units["routers"]) == (mode == "language")
    two, one = _losses(runs / f"two-{mode}"), _losses(runs / f"one-{mode}")
    assert len(two) == len(one) == 2 and max(abs(a - b) for a, b in zip(two, one, strict=True)) <= 1e-5, (two, one)
    a, b = _weights(runs / f"two-{mode}"), _weights(runs / f"one-{mode}")
    assert a.keys() == b.keys() and sum("mod_router" in k for k in a) >= 3
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_exactly_and_the_gathered_model_loads_bit_for_bit(runs: Path, tmp_path: Path) -> None:
    """Before: nothing had saved or resumed an FSDP checkpoint. Now: the checkpoint after step 1
    holds each process's shard (torch.distributed.checkpoint), a run resumed from it ends with the
    uninterrupted run's losses and weights exactly, and the model gathered into one
    `save_pretrained` directory loads with `vlmod.load_pretrained`, converted, bit for bit."""
    shards = runs / "two-full" / "checkpoints" / "step-1" / "pytorch_model_fsdp_0"
    assert {p.name for p in shards.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert _losses(runs / "resumed") == _losses(runs / "two-full")
    full, resumed = _weights(runs / "two-full"), _weights(runs / "resumed")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    model = vlmod.load_pretrained(runs / "two-full" / "model")
    assert {p for p, _ in vlmod.mod_layers(model)} == {"language", "vision"}
    model.save_pretrained(tmp_path / "again")  # the file's key names, from the loaded weights
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)


def _converted() -> torch.nn.Module:
    model, _ = tiny.build("llava")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="all"), part="vision")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1, 2, 3]), part="language")
    return model


def _accelerator(names: list[str] | None) -> SimpleNamespace:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=names
    )
    return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), distributed_type=DistributedType.FSDP)


def test_the_layer_classes_to_wrap_come_from_the_model() -> None:
    """Before: fsdp.yaml named LlamaDecoderLayer,CLIPEncoderLayer, and Accelerate finds a class by
    its exact name: a model whose vision layers are all converted has no CLIPEncoderLayer left
    ("Could not find the transformer layer class"). Now: the model's own `_no_split_modules` it
    holds and their MoD subclasses, every decoder and vision layer matched."""
    model = _converted()
    with pytest.raises(ValueError, match="Could not find the transformer layer class CLIPEncoderLayer"):
        _accelerator(["LlamaDecoderLayer", "CLIPEncoderLayer"]).state.fsdp_plugin.set_auto_wrap_policy(model)
    accelerator = _accelerator(None)
    ours = set_layer_classes(accelerator, model)
    assert set(ours) == {"CLIPVisionEmbeddings", "MoDCLIPEncoderLayer", "LlamaDecoderLayer", "MoDLlamaDecoderLayer"}
    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    layers = [*model.model.vision_tower.encoder.layers, *model.model.language_model.layers]
    assert all(policy(layer) for layer in layers) and not policy(model.model.multi_modal_projector)
    # a config naming upstream classes the model still holds (dense layer 0) gets their subclasses too
    assert set(layer_classes(model, ["LlamaDecoderLayer"])) == {"LlamaDecoderLayer", "MoDLlamaDecoderLayer"}


def test_a_config_naming_a_class_the_model_lacks_is_one_line() -> None:
    """Before: Accelerate's ValueError from deep inside `prepare`, naming only the missing class.
    Now: one TrainError line that names the classes this model has."""
    with pytest.raises(TrainError) as e:
        set_layer_classes(_accelerator(["Qwen2DecoderLayer", "MoDLlamaDecoderLayer"]), _converted())
    message = str(e.value)
    assert "\n" not in message and "wraps Qwen2DecoderLayer, which this LlavaForConditionalGeneration" in message
    assert "MoDLlamaDecoderLayer" in message.split("its layer classes are")[1]


def test_a_sharded_run_saves_in_the_checkpoints_dtype(tmp_path: Path) -> None:
    """Before: one process casts its trained float32 master weights back to the checkpoint's dtype
    before saving, but a sharded run cannot reach its shards, so its bfloat16 model was saved with
    float32 trained weights beside bfloat16 frozen ones. Now the gathered state dict is cast."""
    model, processor = tiny.build("llava")
    model.to(torch.bfloat16)
    gathered = {k: v.float() for k, v in model.state_dict().items()}  # what FSDP2 gathers of float32 shards
    accelerator = SimpleNamespace(
        get_state_dict=lambda m: dict(gathered), is_main_process=True, unwrap_model=lambda m: m,
        wait_for_everyone=lambda: None, is_fsdp2=True,
    )
    save_model(accelerator, model, processor, tmp_path / "model", dtype=torch.bfloat16)
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    save_model(accelerator, model, processor, tmp_path / "old")  # no cast: what it did before
    assert torch.float32 in {v.dtype for v in load_file(tmp_path / "old" / "model.safetensors").values()}


def test_lora_is_refused_only_where_the_adapters_cannot_be_merged() -> None:
    """Before: LoRA under any FSDP (or ZeRO-3) was refused. Now: FSDP2 trains it (the equality
    test above), and FSDP version 1 and ZeRO-3, which `vlmod` cannot merge from, are refused."""
    cfg = SimpleNamespace(trainable="lora")

    def accelerator(kind: DistributedType, fsdp2: bool = False, zero: int | None = None) -> SimpleNamespace:
        ds = None if zero is None else SimpleNamespace(zero_stage=zero)
        return SimpleNamespace(distributed_type=kind, is_fsdp2=fsdp2, state=SimpleNamespace(deepspeed_plugin=ds))

    check_lora_sharding(cfg, accelerator(DistributedType.FSDP, fsdp2=True))
    check_lora_sharding(cfg, accelerator(DistributedType.DEEPSPEED, zero=2))
    for refused in (accelerator(DistributedType.FSDP), accelerator(DistributedType.DEEPSPEED, zero=3)):
        with pytest.raises(TrainError, match="FSDP version 1 or DeepSpeed ZeRO-3.*fsdp.yaml"):
            check_lora_sharding(cfg, refused)


def test_fsdp_version_1_on_a_cpu_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: any FSDP launch on a CPU was refused as GPU-only. Now FSDP2 runs there, and a CPU
    launch asking for FSDP1 (which only FSDP2's fully_shard replaces over gloo) is refused before
    the model loads, naming FSDP_VERSION=2; a launch that asks for no FSDP is left alone."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    cpu = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))
    with pytest.raises(TrainError, match="FSDP version 1 on a CPU: only FSDP2 .*FSDP_VERSION=2"):
        shard_on_cpu(cpu)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert not shard_on_cpu(cpu)


def test_the_memory_plan_says_what_a_7b_full_fine_tune_needs_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the refusal said what one process needs, nothing about more GPUs. Now: the plan
    of the same estimate per GPU on 1-8 GPUs (a 7B full fine-tune's terms: 6.7B float32 trained
    parameters, a 0.75 GiB layer): DDP holds it all on every GPU, FSDP2 / ZeRO-3 split the
    weights and optimizer state, offload leaves activations and gathered layers; the refusal
    line carries it."""
    gib = memory.GIB
    trained, acts = 6_700_000_000, int(4.4 * gib)
    headroom = 8 * trained + memory.HEADROOM + (16 * trained + acts) // 10  # as `memory.estimate` counts it on a GPU
    needed = memory.MemoryEstimate(int(0.6 * gib), 16 * trained, acts, 0, headroom)
    table = memory.plan(needed, int(0.75 * gib))
    assert table["DDP"][1] == table["FSDP2"][1] == needed.total and table["DDP"][8] > table["DDP"][1]  # + buckets
    assert table["FSDP2"] == table["ZeRO-3"] and 25 * gib < table["FSDP2"][8] < 35 * gib < 150 * gib < table["DDP"][1]
    assert all(table["FSDP2"][a] > table["FSDP2"][b] for a, b in ((1, 2), (2, 4), (4, 8)))
    assert table["FSDP2 offload"][8] < 10 * gib
    monkeypatch.setattr(memory, "available_bytes", lambda device: 16 * gib)
    with pytest.raises(TrainError) as e:
        memory.check_fits(needed, torch.device("cpu"), TrainError, memory.describe_plan(table))
    assert "\n" not in str(e.value)
    assert str(e.value).endswith("; per GPU on 1/2/4/8 GPUs: DDP 167/192/192/192, FSDP2 167/89/49/29, ZeRO-3 "
                                 "167/89/49/29, FSDP2 offload 8.6/8.6/8.6/8.6, ZeRO-3 offload 8.6/8.6/8.6/8.6 GiB")


def test_finetune_plan_prints_the_table_and_trains_nothing(
    llava_workdir: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: no way to know before launching how many GPUs a run needs. Now `vlmod finetune
    --plan` prints the table for the run the flags describe, and writes no output folder."""
    from vlmod.cli import main

    root = llava_workdir("fsdp-plan", train=4)
    code = main(["finetune", "--model", str(root / "dense"), "--data", str(root / "data" / "train.json"),
                 "--output-dir", str(tmp_path / "out"), "--trainable", "full", "--plan"])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "out").exists()
    assert out.startswith("one process: ") and "1 GPU       2 GPUs" in out
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["DDP", "FSDP2", "ZeRO-3", "FSDP2", "ZeRO-3"]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])
