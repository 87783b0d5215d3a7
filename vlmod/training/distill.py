"""Distillation from the dense model while a MoD model fine-tunes (`distill_from` in finetune).

Why: a converted model starts as the dense model with most vision tokens skipped; matching the
dense model's answer distribution, not only the one-hot reference, tells every skipped-token
error apart from a right answer given less confidently (the usual recipe of token-reduction
fine-tunes, e.g. p-MoD). The loss is KL(teacher || student) of the next-token distributions at
the answer positions (labels != -100), averaged over those positions, at temperature T (scaled by
T^2 so its gradient does not shrink with T).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmod.data.answers import IGNORE_INDEX
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


__all__ = ["Teacher", "distillation_loss"]
