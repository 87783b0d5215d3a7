"""Loss spikes: a logged loss, after warm-up, above twice the running median of the ones before it.

A stage whose loss spikes and recovers can still end well, or not, depending on float rounding
(the video recipe's MoD stage once ended at 93.8% or 87.9% from two builds whose losses agreed to
1e-7 before the spike), so a run says when it happened instead of leaving it to the loss plot.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

SPIKE_FACTOR = 2.0  # a loss above this many times its running median is a spike
MIN_BEFORE = 4  # logged losses after warm-up needed before one is judged
WINDOW = 8  # the running median is over this many logged losses before (the loss keeps falling)
# A spike must also rise this far (in nats) above the median: near zero, 0.003 after 0.0015 is
# noise (the image stage's last logs), not a stage that lost what it learned.
MIN_RISE = 0.02


def warmup_steps(config: dict[str, Any] | Any, last_step: int) -> int:
    """The steps before which a loss is not judged: the longer of the learning-rate warm-up and the
    capacity warm-up (`warmup`, `capacity_warmup`: steps when >= 1, else a share of the run, whose
    length is `max_steps` or, for an epoch-based run, `last_step`)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    total = get("max_steps") or last_step
    longest = 0.0
    for key in ("warmup", "capacity_warmup"):
        value = float(get(key, 0.0) or 0.0)
        longest = max(longest, value if value >= 1 else value * total)
    return int(longest)


def loss_spikes(history: Sequence[dict[str, Any]], warmup: int, factor: float = SPIKE_FACTOR) -> list[dict[str, Any]]:
    """Each logged loss (`history`: the loop's records, `step` and `loss`) past step `warmup` that
    exceeds `factor` times the median of the (at most `WINDOW`) losses logged after warm-up just
    before it, and that median by `MIN_RISE`: step, loss, that median and the ratio."""
    before: list[float] = []
    spikes = []
    for record in history:
        loss = record.get("loss")
        if loss is None or record.get("step", 0) <= warmup:
            continue
        if len(before) >= MIN_BEFORE:
            median = statistics.median(before[-WINDOW:])
            if loss > factor * median and loss - median >= MIN_RISE:
                spikes.append({"step": record["step"], "loss": loss, "median": median, "ratio": loss / median})
        before.append(loss)
    return spikes


def describe_spikes(spikes: Sequence[dict[str, Any]], where: str) -> str:
    """One warning line for the spikes of `where` (a stage, a run): the first and the largest."""
    worst = max(spikes, key=lambda s: s["ratio"])
    first = spikes[0]
    text = (f"warning: {where}: the loss rose to {first['loss']:.3g} at step {first['step']}, "
            f"{first['ratio']:.1f}x the running median {first['median']:.3g} after warm-up")
    if len(spikes) > 1:
        text += (f"; {len(spikes)} logged losses above {SPIKE_FACTOR:g}x, the largest {worst['ratio']:.1f}x at step "
                 f"{worst['step']}")
    return text + " (an unstable stage: a rerun may end elsewhere; a lower learning rate steadies it)"


__all__ = ["MIN_BEFORE", "MIN_RISE", "SPIKE_FACTOR", "WINDOW", "describe_spikes", "loss_spikes", "warmup_steps"]
