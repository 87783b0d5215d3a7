"""Logits only at the answer positions: every family's loss, gradients and distillation are those of
the full logits, dense and MoD, and a model that cannot keep chosen logits keeps all of them."""

from __future__ import annotations

import pytest
import torch
from helpers.families import BUILD
from helpers.inputs import padded_batch
from torch import nn

import vlmod
from vlmod.data.answers import IGNORE_INDEX, answer_positions, next_token_labels
from vlmod.models import tiny
from vlmod.training.distill import distillation_loss
from vlmod.training.logits import answer_logits_inputs, keeps_answer_logits, logit_labels

FAMILIES = tiny.FAMILIES + tiny.VLM_FAMILIES


def _labelled(batch: dict) -> dict:
    """Answers of different lengths at the end of each (left-padded) row: the last 2 and 4 tokens."""
    labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    labels[0, -2:] = batch["input_ids"][0, -2:]
    labels[1, -4:] = batch["input_ids"][1, -4:]
    return {**batch, "labels": labels}


def test_answer_positions_are_the_union_of_every_rows_answers():
    labels = torch.full((2, 8), IGNORE_INDEX)
    labels[0, 3] = labels[1, 6:] = 5
    assert answer_positions(labels).tolist() == [2, 5, 6]
    assert next_token_labels(labels)[:, answer_positions(labels)].tolist() == [[5, -100, -100], [-100, 5, 5]]
    assert answer_positions(torch.full((2, 8), IGNORE_INDEX)).numel() == 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mod", [False, True], ids=["dense", "mod"])
def test_answer_logits_give_the_full_logits_loss_and_gradients(family, mod):
    torch.manual_seed(0)
    model, processor = tiny.build(family, **BUILD.get(family, {}))
    if mod:
        vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="every_other", aux_loss="bce"), part="language")
    model.train()
    batch = _labelled(padded_batch(processor, family))
    assert keeps_answer_logits(model)
    extra = answer_logits_inputs(model, batch)
    assert extra["logits_to_keep"].numel() == 4  # the longer answer's positions cover the shorter one's
    results = []
    for inputs in (batch, {**batch, **extra}):
        model.zero_grad(set_to_none=True)
        out = model(**inputs, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), out.logits.detach(), grads))
    (full_loss, full_logits, full_grads), (loss, logits, grads) = results
    assert logits.shape == (2, 4, full_logits.shape[-1])
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, full_logits[:, extra["logits_to_keep"]], rtol=1e-5, atol=1e-5)
    assert grads.keys() == full_grads.keys()
    for name, g in full_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # Distillation reads the same answer positions whichever logits the forward kept.
    teacher = full_logits + torch.randn_like(full_logits)
    kept = distillation_loss(logits, teacher[:, extra["logits_to_keep"]], logit_labels(batch, extra))
    every = distillation_loss(full_logits, teacher, logit_labels(batch, {}))
    torch.testing.assert_close(kept, every, rtol=1e-5, atol=1e-6)


def test_a_model_without_logits_to_keep_keeps_every_logit():
    class Plain(nn.Module):
        def forward(self, input_ids, labels=None):
            return input_ids

    labels = torch.zeros(1, 4, dtype=torch.long)
    assert not keeps_answer_logits(Plain())
    assert answer_logits_inputs(Plain(), {"input_ids": labels, "labels": labels}) == {}
    model, _ = tiny.build("llava")
    assert answer_logits_inputs(model, {"input_ids": labels}) == {}  # no labels: nothing to keep
