"""Logits only where a fine-tune's loss reads them: the positions whose next token is an answer.

Why: transformers computes the LM head on every position when it computes a loss, a [B, L, V]
float32 tensor (and its gradient) of which the loss reads the answer positions only. For a
LLaVA-NeXT-Video clip (1,200 positions, 9 answer tokens, 32,064 words) that is 147 MiB a
sample; with Gemma 3's 262k words, 1.2 GiB. Its FLOPs are a cost MoD cannot skip (at 7B width
and 32k words, 2% of a dense forward, 6% of a MoD one's at capacity 0.2 on 29 of 32 layers;
more with a larger vocabulary). The step instead passes `logits_to_keep` (the positions any row of the
batch needs, `vlmod.data.answers.answer_positions`) and `shift_labels` (each kept position's
next-token label), which the model's own loss function takes in place of shifting `labels`: the
loss is the same (the same terms, summed in another order), and `labels` still reach the model,
so MoD layers still tell answer tokens from instruction tokens.

Models whose forward or loss function does not take them (remote code) keep every logit.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import Tensor, nn

from vlmod.data.answers import answer_positions, next_token_labels


def keeps_answer_logits(model: nn.Module) -> bool:
    """Whether `model` (or the model under a peft / DDP wrapper) can compute logits at chosen
    positions only and take their labels in its loss."""
    while True:
        inner = getattr(model, "module", None)  # DistributedDataParallel
        if inner is None and hasattr(model, "get_base_model"):
            inner = model.get_base_model()  # peft
        if not isinstance(inner, nn.Module) or inner is model:
            break
        model = inner
    try:
        loss = model.loss_function
    except AttributeError:
        return False
    return _takes(type(model).forward, "logits_to_keep") and _takes(loss, "shift_labels")


@functools.lru_cache(maxsize=64)
def _takes(fn: Any, name: str) -> bool:
    """Whether `fn` has a parameter `name` (cached: the step asks every micro-batch)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def answer_logits_inputs(model: nn.Module, batch: dict[str, Any]) -> dict[str, Tensor]:
    """The extra forward arguments that make `model(**batch, **them)` compute the logits of the
    answer positions only ({} where the model cannot, or the batch has no labels)."""
    labels = batch.get("labels")
    if labels is None or not keeps_answer_logits(model):
        return {}
    keep = answer_positions(labels)
    return {"logits_to_keep": keep, "shift_labels": next_token_labels(labels)[:, keep]}


def logit_labels(batch: dict[str, Any], extra: dict[str, Tensor]) -> Tensor:
    """[B, K]: the label each of the forward's logits predicts, whether it kept every position
    (`extra` empty) or the answer positions only."""
    return extra["shift_labels"] if "shift_labels" in extra else next_token_labels(batch["labels"])


__all__ = ["answer_logits_inputs", "keeps_answer_logits", "logit_labels"]
