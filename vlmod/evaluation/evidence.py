"""When an accuracy comparison may carry a verdict ("goal met", "best of all methods", "better
than random routing"): one rule for the recipe's results.md, `vlmod eval --compare` and `vlmod audit`.

A toy run (`vlmod recipe --quick`: 7 questions, every model at 0%) checks that the pipeline runs;
its "goal met" would mean nothing. A verdict needs a reference model (dense, or the audited model
itself) that learned the task, at least `MIN_POINTS_OVER_CHANCE` points above chance, on at least
`MIN_QUESTIONS` questions (at 200 a paired 95% interval is about +-4 points wide; fewer cannot
tell one point from noise). Otherwise the report says it checks the pipeline only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MIN_QUESTIONS = 200
MIN_POINTS_OVER_CHANCE = 10.0
PIPELINE_ONLY = "This run checks the pipeline only, so it gives no verdict"


@dataclass(frozen=True)
class Evidence:
    """Whether a verdict may be given, and if not why (one clause)."""

    enough: bool
    why_not: str = ""

    def line(self) -> str:
        """The sentence a report gives instead of its verdicts ("" when it may give them)."""
        return "" if self.enough else f"{PIPELINE_ONLY} ({self.why_not})."


def answer_options(question_type: str) -> tuple[str, ...] | None:
    """The answers a synthetic question type chooses from (the shapes, clip and fine-detail sets'
    types); None for another type (real data)."""
    from vlmod.data.detail import DETAIL_ANSWERS
    from vlmod.data.scenes import ANSWERS

    options = ANSWERS.get(question_type) or DETAIL_ANSWERS.get(question_type)
    return tuple(options) if options else None


def chance_accuracy(question_types: Iterable[str]) -> float | None:
    """Chance accuracy of the synthetic question types (one answer of each type's options, the
    types weighted alike, as the balanced synthetic sets are); None for a type that is not a
    synthetic one (real data: chance unknown)."""
    options = [answer_options(t) for t in question_types]
    if not options or any(o is None for o in options):
        return None
    return sum(1.0 / len(o) for o in options) / len(options)


def verdict_evidence(accuracy: float, questions: int, chance: float | None, who: str = "dense") -> Evidence:
    """The rule: `who` (the reference model) at least MIN_POINTS_OVER_CHANCE points above `chance`
    (0 when unknown) on at least MIN_QUESTIONS questions."""
    floor = chance or 0.0
    reasons = []
    if questions < MIN_QUESTIONS:
        reasons.append(f"{questions} questions, a verdict needs at least {MIN_QUESTIONS}")
    if 100 * (accuracy - floor) < MIN_POINTS_OVER_CHANCE:
        reasons.append(
            f"{who} {100 * accuracy:.1f}% is not {MIN_POINTS_OVER_CHANCE:g} points above "
            + (f"chance {100 * floor:.1f}%" if chance is not None else "0%")
        )
    return Evidence(not reasons, "; ".join(reasons))


__all__ = ["MIN_POINTS_OVER_CHANCE", "MIN_QUESTIONS", "PIPELINE_ONLY", "Evidence", "answer_options", "chance_accuracy",
           "verdict_evidence"]
