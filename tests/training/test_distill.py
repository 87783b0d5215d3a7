"""The teacher's vision tower: taken from the student's forward where both are the same frozen
tower (one tower pass a step instead of two), computed where not, and the run the same either way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers.models.clip import modeling_clip

import vlmod
from vlmod.training import train as train_module
from vlmod.training.distill import Teacher, same_frozen_tower
from vlmod.training.train import TrainConfig, train


@pytest.fixture(scope="module")
def workdir(llava_workdir: Callable[..., Path]) -> Path:
    return llava_workdir("distill", train=16)


def _cfg(workdir: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        model=str(workdir / "dense"), data=str(workdir / "data" / "train.json"), output_dir=str(out),
        batch_size=4, lr=1e-3, max_steps=3, log_steps=1, cache_data=True, trainable="language",
        mod={"capacity": 0.5, "layers": [1, 2], "routable": ["image"]}, distill_from=str(workdir / "dense"),
    )
    base.update(kw)
    return TrainConfig(**base)


def _run(cfg: TrainConfig, monkeypatch: pytest.MonkeyPatch, share: bool) -> tuple[list[float], dict, int]:
    """The run's losses, its saved weights and how many times a CLIP tower computed."""
    calls = []
    forward = modeling_clip.CLIPEncoder.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(modeling_clip.CLIPEncoder, "forward", counted)
        if not share:
            patch.setattr(train_module, "_sharing_tower", lambda run: contextlib.nullcontext())
        result = train(cfg, progress=False)
    weights = vlmod.load_pretrained(result.model_dir).state_dict()
    return [h["loss"] for h in result.history], weights, len(calls)


def test_a_frozen_tower_runs_once_a_step_and_the_run_is_the_same(workdir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    shared = _run(_cfg(workdir, tmp_path / "shared"), monkeypatch, share=True)
    apart = _run(_cfg(workdir, tmp_path / "apart"), monkeypatch, share=False)
    assert (shared[2], apart[2]) == (3, 6)  # one tower pass a step against two
    assert shared[0] == apart[0]  # the same losses to the bit
    assert shared[1].keys() == apart[1].keys()
    assert all(torch.equal(shared[1][k], apart[1][k]) for k in shared[1])


def test_a_tower_that_trains_is_not_shared(workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, calls = _run(_cfg(workdir, tmp_path / "run", train_vision_tower=True), monkeypatch, share=True)
    assert calls == 6


def test_same_frozen_tower_needs_equal_frozen_unrouted_weights(workdir: Path) -> None:
    dense = workdir / "dense"
    student, teacher = vlmod.load_pretrained(dense), vlmod.load_pretrained(dense)
    ours, theirs = student.model.vision_tower, teacher.model.vision_tower
    assert not same_frozen_tower(ours, theirs)  # the student's tower trains
    ours.requires_grad_(False)
    assert same_frozen_tower(ours, theirs)
    with torch.no_grad():
        next(ours.parameters()).add_(1e-3)
    assert not same_frozen_tower(ours, theirs)
    routed = vlmod.load_pretrained(dense)
    vlmod.apply_mod(routed, vlmod.MoDConfig(capacity=0.5, layers="all"), part="vision")
    assert not same_frozen_tower(routed.model.vision_tower.requires_grad_(False), theirs)


def test_sharing_ends_with_the_context(workdir: Path) -> None:
    student = vlmod.load_pretrained(workdir / "dense")
    student.model.vision_tower.requires_grad_(False)
    teacher = Teacher(vlmod.load_pretrained(workdir / "dense"))
    pixels = torch.rand(2, 3, 32, 32)
    with teacher.sharing_tower(student) as shared:
        assert shared
        out = student.model.vision_tower(pixels, output_hidden_states=True)
        taken = teacher.model.model.vision_tower(pixels, output_hidden_states=True)
        assert taken.last_hidden_state is out.last_hidden_state  # handed over, not computed
        again = teacher.model.model.vision_tower(pixels, output_hidden_states=True)
        assert again.last_hidden_state is not out.last_hidden_state  # once only
        other = teacher.model.model.vision_tower(pixels.clone(), output_hidden_states=True)
        assert torch.equal(other.last_hidden_state, out.last_hidden_state)
    assert "forward" not in student.model.vision_tower.__dict__
    assert "forward" not in teacher.model.model.vision_tower.__dict__
