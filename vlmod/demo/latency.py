"""The demo's latency panel: prefill (time to first token) and decode per token of the MoD and the
dense model, timed apart, each with its spread and held against its own prediction.

Why apart: MoD skips vision tokens while the prompt is read (the prefill), so time to first token
follows the prefill FLOPs. A decode step runs one new token through every layer and reads the
language model's weights whole, as dense does; it follows the bytes read (weights plus KV cache),
which MoD cuts only by its smaller cache. Timing a whole `generate` mixes the two and, with a few
prompt tokens and many new ones, hides the part MoD is for.

Why a spread: on a shared machine one request's figures can swing by a third from the next. The
two models are interleaved (MoD, dense, then dense, MoD, ...), each repeat gives a paired ratio
(dense / MoD, adjacent in time), and the figure is their median with the lowest and highest pair
as its interval. A ratio whose interval holds 1, or that is nearer 1 than the samples' own spread,
is "within noise": no verdict. Other requests are held off while timing (the caller's `hold_off`),
and other processes' CPU use is measured (`vlmod.bench.timing.contention`): a contended figure
says so instead of a verdict.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from vlmod.bench.decode import StepClock
from vlmod.bench.timing import contention, spread, time_interleaved
from vlmod.demo.inference import generate
from vlmod.demo.model import LoadedModel

# Timed generate calls per model per request (interleaved, median reported); 0 = no timing. Five:
# with three, one slow call often made the spread alone call the figure contended.
TIMING_RUNS = 5
WHAT_MOD_IS_FOR = (
    "MoD is for the prefill: it skips vision tokens while the prompt is read, so time to first token "
    "follows the prefill FLOPs. The prediction counts the whole prefill's FLOPs, vision tower included; "
    "the measured ratio falls short of it because per-call costs (launching each layer's work, the "
    "router's gather and scatter, the processor) do not shrink with the tokens skipped, most of all on "
    "a small model. Each decoded token still reads the whole language model, as dense does (MoD saves "
    "only its smaller KV cache), so decode follows the bytes read"
)


def times(ratio: float) -> str:
    """A dense / MoD ratio in words that match it: 1.14 -> "1.14x faster", 0.88 -> "1.14x slower"."""
    return f"{ratio:.2f}x faster" if ratio >= 1.0 else f"{1.0 / ratio:.2f}x slower"


def purpose(decode: Mapping[str, Any] | None) -> str:
    """WHAT_MOD_IS_FOR, ending with what this request's decode measured in words that follow the
    ratio (never "about even" beside a 0.87x)."""
    if decode is None or decode.get("speedup") is None:
        return WHAT_MOD_IS_FOR + "."
    measured, verdict = times(decode["speedup"]), decode["verdict"]
    if verdict in ("faster", "slower"):
        said = f"here MoD decoded {measured}"
        if verdict == "slower":
            said += " (the router runs at every step and saves little to read)"
    elif verdict == "within noise":
        said = f"here decode measured {decode['speedup']:.2f}x (dense / MoD), within this request's noise"
    else:  # contended, one run
        said = f"here decode measured {decode['speedup']:.2f}x (dense / MoD), with no verdict ({verdict})"
    return f"{WHAT_MOD_IS_FOR}; {said}."
METHOD = (
    "{runs} greedy generates of {tokens} new tokens per model, untraced, after a start-up warm-up; "
    "{models} interleaved in alternating order with the server's other requests held off; time to first "
    "token and the median decode step read inside each generate; medians, the interval is the lowest "
    "and highest paired ratio"
)


def paired(dense: Sequence[float], mod: Sequence[float], predicted: float | None = None) -> dict[str, Any]:
    """One figure of MoD against dense from paired samples (repeat i of each ran back to back):
    medians, each model's spread, the median paired ratio dense / MoD with its [lowest, highest]
    interval, and the verdict: "faster", "slower", "within noise" (the interval holds 1, or the
    ratio is nearer 1 than the samples' spread), or "one run" (no spread to judge by)."""
    ratios = [d / m for d, m in zip(dense, mod, strict=True) if m > 0]
    speedup = statistics.median(ratios)
    noise = max(spread(dense), spread(mod))
    if len(ratios) < 2:
        verdict = "one run"
    elif min(ratios) <= 1.0 <= max(ratios) or abs(speedup - 1.0) <= noise:
        verdict = "within noise"
    else:
        verdict = "faster" if speedup > 1.0 else "slower"
    return {
        "mod_s": statistics.median(mod),
        "dense_s": statistics.median(dense),
        "mod_range_s": [min(mod), max(mod)],
        "dense_range_s": [min(dense), max(dense)],
        "spread": {"mod": spread(mod), "dense": spread(dense)},
        "speedup": speedup,
        "interval": [min(ratios), max(ratios)],
        "verdict": verdict,
        "predicted_speedup": predicted,
    }


def alone(samples: Sequence[float]) -> dict[str, Any]:
    """One model's figure when there is no dense model to pair it with."""
    return {"mod_s": statistics.median(samples), "mod_range_s": [min(samples), max(samples)],
            "spread": {"mod": spread(samples)}}


def measure_latency(
    loaded: LoadedModel,
    inputs: Mapping[str, Any],
    max_new_tokens: int,
    runs: int = TIMING_RUNS,
    predicted: Mapping[str, float | None] | None = None,
    hold_off: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[str, Any] | None:
    """Time to first token and decode seconds per token of the MoD model and (when loaded) the
    dense one on `inputs`: warm, untraced, the same number of new tokens, `runs` generates each,
    interleaved, inside `hold_off()` (the server holds its other requests off meanwhile).

    predicted: {"prefill": dense / MoD FLOPs, "decode": dense / MoD bytes a step reads}, shown
    beside the measured ratios. None when `runs` is 0 or the models were not warmed up
    (`vlmod.demo.inference.warm_up`): then there is no fair number to show."""
    if runs <= 0 or loaded.warm_up_s is None:
        return None
    models = {"mod": loaded.model, **({"dense": loaded.dense} if loaded.dense is not None else {})}
    clocks = {name: StepClock() for name in models}

    def call(name: str) -> None:
        clocks[name].start()
        generate(models[name], dict(inputs), loaded.processor, max_new_tokens, exact=True, clock=clocks[name])

    device = next(loaded.model.parameters()).device  # on a GPU, judged by spread alone
    with hold_off():
        timings = time_interleaved({n: (lambda n=n: call(n)) for n in models}, warmup=0, repeats=runs, device=device)
    first = {n: [StepClock.first_token_s(t) for t in clocks[n].calls] for n in models}
    steps = {n: [statistics.median(StepClock.steps_s(t)) for t in clocks[n].calls if len(t) > 2] for n in models}
    extra = {f"{n} first token": first[n] for n in models}
    extra.update({f"{n} decode step": steps[n] for n in models if steps[n]})
    judged = contention(timings, extra_samples=extra)
    clean = judged.clean_repeats
    first = {n: [first[n][r] for r in clean] for n in models}
    steps = {n: [steps[n][r] for r in clean] if steps[n] else [] for n in models}
    predicted = predicted or {}
    if "dense" in models:
        prefill = paired(first["dense"], first["mod"], predicted.get("prefill"))
        decode = paired(steps["dense"], steps["mod"], predicted.get("decode")) if steps["mod"] else None
    else:
        prefill, decode = alone(first["mod"]), alone(steps["mod"]) if steps["mod"] else None
    if judged.contended:
        for figure in (prefill, decode):
            if figure is not None and "verdict" in figure:
                figure["verdict"] = "contended"
    return {
        "prefill": prefill,
        "decode": decode,
        "runs": runs,
        "new_tokens": max_new_tokens,
        "held_off": True,
        "contended": judged.contended,
        "contention": judged.as_dict(),
        "samples": {n: {"first_token_s": first[n], "decode_step_s": steps[n],
                        "generate_s": [timings[n].wall_s[r] for r in clean]} for n in models},
        "purpose": purpose(decode if "dense" in models else None),
        "method": METHOD.format(runs=runs, tokens=max_new_tokens,
                                models="MoD and dense" if "dense" in models else "MoD only"),
    }
