"""Decode timing: a clock inside `generate` (`StepClock`), dense and MoD stepped in lockstep, the
decode bound (MoD with routing bypassed) and the bytes a decode step reads (weights and KV cache),
which predict a decode speedup."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vlmod.bench.timing import Contention, Timings, contention, spread
from vlmod.plugins.calls import cache_name, output_cache
from vlmod.routing.layer import LAYER_ATTR, LayerRouting
from vlmod.routing.selection import Selection
from vlmod.routing.trace import trace_routing
from vlmod.tools.cache import generate_cache
from vlmod.tools.flops import generation_flops

# KV caches generate can run with: vlmod's preallocated one (written in place, see vlmod.tools.cache) or
# transformers' DynamicCache (K and V concatenated every step).
CACHES = ("preallocated", "dynamic")
DEFAULT_CACHE = "preallocated"


def check_cache(cache: str) -> None:
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")


def cache_kwargs(model: nn.Module, cache: str, new_tokens: int) -> dict[str, Any]:
    """What one forward or generate call of `model` takes to run with a fresh cache of kind `cache`
    (`vlmod.tools.cache.generate_cache`: nothing where the checkpoint's generation config names its own)."""
    check_cache(cache)
    return generate_cache(model, new_tokens) if cache == "preallocated" else {}


def compile_decoding(
    models: Mapping[str, nn.Module], inputs: Mapping[str, Any], gen: Mapping[str, Any], cache: str
) -> dict[str, Any]:
    """`vlmod.compile` each model and run one generate call of each, which compiles its decode
    step: {name: seconds of that first call}, what compiling costs (the timed calls after it reuse
    the compiled step). Compiled decoding takes the preallocated kind of cache (a `CompiledCache`)."""
    from vlmod.tools.compile import compile as compile_model

    if cache != DEFAULT_CACHE:
        raise ValueError(f"compiled decoding runs on vlmod's own cache: use cache={DEFAULT_CACHE!r}, not {cache!r}")
    first_call: dict[str, Any] = {}
    for name, model in models.items():
        compile_model(model)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, **gen, **cache_kwargs(model, cache, gen["max_new_tokens"]))
        device = inputs["input_ids"].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first_call[name] = time.perf_counter() - start
    return {"first_call_s": first_call}


def shared_copy(model: nn.Module) -> nn.Module:
    """A second module tree over the same parameter and buffer tensors: the dense twin of a MoD
    model (or the reverse) without a second copy of the weights, so a 7B pair fits where one
    model does (converting or unconverting a layer swaps classes and routers, never weights)."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo)
    # transformers keeps a model's compiled decode call on it (bound to that model): the twin
    # compiles its own.
    for name in ("_compiled_call", "_last_compile_config"):
        twin.__dict__.pop(name, None)
    return twin


def kv_cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values a cache holds, over all layers."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: the language model's layers, final norm and LM
    head (MoD routers included), once per step whatever the batch. Not read: the vision side and
    the embedding table (one row per token)."""
    lm = model.get_decoder()  # the language model of every vision-language family vlmod converts
    head = model.get_output_embeddings()
    embedding = {id(p) for p in lm.get_input_embeddings().parameters()}
    read = {id(p): p for p in (*lm.parameters(), *(head.parameters() if head is not None else ()))}
    if head is not None:
        embedding -= {id(p) for p in head.parameters()}  # tied: read whole, as the head
    return sum(p.numel() * p.element_size() for i, p in read.items() if i not in embedding)


def generation_footprint(
    dense: nn.Module, mod: nn.Module, inputs: Mapping[str, Any]
) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """({"dense"|"mod": generation_flops}, {"dense"|"mod": KV-cache bytes}) after one prefill of
    each model: what the timings are held against."""
    with torch.inference_mode():
        with trace_routing(mod) as trace:
            mod_cache = output_cache(mod(**inputs, use_cache=True, logits_to_keep=1))
        dense_cache = output_cache(dense(**inputs, use_cache=True, logits_to_keep=1))
    flops = {"dense": generation_flops(dense, inputs, None), "mod": generation_flops(mod, inputs, trace)}
    return flops, {"dense": kv_cache_bytes(dense_cache), "mod": kv_cache_bytes(mod_cache)}


class StepClock:
    """A logits processor that only notes when it is called: once per generated token, right after
    that token's forward. `start()` before a generate call; then `calls[-1]` holds the start and
    one tick per token: the first tick ends the prefill, each later one a decode step."""

    def __init__(self) -> None:
        self.calls: list[list[float]] = []

    def start(self) -> None:
        self.calls.append([time.perf_counter()])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.calls[-1].append(time.perf_counter())
        return scores

    @staticmethod
    def first_token_s(ticks: Sequence[float]) -> float:
        return ticks[1] - ticks[0]

    @staticmethod
    def steps_s(ticks: Sequence[float]) -> list[float]:
        """Seconds of each decode step (token 2 onwards) of one call."""
        return [b - a for a, b in zip(ticks[1:-1], ticks[2:], strict=True)]


