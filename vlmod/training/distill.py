"""Distillation from the dense model while a MoD model fine-tunes (`distill_from` in finetune).

Why: a converted model starts as the dense model with most vision tokens skipped; matching the
dense model's answer distribution, not only the one-hot reference, tells every skipped-token
error apart from a right answer given less confidently (the usual recipe of token-reduction
fine-tunes, e.g. p-MoD). The loss is KL(teacher || student) of the next-token distributions at
the answer positions (labels != -100), averaged over those positions, at temperature T (scaled by
T^2 so its gradient does not shrink with T).

The teacher's vision tower runs once a step, not twice, where the student's is frozen and the
same (`Teacher.sharing_tower`): in the recipes' refinement and MoD stages both towers see the
same pixels, and the teacher's tower was 11-15% of a step (py-spy, the video recipe on this project's CPU).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.data.answers import IGNORE_INDEX
from vlmod.io.hf import patch_forward, vision_tower
from vlmod.routing.layer import MoDLayer
from vlmod.training.logits import keeps_answer_logits, logit_labels


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    num_items: Tensor | float | None = None,
) -> Tensor:
    """KL(teacher || student) over the positions that predict an answer token: their mean, or
    their sum over `num_items` (a multi-process run divides by its share of the global count, as
    the language-model loss does, so every answer token weighs alike). `labels` [B, K]: the label
    each logit position predicts (`vlmod.training.logits.logit_labels`), -100 where none."""
    mask = labels != IGNORE_INDEX
    s = student_logits[mask].float() / temperature
    t = teacher_logits[mask].float() / temperature
    if s.numel() == 0:
        return student_logits.sum() * 0.0
    if num_items is None:
        kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
    else:
        kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum") / num_items
    return kl * temperature**2


class Teacher:
    """A frozen copy of the dense model, run under no_grad on each training batch."""

    def __init__(self, model: nn.Module, temperature: float = 1.0):
        self.model = model.eval().requires_grad_(False)
        self.temperature = temperature

    @classmethod
    def load(cls, path: str, device: torch.device, error: type[Exception], temperature: float = 1.0) -> Teacher:
        from vlmod.io.hf import load_vlm

        model, _ = load_vlm(path, error, "distillation supports", dtype="auto")  # frozen: its own dtype
        return cls(model.to(device), temperature)

    def loss(
        self,
        student_logits: Tensor,
        batch: dict[str, Any],
        answers: dict[str, Tensor],
        num_items: Tensor | float | None = None,
    ) -> Tensor:
        """The distillation loss of `student_logits`, which the student computed with the extra
        inputs `answers` (`vlmod.training.logits.answer_logits_inputs`; {}: every position): the
        teacher keeps the same positions."""
        keep = answers.get("logits_to_keep")
        with torch.no_grad():
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            if keep is not None and keeps_answer_logits(self.model):
                inputs["logits_to_keep"] = keep
                keep = None
            teacher_logits = self.model(**inputs).logits
        if keep is not None:  # a teacher that computes every logit
            teacher_logits = teacher_logits[:, keep]
        labels = logit_labels(batch, answers)
        return distillation_loss(student_logits, teacher_logits, labels, self.temperature, num_items)

    @contextlib.contextmanager
    def sharing_tower(self, student: nn.Module) -> Iterator[bool]:
        """While inside, the teacher takes the vision tower output the student's forward just
        computed on the same pixels instead of computing it again, where the two towers compute
        the same function all run long (`same_frozen_tower`); yields whether they share. The
        student runs first in each step (`vlmod.training.loop`), so the teacher finds its output."""
        pair = vision_tower(student), vision_tower(self.model)
        if pair[0] is None or pair[1] is None or not same_frozen_tower(pair[0], pair[1]):
            yield False
            return
        share = _TowerShare(*pair)
        try:
            yield True
        finally:
            share.close()


def same_frozen_tower(student: nn.Module, teacher: nn.Module) -> bool:
    """Whether two vision towers give the same output on the same input for a whole fine-tune:
    the student's frozen (no weight trains), unrouted, without active dropout, and every weight
    and buffer equal to the teacher's (same names, dtypes, devices, values)."""
    if any(p.requires_grad for p in student.parameters()) or any(isinstance(m, MoDLayer) for m in student.modules()):
        return False
    if student.training and _dropout(student):
        return False
    ours, theirs = student.state_dict(), teacher.state_dict()
    if ours.keys() != theirs.keys():
        return False
    return all(a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and torch.equal(a, b)
               for a, b in ((ours[k], theirs[k]) for k in ours))


def _dropout(tower: nn.Module) -> bool:
    """Whether the tower drops anything in training mode (its modules or its config's rates)."""
    config = getattr(tower, "config", None)
    rates = [getattr(config, name, 0.0) or 0.0 for name in ("attention_dropout", "dropout", "hidden_dropout_prob")]
    return any(r > 0 for r in rates) or any(isinstance(m, nn.Dropout) and m.p > 0 for m in tower.modules())


# The training step's language-side arguments, which Hugging Face's LLaVA passes on to the tower
# too (its **kwargs) and the tower ignores: the student's call has them, the teacher's not.
_LANGUAGE_ONLY = frozenset({"use_cache", "shift_labels", "num_items_in_batch", "logits_to_keep", "labels"})


class _TowerShare:
    """The student tower's last output, kept until the teacher's tower is called on the same
    input (the same tensor memory, unchanged since, under the same autocast and arguments) and
    handed over once; any other call computes as usual. The kept input stays referenced, so its
    memory cannot be reused by another batch while the entry lives."""

    def __init__(self, student: nn.Module, teacher: nn.Module):
        self.student, self.teacher = student, teacher
        self.student_forward, self.teacher_forward = student.forward, teacher.forward
        self.kept: tuple[tuple, Tensor, Any] | None = None
        self.restores = [patch_forward(student, self.compute), patch_forward(teacher, self.take)]

    def close(self) -> None:
        for restore in self.restores:
            restore()
        self.kept = None

    @staticmethod
    def key(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        kwargs = {k: v for k, v in kwargs.items() if k not in _LANGUAGE_ONLY}
        if len(args) != 1 or not isinstance(args[0], Tensor) or any(isinstance(v, Tensor) for v in kwargs.values()):
            return None
        x, device = args[0], args[0].device.type
        return (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version,
                torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), sorted(kwargs.items()))

    def compute(self, *args: Any, **kwargs: Any) -> Any:
        out = self.student_forward(*args, **kwargs)
        key = self.key(args, kwargs)
        self.kept = None if key is None or args[0].requires_grad else (key, args[0], out)
        return out

    def take(self, *args: Any, **kwargs: Any) -> Any:
        kept, self.kept = self.kept, None
        if kept is not None and kept[0] == self.key(args, kwargs):
            return copy.copy(kept[2])  # a shallow copy: LLaVA sets the output's pooler_output
        return self.teacher_forward(*args, **kwargs)


__all__ = ["Teacher", "distillation_loss", "same_frozen_tower"]
