"""The latency row of `vlmod eval`, timed as the benchmarks time: a MoD model and its dense twin (the
same weights with the routing removed, no second copy) take turns on the same prompts
(`vlmod.bench.timing.time_interleaved`), so load on a shared machine hits both alike, and a figure
timed while other processes held the CPU, or too noisy to compare, is flagged as contended
(`vlmod.bench.timing.contention`), as `vlmod bench` flags it.

Timing the models one after the other (the whole MoD evaluation, then the whole dense one) once
printed MoD 264.7 ms against dense 14.2 ms a sample because another job ran during the MoD half;
the same command on a quiet machine gave 6.6 against 8.2 ms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torch import Tensor, nn

from vlmod.api import mod_layers, remove_mod
from vlmod.bench.decode import shared_copy
from vlmod.bench.timing import contention, time_interleaved
from vlmod.tools.cache import generate_cache

TIMING_RUNS = 3  # interleaved repeats of each model (`--timing-runs`)


@dataclass
class Latency:
    """Per-sample seconds of a greedy generate of `new_tokens` tokens (exactly that many: both
    models do the same work), medians over the repeats judged clean."""

    seconds: float
    dense_seconds: float | None = None  # the dense twin, for a MoD model
    new_tokens: int = 0
    repeats: int = 0
    contended: bool = False
    reason: str = ""  # why contended, in words
    spread: dict[str, float] = field(default_factory=dict)  # MAD / median per model

    @property
    def speedup(self) -> float | None:
        """Dense over MoD seconds (above 1: MoD is faster)."""
        return self.dense_seconds / self.seconds if self.dense_seconds and self.seconds else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "speedup": self.speedup}


def time_generation(model: nn.Module, inputs: dict[str, Tensor], new_tokens: int, repeats: int = TIMING_RUNS,
                    warmup: int = 1) -> Latency:
    """`model` (and, when it has MoD layers, its dense twin) generating `new_tokens` tokens for
    `inputs`, interleaved; see the module doc."""
    models = {"model": model}
    if mod_layers(model):
        models["dense"] = remove_mod(shared_copy(model)).eval()
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    timings = time_interleaved(
        {name: (lambda m=m: m.generate(**inputs, **gen, **generate_cache(m, new_tokens))) for name, m in models.items()},
        warmup=warmup, repeats=repeats,
    )
    judged = contention(timings)
    rows = int(inputs["input_ids"].shape[0])
    per_sample = {name: t.median(judged.clean_repeats) / rows for name, t in timings.items()}
    return Latency(
        seconds=per_sample["model"], dense_seconds=per_sample.get("dense"), new_tokens=new_tokens, repeats=repeats,
        contended=judged.contended, reason=judged.reason, spread=judged.spread,
    )


__all__ = ["TIMING_RUNS", "Latency", "time_generation"]