def decode_figures(
    clocks: Mapping[str, StepClock], timings: Mapping[str, Timings], repeats: int, batch: int
) -> tuple[dict[str, dict[str, Any]], Contention, float | None]:
    """Per model: median seconds per decode step and tokens/s over the clean repeats of the last
    `repeats` generate calls; the contention of those calls (decode-step spread included); and the
    median over repeats of the paired dense/MoD step ratio (None without decode steps)."""
    calls = {name: clock.calls[-repeats:] for name, clock in clocks.items()}
    steps = {name: [StepClock.steps_s(ticks) for ticks in c] for name, c in calls.items()}
    first = contention(timings)
    pooled = {f"{n} decode steps": [s for r in first.clean_repeats for s in steps[n][r]] for n in steps}
    judged = contention(timings, extra_samples={k: v for k, v in pooled.items() if v})
    figures: dict[str, dict[str, Any]] = {}
    for name in clocks:
        samples = [s for r in judged.clean_repeats for s in steps[name][r]]
        step = statistics.median(samples) if samples else None
        figures[name] = {
            "first_token_s": statistics.median(StepClock.first_token_s(calls[name][r]) for r in judged.clean_repeats),
            "decode_step_s": step,
            "decode_tokens_per_s": batch / step if step else None,
            "decode_step_samples_s": [[round(s, 6) for s in rep] for rep in steps[name]],
        }
    paired = None
    if all(figures[n]["decode_step_s"] for n in clocks) and {"dense", "mod"} <= set(clocks):
        paired = statistics.median(
            statistics.median(steps["dense"][r]) / statistics.median(steps["mod"][r]) for r in judged.clean_repeats
        )
    return figures, judged, paired


class UngatedDecode(LayerRouting):
    """A MoD layer whose decode steps run the block with no router and no gate (the adapter's own
    call: its masks and key-slot records); prefill routes as usual. Not a model to use: the
    bound `routing_bypassed` times MoD decode against."""

    def forward(self, upstream: Callable, args: tuple, kwargs: dict) -> Any:
        part, adapter = self.part, self.part.adapter
        x = adapter.hidden_states(args, kwargs)
        if not adapter.layout(part, x, args, kwargs).every_token:
            return super().forward(upstream, args, kwargs)
        sel = Selection(index=None, valid=None, length=x.shape[1])
        return adapter.output(adapter.run(upstream, x, sel, args, kwargs, self.layer_idx), args, kwargs)


def routing_bypassed(mod: nn.Module) -> nn.Module:
    """A copy of `mod` whose MoD layers, in a decode step, run their block with no router and no
    gate (`UngatedDecode`), over KV caches a routed prefill filled, as small as MoD's. Not a model
    to use (its decode ignores the gate): a bound on MoD decode, which tells what the router and
    gate cost a step from what the smaller caches allow."""
    bypassed = shared_copy(mod)
    for module in bypassed.modules():
        routing = module.__dict__.get(LAYER_ATTR)
        if routing is not None:
            routing.__class__ = UngatedDecode
    return bypassed


def lockstep_decode(
    models: Mapping[str, nn.Module], inputs: Mapping[str, Any], steps: int, cache: str = DEFAULT_CACHE, warmup: int = 2
) -> dict[str, Any]:
    """Decode steps of dense and MoD in lockstep: after one prefill each, one step of each model in
    turn (the order alternating), each on its own greedy tokens, `warmup` steps untimed. A model
    named "bypassed" (`routing_bypassed`) gets its own speedup over dense, `bypassed_speedup`.

    Why: timed inside `generate`, the two models' steps come from different calls, and on a
    shared CPU a slow phase can last a whole call (steps of one model 66 ms in one call, 78 in
    the next); here the two steps of a pair are adjacent in time, so such phases hit both. The
    figure is the median over pairs of dense step / MoD step."""
    names = list(models)
    state: dict[str, list[Any]] = {}
    times: dict[str, list[float]] = {name: [] for name in names}
    cache_arg = {name: cache_name(type(model).forward) for name, model in models.items()}
    with torch.inference_mode():
        for name, model in models.items():
            out = model(**inputs, **cache_kwargs(model, cache, steps + warmup + 1), use_cache=True, logits_to_keep=1)
            state[name] = [output_cache(out), out.logits[:, -1:].argmax(-1), inputs["attention_mask"]]
        for i in range(warmup + steps):
            for name in names if i % 2 == 0 else names[::-1]:
                past, token, mask = state[name]
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                start = time.perf_counter()
                out = models[name](input_ids=token, attention_mask=mask, **{cache_arg[name]: past}, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                if token.is_cuda:
                    torch.cuda.synchronize(token.device)
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
                state[name] = [past, token, mask]
    result: dict[str, Any] = {"steps": steps, **{f"{n}_step_s": statistics.median(times[n]) for n in names}}
    if {"dense", "mod"} <= set(names):
        pairs = [d / m for d, m in zip(times["dense"], times["mod"], strict=True)]
        result["speedup"] = statistics.median(pairs)
        result["spread"] = spread(pairs)
    if {"dense", "bypassed"} <= set(names):
        result["bypassed_speedup"] = statistics.median(
            d / b for d, b in zip(times["dense"], times["bypassed"], strict=True)
        )
    result["samples_s"] = {n: [round(t, 6) for t in times[n]] for n in names}
    return result


def timed_lockstep(
    models: Mapping[str, nn.Module], inputs: Mapping[str, Any], steps: int, cache: str, decode_bound: bool
) -> dict[str, Any]:
    """`lockstep_decode` of dense and MoD, and with `decode_bound` of MoD's routing-bypassed copy too
    (dropped right after: it holds a third copy of the weights)."""
    if not decode_bound:
        return lockstep_decode(models, inputs, steps, cache)
    return lockstep_decode({**models, "bypassed": routing_bypassed(models["mod"])}, inputs, steps, cache)
