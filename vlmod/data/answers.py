"""Answers, both sides: which label positions are answer tokens (what training's loss counts)
and whether a generated answer is right (what evaluation scores).

Labels hold the answer's token ids and -100 (`IGNORE_INDEX`) everywhere else. A generated answer
is right when it names the reference's option letter ("B", "(B)") for a multiple-choice
reference, else when it matches the reference after the usual VQA normalisation.
"""

from __future__ import annotations

import re
import unicodedata

import torch

IGNORE_INDEX = -100
_ARTICLES = frozenset({"a", "an", "the"})
_OPTION = re.compile(r"^\(?([A-Ea-e])\)?[.:)]?$")
# A capital letter, or a lowercase one set off as an option ("(b)", "b.", "b" alone): so "a red
# circle" is not option A.
_LEADING_OPTION = re.compile(
    r"^\s*(?i:option\s+|answer\s*:?\s*)?(?:\(([A-Ea-e])\)|([A-E])(?:[\s.:)]|$)|([a-e])(?:[.:)]|$))"
)


def answer_mask(labels: torch.Tensor) -> torch.Tensor:
    """[B, L-1] bool: the positions whose next token is an answer token (what the loss counts)."""
    return labels[:, 1:] != IGNORE_INDEX


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, L]: the label each position's logits predict (the next position's; -100 at the end)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def answer_positions(labels: torch.Tensor) -> torch.Tensor:
    """[K] ascending: the positions whose next token is an answer token in any row, the only
    logits a fine-tune's loss reads. Its length is data-dependent: one host sync."""
    return answer_mask(labels).any(0).nonzero().squeeze(1)


def normalize_answer(text: str) -> str:
    """Lowercase, punctuation and articles (a, an, the) removed, whitespace collapsed: the
    usual VQA normalisation, so "The circle." and "circle" match exactly."""
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text.lower())
    return " ".join(w for w in text.split() if w not in _ARTICLES)


def exact_match(prediction: str, reference: str) -> bool:
    """Normalised exact match (`normalize_answer` on both sides)."""
    return normalize_answer(prediction) == normalize_answer(reference)


def is_correct(prediction: str, reference: str) -> bool:
    """Option-letter match for multiple choice references, normalised exact match otherwise."""
    option = _OPTION.match(reference.strip())
    if option:
        found = _LEADING_OPTION.match(prediction)
        letter = found and next(g for g in found.groups() if g)
        return bool(letter) and letter.upper() == option.group(1).upper()
    return exact_match(prediction, reference)


__all__ = [
    "IGNORE_INDEX",
    "answer_mask",
    "answer_positions",
    "exact_match",
    "is_correct",
    "next_token_labels",
    "normalize_answer",
]
