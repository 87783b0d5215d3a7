"""Past one process on this CPU: configs/accelerate/fsdp.yaml (FSDP2, two gloo processes started
as accelerate's launch would) and zero3.yaml (DeepSpeed ZeRO-3, `accelerate launch` itself, over
gloo) train what one process trains, their sharded checkpoints resume exactly, the gathered model
loads bit for bit, and LoRA trains on the shards and saves as adapters; the layer classes to wrap
come from the model.

Each engine's two-process runs share one process group (one launch of this file as a worker,
running every job in turn); the FSDP2 launch trains while the one-process runs it is compared
with train in pytest, the ZeRO-3 launch after it.
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
from vlmod.training.launch import check_lora_sharding
from vlmod.training.train import TrainConfig, train

MODES = ("router", "language", "full", "lora")
ENGINES = ("fsdp2", "zero3")
CONFIGS = ROOT / "configs" / "accelerate"


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
    """Run each job of `jobs_file` in this process group, recording after the first `prepare`
    which modules became FSDP units (if any) and which unit holds each router."""
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
            if "mod_router" in name and units:
                routers[name] = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        if run.accelerator.is_main_process:
            record = {"units": units, "routers": routers, "engine": run.accelerator.distributed_type.value,
                      "processes": run.accelerator.num_processes}
            (Path(cfg.output_dir).parent / f"units-{cfg.trainable}.json").write_text(json.dumps(record))
        return run

    train_module.prepare = recording
    for job in jobs:
        train(TrainConfig.from_dict(job), progress=False)
    torch.distributed.destroy_process_group()  # as `vlmod finetune` leaves it (vlmod.cli.finetune)


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "train_log.json").read_text())["history"] if "loss" in h]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(llava_workdir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per engine, two processes (2 samples each) of each trainable mode, 2 steps, the full run
    checkpointing after step 1 and a fifth job resuming there; one process (4 samples) of each."""
    root = llava_workdir("sharded", train=24)
    model = vlmod.load_pretrained(root / "dense")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="all"), part="vision")
    model.save_pretrained(root / "vision-mod")
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(root / "dense").save_pretrained(root / "vision-mod")
    runs = tmp_path_factory.mktemp("sharded-runs")
    for engine in ENGINES:
        (runs / engine).mkdir()
        jobs = [_job(root, m, runs / engine / f"two-{m}", batch_size=2, save_steps=1 if m == "full" else 0) for m in MODES]
        jobs.append(_job(root, "full", runs / engine / "resumed", batch_size=2,
                         resume=str(runs / engine / "two-full/checkpoints/step-1")))
        (runs / engine / "jobs.json").write_text(json.dumps(jobs))
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    worker = [__file__, "--worker"]
    fsdp = subprocess.Popen(  # as `accelerate launch` starts them, with the CPU's variables (launch_env)
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _port(),
         *worker, str(runs / "fsdp2" / "jobs.json")],
        env={**os.environ, **launch_env(CONFIGS / "fsdp.yaml"), "PYTHONPATH": path},
        stdout=open(runs / "fsdp2" / "two.log", "w"), stderr=subprocess.STDOUT,
    )
    zero3 = None
    try:
        for m in MODES:
            train(TrainConfig.from_dict(_job(root, m, runs / f"one-{m}", batch_size=4)), progress=False)
        assert fsdp.wait(timeout=600) == 0, (runs / "fsdp2" / "two.log").read_text()[-4000:]
        zero3 = subprocess.Popen(  # `accelerate launch` itself: no ACCELERATE_USE_CPU, vlmod names gloo
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "zero3.yaml"),
             "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", _port(),
             *worker, str(runs / "zero3" / "jobs.json")],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
            stdout=open(runs / "zero3" / "two.log", "w"), stderr=subprocess.STDOUT,
        )
        assert zero3.wait(timeout=600) == 0, (runs / "zero3" / "two.log").read_text()[-4000:]
    finally:
        for launch in (fsdp, zero3):
            if launch is not None:
                launch.kill()
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
    units = json.loads((runs / "fsdp2" / f"units-{mode}.json").read_text())
    assert units["engine"] == "FSDP" and units["processes"] == 2
    kinds = sorted(units["units"].values())
    assert kinds.count("FSDPMoDCLIPEncoderLayer") == 2 and kinds.count("FSDPMoDLlamaDecoderLayer") == 2
    assert kinds.count("FSDPLlamaDecoderLayer") == 2 and "" in units["units"]
    for name, unit in units["routers"].items():  # a layer's router in its layer's unit, a shared one in the root
        owner = name.rsplit(".mod_router", 1)[0]
        assert unit == (owner if ".layers." in owner else ""), (name, unit)
    assert any(".layers." in n for n in units["routers"]) == (mode == "language")
    _assert_same_run(runs / "fsdp2" / f"two-{mode}", runs / f"one-{mode}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_two_zero3_processes_train_what_one_process_trains(runs: Path, mode: str) -> None:
    """Before: zero3.yaml failed on every MoD model ("size mismatch ... vec (0)": a routed layer
    reads its shared router's weight without calling the router module, so DeepSpeed never gathered
    it), accelerate ran a CPU launch of it as one process or as plain DDP, and LoRA under ZeRO-3
    was refused. Now `accelerate launch --config_file zero3.yaml --num_processes 2` runs DeepSpeed
    over gloo here, and 2 steps of each trainable mode give the losses and weights of one process
    to 1e-5, LoRA merged from the gathered weights."""
    units = json.loads((runs / "zero3" / f"units-{mode}.json").read_text())
    assert units["engine"] == "DEEPSPEED" and units["processes"] == 2 and not units["units"]
    _assert_same_run(runs / "zero3" / f"two-{mode}", runs / f"one-{mode}")


def _assert_same_run(two: Path, one: Path) -> None:
    """Losses and saved weights of `two` equal to `one`'s to 1e-5; a LoRA run's adapter folder
    loads as its merged model, bit for bit."""
    a_losses, b_losses = _losses(two), _losses(one)
    assert len(a_losses) == len(b_losses) == 2
    assert max(abs(a - b) for a, b in zip(a_losses, b_losses, strict=True)) <= 1e-5, (a_losses, b_losses)
    a, b = _weights(two), _weights(one)
    assert a.keys() == b.keys() and sum("mod_router" in k for k in a) >= 3
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert (two / "adapter").is_dir() == (one / "adapter").is_dir() == ("lora" in two.name)
    if "lora" in two.name:
        for run in (two, one):
            adapter = run / "adapter"  # peft's LoRA matrices, and the routers and projector beside them
            lora, others = load_file(adapter / "adapter_model.safetensors"), load_file(adapter / "trained.safetensors")
            assert lora and all(".lora_A." in k or ".lora_B." in k for k in lora)
            assert {k.split(".")[-2] for k in others} == {"mod_router", "linear_1", "linear_2"}
            loaded, saved = vlmod.load_pretrained(adapter).state_dict(), vlmod.load_pretrained(run / "model").state_dict()
            assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_sharded_checkpoint_resumes_exactly_and_the_gathered_model_loads_bit_for_bit(
    runs: Path, engine: str, tmp_path: Path
) -> None:
    """Before: nothing had saved or resumed an FSDP or ZeRO-3 checkpoint. Now: the checkpoint
    after step 1 holds each process's shard (FSDP2: torch.distributed.checkpoint; ZeRO-3:
    DeepSpeed's per-rank files), a run resumed from it ends with the uninterrupted run's losses and
    weights exactly, and the model gathered into one `save_pretrained` directory loads with
    `vlmod.load_pretrained`, converted, bit for bit."""
    step = runs / engine / "two-full" / "checkpoints" / "step-1"
    if engine == "fsdp2":
        assert {p.name for p in (step / "pytorch_model_fsdp_0").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    else:
        ranks = {p.name.split("_rank_")[1].split("_")[0] for p in step.rglob("*_rank_*_model_states.pt")}
        assert ranks == {"0", "1"}, sorted(p.name for p in step.rglob("*"))
    assert _losses(runs / engine / "resumed") == _losses(runs / engine / "two-full")
    full, resumed = _weights(runs / engine / "two-full"), _weights(runs / engine / "resumed")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    model = vlmod.load_pretrained(runs / engine / "two-full" / "model")
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
    """Before: LoRA under any FSDP or ZeRO-3 was refused. Now: FSDP2 and ZeRO-3 train it (the
    equality tests above), and FSDP version 1, which vlmod does not gather from, is refused."""
    cfg = SimpleNamespace(trainable="lora")

    def accelerator(kind: DistributedType, fsdp2: bool = False, zero: int | None = None) -> SimpleNamespace:
        ds = None if zero is None else SimpleNamespace(zero_stage=zero)
        return SimpleNamespace(distributed_type=kind, is_fsdp2=fsdp2, state=SimpleNamespace(deepspeed_plugin=ds))

    check_lora_sharding(cfg, accelerator(DistributedType.FSDP, fsdp2=True))
    check_lora_sharding(cfg, accelerator(DistributedType.DEEPSPEED, zero=2))
    check_lora_sharding(cfg, accelerator(DistributedType.DEEPSPEED, zero=3))
    with pytest.raises(TrainError, match="FSDP version 1 shards.*fsdp.yaml \\(FSDP2\\), zero3.yaml"):
        check_lora_sharding(cfg, accelerator(DistributedType.FSDP))


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
