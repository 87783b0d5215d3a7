"""Training in several processes on the CPU: two processes over gloo give the run of one process
with the same global batch; a launch accelerate does not make distributed as asked is one error
line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType
from helpers import ROOT
from safetensors.torch import load_file

from vlmod.models import tiny
from vlmod.training.launch import check_launch
from vlmod.training.loop import takes_loss_kwargs
from vlmod.training.train import TrainConfig, TrainError, train


def _config(root: Path) -> Path:
    """A full fine-tune of root's dense model on its train set, as a YAML file."""
    # Answers of one and two words ("top left"): each process's own token mean would weigh the
    # processes alike, not the tokens; the run divides by the global token count instead.
    records = json.loads((root / "data" / "train.json").read_text())
    assert {len(r["conversations"][1]["value"].split()) for r in records} == {1, 2}
    config = dict(
        model=str(root / "dense"), data=str(root / "data" / "train.json"), trainable="full", lr=1e-3,
        max_steps=2, log_steps=1, cache_data=True, seed=0,
        mod={"capacity": 0.5, "layers": [1, 2], "routable": ["image"]},
    )
    (root / "ft.yaml").write_text(json.dumps(config))  # JSON is YAML
    return root / "ft.yaml"


def _losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "train_log.json").read_text())["history"] if "loss" in h]


@pytest.mark.slow
def test_two_gloo_processes_train_what_one_process_trains(llava_workdir: Callable[..., Path], tmp_path: Path) -> None:
    """DDP over two CPU processes (gloo, 2 samples each) against one process (4 samples), MoD at
    capacity 0.5, full fine-tuning, AdamW, 2 steps: the same losses and final weights."""
    config = _config(llava_workdir("multi-process", train=24, val=6))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
        str(ROOT / "scripts" / "finetune.py"), "--config", str(config), "--output-dir", str(tmp_path / "two"),
        "--batch-size", "2", "--no-progress",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps of 4" in done.stdout
    cfg = TrainConfig.from_dict({**json.loads(config.read_text()), "output_dir": str(tmp_path / "one"), "batch_size": 4})
    train(cfg, progress=False)
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two) == len(one) == 2
    assert max(abs(a - b) for a, b in zip(two, one, strict=True)) <= 1e-5, (two, one)
    a = load_file(tmp_path / "two" / "model" / "model.safetensors")
    b = load_file(tmp_path / "one" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and any("mod_router" in k for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


def _accelerator(kind: DistributedType, processes: int) -> SimpleNamespace:
    return SimpleNamespace(distributed_type=kind, num_processes=processes)


def test_a_launch_accelerate_did_not_distribute_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun / accelerate launch of 2 processes with no GPU and no ACCELERATE_USE_CPU: each
    # process would train alone and write the same output folder.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainError, match="launched as 2 processes.*ACCELERATE_USE_CPU=true"):
        check_launch(_accelerator(DistributedType.NO, 1))
    # configs/accelerate/fsdp.yaml on CPU: accelerate 1.15 runs it as MULTI_CPU (DDP), not FSDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(TrainError, match="asks for FSDP.*MULTI_CPU.*not on CPU"):
        check_launch(_accelerator(DistributedType.MULTI_CPU, 2))
    check_launch(_accelerator(DistributedType.FSDP, 2))
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    check_launch(_accelerator(DistributedType.MULTI_CPU, 2))
    monkeypatch.delenv("WORLD_SIZE")
    check_launch(_accelerator(DistributedType.NO, 1))


def test_a_deepspeed_config_that_accelerate_ran_as_ddp_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 2` with
    ACCELERATE_USE_CPU=true (DeepSpeed 0.19.8 installed, its CPU accelerator on gloo) trained as plain
    DDP, saved unsharded checkpoints and said nothing: accelerate 1.15 drops the DeepSpeed config on
    a CPU. Now one line says so and how to launch it: without ACCELERATE_USE_CPU, vlmod runs DeepSpeed
    over gloo (tests/training/test_sharded.py)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(TrainError, match=r"asks for DeepSpeed, .* runs this launch as MULTI_CPU with 2 process\(es\), "
                                         r"without DeepSpeed .*without ACCELERATE_USE_CPU"):
        check_launch(_accelerator(DistributedType.MULTI_CPU, 2))
    check_launch(_accelerator(DistributedType.DEEPSPEED, 2))


def test_token_weighting_follows_what_each_model_declares() -> None:
    """The global token count goes to a model's loss only where transformers' Trainer would pass
    it: Qwen-VL models declare `accepts_loss_kwargs = False` and keep their own mean."""
    assert takes_loss_kwargs(tiny.build("llava")[0])
    assert not takes_loss_kwargs(tiny.build("qwen3_vl")[0])


@pytest.mark.parametrize("fails", [False, True])
def test_finetune_leaves_its_process_group(fails: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`vlmod finetune` in a launched process destroys its process group before it returns, when
    training fails too: left to the interpreter's exit, gloo's threads were once torn down
    mid-join on a loaded machine and the process aborted after saving."""
    import torch.distributed as dist

    from vlmod.cli import finetune as cli
    from vlmod.cli.common import EXIT_USAGE

    def launched_train(cfg: object, progress: bool) -> SimpleNamespace:  # the group a launch gives
        dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
        if fails:
            raise TrainError("no data")
        return SimpleNamespace(main_process=False)

    monkeypatch.setattr(cli, "train", launched_train)
    monkeypatch.setattr(cli, "config_from_args", lambda args: SimpleNamespace(output_dir=str(tmp_path)))
    assert cli.run_finetune(SimpleNamespace(plan=False, no_progress=True)) == (EXIT_USAGE if fails else 0)
    assert not dist.is_initialized()
