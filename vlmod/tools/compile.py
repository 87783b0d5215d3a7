"""`vlmod.compile(model)`: decode steps compiled, dense or MoD.

At batch 1 a decode step is host-bound: the GPU waits for kernel launches (docs/gpu.md). A decode
step compiled with `fullgraph=True` against `CompiledCache` (buffers at static addresses, lengths
on the device) runs as one graph, and on a GPU with CUDA graphs (`mode="reduce-overhead"`) its
launches are replayed, not issued one by one. transformers' `generate` does the compiling: this
sets the model's generation config so that it compiles decode steps, and makes vlmod's own
generation (eval, bench, the demo, the lmms-eval model) hand it a `CompiledCache`. The prefill
stays eager (one per request, a new shape each time).

    vlmod.compile(model)
    model.generate(**inputs, max_new_tokens=32, cache=vlmod.compiled_cache(model, 32))

The first decode step of a shape compiles (seconds to a minute, the table in docs/speed.md);
later steps, and later requests whose cache rounds to the same size, reuse it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlmod.errors import InputError
from vlmod.tools.cache import COMPILED_ATTR

ATTENTION = ("sdpa", "eager")


def compile_problem(model: nn.Module) -> str | None:
    """Why `model`'s decode step cannot be compiled by vlmod, in one line; None when it can."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate") or not hasattr(config, "get_text_config"):
        return f"a {type(model).__name__} has no generate(); vlmod compiles the decode steps of generation"
    text = config.get_text_config(decoder=True)
    impl = getattr(text, "_attn_implementation", None)
    if impl not in ATTENTION:
        return f"compiled decoding runs on sdpa or eager attention, not {impl!r}; load the model with attn_implementation='sdpa'"
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return (
            f"{type(model).__name__} mixes {', '.join(sorted(kinds))} layers, which the compiled cache does not "
            "hold (one buffer per full-attention layer); it decodes eager"
        )
    return None


def compile(model: nn.Module, mode: str | None = None, fullgraph: bool = True) -> nn.Module:  # noqa: A001
    """Compile `model`'s decode steps (in place; returns `model`). `mode`: torch.compile's mode,
    by default "reduce-overhead" (CUDA graphs) on a GPU and inductor's "default" elsewhere.
    InputError (one line) where it cannot; see `compile_problem`."""
    from transformers import CompileConfig

    problem = compile_problem(model)
    if problem is not None:
        raise InputError(problem)
    device = next(model.parameters()).device
    config = CompileConfig(fullgraph=fullgraph, dynamic=False, mode=mode or _default_mode(device))
    if device.type not in ("cuda", "xpu"):
        config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    model.generation_config.compile_config = config
    model.generation_config.cache_implementation = None
    setattr(model, COMPILED_ATTR, True)
    return model


def compile_layers(model: nn.Module) -> int:
    """Compile each decoder layer of the language model (`nn.Module.compile`, dynamic shapes:
    a MoD layer's gathered length changes with the batch) for training steps, where a whole-model
    graph would break at every batch's budgets; routing, gather and gate compile with the upstream
    block they wrap. Returns how many layers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    layers = base.get_decoder().layers
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def compiled(model: nn.Module) -> bool:
    """Whether `vlmod.compile` was applied to `model`."""
    return bool(getattr(model, COMPILED_ATTR, False))


def _default_mode(device: torch.device) -> str:
    return "reduce-overhead" if device.type == "cuda" else "default"


def maybe_compile(model: nn.Module, enabled: bool, warn: Any = None) -> bool:
    """`compile(model)` when `enabled` and possible; where it is not, say why in one line (through
    `warn`, default print) and keep the model eager. Returns whether it compiled."""
    if not enabled:
        return False
    problem = compile_problem(model)
    if problem is not None:
        (warn or print)(f"--compile: {problem}")
        return False
    compile(model)
    return True
