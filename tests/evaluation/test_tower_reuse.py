"""An evaluation batch runs the vision tower once: the teacher-forced pass and the generation's
prefill see the same media, and the report is the one two passes give."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import save_converted

import vlmod
from vlmod.evaluation.evaluate import evaluate
from vlmod.evaluation.tower_reuse import reusing_tower
from vlmod.io.hf import vision_tower
from vlmod.models import tiny


@pytest.fixture(scope="module")
def workdir(llava_workdir: Callable[..., Path]) -> Path:
    root = llava_workdir("tower-reuse", val=10)
    save_converted(root / "dense", root / "mod", vlmod.MoDConfig(capacity=0.5, layers=[1, 2], routable=("image",)))
    return root


def _counting(monkeypatch: pytest.MonkeyPatch, tower: torch.nn.Module) -> list[int]:
    """Counts the tower class's forward calls (a hook would switch the reuse off)."""
    calls = [0]
    forward = type(tower).forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(tower), "forward", counted)
    return calls


@pytest.mark.parametrize("run", ["dense", "mod"])
def test_one_tower_pass_a_batch_and_the_same_report(workdir: Path, monkeypatch: pytest.MonkeyPatch, run: str) -> None:
    """Before: each batch ran the tower twice (8 calls for 4 batches). Now: once, and the
    predictions, answer losses, FLOPs and routing are exactly those of two passes."""
    model, processor = vlmod.load_pretrained(workdir / run), tiny.build("llava", image_size=32)[1]
    tower = vision_tower(model)
    calls = _counting(monkeypatch, tower)

    def run_eval():
        return evaluate(model, processor, workdir / "data" / "val.json", batch_size=3, max_new_tokens=3,
                        progress=False)

    reused = run_eval()
    assert calls[0] == 4  # 10 samples in batches of 3
    assert "forward" not in tower.__dict__  # the class's forward again
    handle = tower.register_forward_hook(lambda *_: None)  # a hooked tower runs every call
    calls[0] = 0
    twice = run_eval()
    handle.remove()
    assert calls[0] == 8
    assert [(s.prediction, s.answer_loss) for s in reused.samples] == [(s.prediction, s.answer_loss) for s in twice.samples]
    assert (reused.flops_per_sample, reused.processed_fraction) == (twice.flops_per_sample, twice.processed_fraction)


def test_only_an_equal_input_reuses(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny.build("llava", image_size=32, patch_size=8)
    model.eval()
    tower = vision_tower(model)
    calls = _counting(monkeypatch, tower)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode(), reusing_tower(model) as reusing:
        assert reusing
        first = tower(x).last_hidden_state
        again = tower(x.clone()).last_hidden_state  # other memory, the same values: reused
        assert calls[0] == 1 and torch.equal(first, again)
        tower(x + 1)  # other values
        tower(x + 1, output_hidden_states=True)  # other arguments
        assert calls[0] == 3
    y = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), reusing_tower(model):
        before = tower(y).last_hidden_state.clone()
        y.mul_(2)  # changed in place since: computed again
        assert not torch.equal(tower(y).last_hidden_state, before)
        assert calls[0] == 5


def test_a_routed_or_training_tower_is_left_alone() -> None:
    model, _ = tiny.build("llava", image_size=32, patch_size=8)
    model.train()  # dropout may draw anew
    with reusing_tower(model) as reusing:
        assert not reusing
    model.eval()
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[0]), part="vision")
    with reusing_tower(model) as reusing:
        assert not reusing


def test_an_instance_forward_set_before_is_put_back() -> None:
    """Before: leaving popped the tower's instance `forward`, so one set before (accelerate's
    hooks set one) was lost. Now it is back."""
    model, _ = tiny.build("llava", image_size=32, patch_size=8)
    model.eval()
    tower = vision_tower(model)
    own = tower.forward
    tower.forward = own  # an instance forward, as accelerate's hooks leave
    with reusing_tower(model) as reusing:
        assert reusing and tower.forward != own
    assert tower.__dict__["forward"] is own
