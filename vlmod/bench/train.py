"""`bench train`: what one fine-tuning step (forward, backward, AdamW step) of a MoD model costs
against the dense model, on the same weights and batches, set against the training-FLOPs
prediction of `vlmod.tools.training_flops`.

The step is the finetune path's own: batches collated by `LlavaDataset` from synthetic images or
clips with answers (labels on the answer tokens only), what trains chosen by
`vlmod.training.setup` (`set_trainable`, `add_lora`, `make_optimizer`,
`enable_gradient_checkpointing`), the forward under autocast for `mixed_precision: bf16`.

Dense reference of `--trainable router`: a dense model has no router, so it trains its projector
(`set_trainable(..., "lora")` of a model without adapters): the cheapest dense fine-tune whose
gradient still crosses the whole language model, i.e. what a user would otherwise run to adapt a
model to a task for few parameters. The router-only MoD step is cheaper still in backward: its
gradient stops at the lowest MoD layer.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlmod
from vlmod.bench.generation import DEFAULT_CAPACITY, DEFAULT_LAYERS, LLAVA_PRESETS, build_pair
from vlmod.bench.inputs import on_device, parse_layers, prompt_text, synthetic_clip, synthetic_image
from vlmod.bench.report import describe_layers, signed_percent
from vlmod.bench.timing import (
    contention,
    describe_device,
    keeps_threads,
    load_average,
    peak_memory_bytes,
    peak_memory_change,
    set_threads,
    synchronize,
    time_interleaved,
)
from vlmod.bench.train_needs import check_room
from vlmod.bench.video import VIDEO_PRESETS, default_video_layers
from vlmod.errors import InputError, TrainError
from vlmod.io.signals import sigterm_as_interrupt
from vlmod.io.tables import format_table

# The image and video benchmarks' presets (the video "tiny" as "tiny-video").
VIDEO_TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    ("tiny-video" if name == "tiny" else name): settings for name, settings in VIDEO_PRESETS.items()
}
TRAIN_PRESETS: dict[str, dict[str, Any]] = {**LLAVA_PRESETS, **VIDEO_TRAIN_PRESETS}
TRAINABLE = ("full", "router", "lora")
MIXED_PRECISION = ("no", "bf16")
ANSWER_WORDS = 8  # a short answer, as the synthetic recipes' (labels on these tokens only)
VIDEO_FRAMES = 8
# What the dense model trains for each `--trainable`, in `set_trainable`'s words and in
# `training_flops`'s.
# `set_trainable("lora")` of a model without adapters trains its projector.
DENSE_TRAINABLE = {"full": ("full", "full"), "lora": ("lora", "lora"), "router": ("lora", "projector")}


def _is_video(model: str | None, preset: str | None) -> bool:
    if model is None:
        return preset in VIDEO_TRAIN_PRESETS
    from vlmod.io.hf import load_config

    try:
        kind = load_config(model).model_type
    except (OSError, ValueError):
        return False  # build_pair says what is wrong with the checkpoint, in one line
    return "video" in kind or "onevision" in kind


def frozen_dtype(model: str | None, dtype: str | torch.dtype | None, mixed_precision: str) -> str | torch.dtype | None:
    """The dtype the frozen weights load in (`dtype`, None or "auto": the checkpoint's own): bf16
    autocast cannot run float16 weights (torch stops at the first op that meets both), so a float16
    checkpoint (llava-hf's are) loads in bfloat16 for `mixed_precision: bf16`, as `vlmod finetune`
    loads it, and `dtype` float16 with it is refused, before anything loads."""
    from vlmod.io.hf import checkpoint_dtype, load_config, torch_dtype

    if mixed_precision != "bf16":
        return dtype
    wanted = torch_dtype(dtype)
    if wanted == torch.float16:
        raise InputError("--dtype float16 with --mixed-precision bf16: bfloat16 autocast cannot run float16 weights; "
                         "use --dtype bfloat16, auto or float32, or --mixed-precision no")
    if wanted != "auto" or model is None:
        return dtype
    try:
        stored = checkpoint_dtype(load_config(model))
    except (OSError, ValueError):
        return dtype  # build_pair says what is wrong with the checkpoint, in one line
    return torch.bfloat16 if stored == torch.float16 else dtype


def synthetic_batch(processor: Any, size: int, batch: int, words: int, video: bool, directory: Path) -> dict[str, Any]:
    """One training batch of `batch` rows as the finetune path makes it: LLaVA-format records
    (a synthetic image or clip, a question of `words` words, an answer) read by `LlavaDataset`
    and collated by it. Every row has the same length, so no padding."""
    from vlmod.data import LlavaDataset

    records = []
    for i in range(batch):
        if video:
            media = {"video": synthetic_clip(directory / f"clip{i}.mp4", seconds=1.0, size=(size, size), seed=i).name}
            tag = "<video>"
        else:
            synthetic_image(size, i).save(directory / f"image{i}.png")
            media, tag = {"image": f"image{i}.png"}, "<image>"
        records.append({
            "id": str(i), **media,
            "conversations": [
                {"from": "human", "value": f"{tag}\n{prompt_text(words)}"},
                {"from": "gpt", "value": " ".join(reversed(prompt_text(ANSWER_WORDS).split()))},
            ],
        })
    dataset = LlavaDataset(records, processor, image_root=directory, strict=True, num_frames=VIDEO_FRAMES)
    return dataset.collate([dataset[i] for i in range(batch)])


def own_outside_towers(model: nn.Module) -> None:
    """Give `model` its own copy of every parameter outside the vision tower and language model
    (projector, image_newline): the dense twin shares its weights with the MoD model, and a
    shared tensor shares `requires_grad` too, so the dense reference could not train its projector
    while the MoD model trains only its routers."""
    for prefix, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            full = f"{prefix}.{name}"
            if not any(part in full for part in ("vision_tower", "language_model", "lm_head")):
                setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def prepare_training(
    model: nn.Module, trainable: str, adapters: bool, gradient_checkpointing: bool, seed: int
) -> tuple[nn.Module, Any, dict[str, int]]:
    """(model, AdamW, trainable parameters per group) as `vlmod.training.setup.prepare` makes
    them: checkpointing, LoRA adapters (`adapters`), what trains (`set_trainable`'s `trainable`),
    float32 master weights, the optimizer."""
    from vlmod.training.config import TrainConfig
    from vlmod.training.setup import (
        add_lora,
        cast_trainable,
        drop_input_grads,
        enable_gradient_checkpointing,
        make_optimizer,
        set_trainable,
    )

    cfg = TrainConfig(model="bench", data="bench", output_dir="bench", trainable=trainable, seed=seed)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if adapters:
        model = add_lora(model, cfg)  # from `seed`: the same adapter weights in the dense and the MoD model
    if gradient_checkpointing:
        drop_input_grads(model)  # as `vlmod finetune` does
    groups = set_trainable(model, trainable)
    cast_trainable(model, torch.float32)
    model.train()
    return model, make_optimizer(model, cfg), groups


def autocast_to(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`, or nothing when `dtype` is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class TrainingStep:
    """One optimizer step on `batch`: forward (under autocast to `autocast` unless None), backward,
    AdamW, gradients dropped (so each step allocates them, as a fine-tune's does). Gradients are
    turned back on inside: the timers run their functions under inference mode.

    `optimizer_s` notes each call's AdamW update, timed apart (waiting for the device): the FLOPs
    prediction leaves it out, and it costs the same in both models (memory-bound, O(parameters)),
    so it is what the step's efficiency is measured with and without."""

    def __init__(self, model: nn.Module, batch: dict[str, Any], optimizer: Any, autocast: torch.dtype | None):
        from vlmod.training.logits import answer_logits_inputs

        self.model, self.optimizer, self.autocast = model, optimizer, autocast
        self.batch = {**batch, **answer_logits_inputs(model, batch)}  # logits where the loss reads them, as finetune
        self.device = next(model.parameters()).device
        self.optimizer_s: list[float] = []

    def __call__(self) -> None:
        with torch.inference_mode(False), torch.enable_grad():
            with autocast_to(self.device, self.autocast):
                loss = self.model(**self.batch, use_cache=False).loss
            loss.backward()
            synchronize(self.device)
            start = time.perf_counter()
            self.optimizer.step()
            synchronize(self.device)
            self.optimizer_s.append(time.perf_counter() - start)
            self.optimizer.zero_grad(set_to_none=True)



def _check(trainable: str, mixed_precision: str, batch: int, warmup: int, repeats: int,
           capacity: float | None, layers: str | Sequence[int] | None) -> None:
    if trainable not in TRAINABLE:
        raise ValueError(f"trainable must be one of {', '.join(TRAINABLE)}, got {trainable!r}")
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, got {mixed_precision!r}")
    if batch < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need batch >= 1, repeats >= 1 and warmup >= 0, got {batch}, {repeats} and {warmup}")
    if capacity is not None or layers is not None:
        vlmod.MoDConfig(capacity=DEFAULT_CAPACITY if capacity is None else capacity,
                        layers=parse_layers(DEFAULT_LAYERS if layers is None else layers))


@keeps_threads
def bench_train(
    model: str | None = None,
    preset: str | None = "llava-1.5",
    trainable: str = "full",
    capacity: float | None = None,
    layers: str | Sequence[int] | None = None,
    batch: int = 1,
    gradient_checkpointing: bool = False,
    mixed_precision: str = "no",
    warmup: int = 1,
    repeats: int = 5,
    threads: int | None = None,
    progress: bool = True,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compile: bool = False,  # noqa: A002
) -> dict[str, Any]:
    """Dense vs MoD training steps of a LLaVA model (or a preset's shapes with random weights).

    capacity / layers: how to convert a preset or a plain checkpoint (None: 0.5, and every other
    layer for an image model, every layer but the first two and the last for a video model); a
    checkpoint saved converted is measured with its own (`build_pair`). trainable: "full" |
    "lora" | "router" (the dense reference of "router" trains its projector: see the module doc).
    device / dtype: where both models train and the dtype of their frozen weights (None: the
    checkpoint's or preset's own); what trains is float32, and a bfloat16 / float16 model runs its
    forward under autocast in that dtype, as `vlmod finetune` does. compile: each decoder layer of
    both models compiled (`vlmod.tools.compile.compile_layers`), the first step's time reported.
    """
    from vlmod.tools.training_flops import training_flops

    try:
        _check(trainable, mixed_precision, batch, warmup, repeats, capacity, layers)
        num_threads = set_threads(threads)
    except ValueError as e:
        raise InputError(str(e)) from e
    if model is None and preset not in TRAIN_PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(TRAIN_PRESETS)}")
    video = _is_video(model, preset)
    try:
        dtype = frozen_dtype(model, dtype, mixed_precision)
    except ValueError as e:  # an unknown dtype name
        raise InputError(str(e)) from None
    torch.manual_seed(seed)
    dense, mod, processor, words, mod_source = build_pair(
        model, preset, TRAIN_PRESETS, capacity, layers, default_video_layers if video else DEFAULT_LAYERS,
        device=device, dtype=dtype,
    )
    frozen = next(dense.parameters()).dtype
    if model is not None:
        words = 35 if video else 60
    size = dense.config.vision_config.image_size
    dense_mode, dense_flops_mode = DENSE_TRAINABLE[trainable]
    if trainable == "router":
        own_outside_towers(dense)
    autocast = torch.bfloat16 if mixed_precision == "bf16" else (None if frozen == torch.float32 else frozen)
    # A kill (SIGTERM) unwinds as Ctrl-C does: the temp folder and its pictures go with it.
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="vlmod-bench-train-") as tmp:
        check_room(  # the batch's files and the training memory, before any of it is made
            {"dense": (dense, dense_mode), "mod": (mod, trainable)},
            lambda rows, folder: synthetic_batch(processor, size, rows, words, video, folder), batch, Path(tmp),
            autocast or torch.float32, gradient_checkpointing, device,
        )
        inputs = on_device(synthetic_batch(processor, size, batch, words, video, Path(tmp)), dense)
    try:
        lora = trainable == "lora"
        dense, dense_opt, dense_groups = prepare_training(dense, dense_mode, lora, gradient_checkpointing, seed)
        mod, mod_opt, mod_groups = prepare_training(mod, trainable, lora, gradient_checkpointing, seed)
    except TrainError as e:
        raise InputError(str(e)) from None
    # The trace forward runs as the steps do: the trained weights are float32 master weights now.
    with torch.no_grad(), autocast_to(torch.device(device), autocast), vlmod.trace_routing(mod) as trace:
        mod(**inputs, use_cache=False)
    settings = dict(gradient_checkpointing=gradient_checkpointing)
    steps = {
        "dense": TrainingStep(dense, inputs, dense_opt, autocast), "mod": TrainingStep(mod, inputs, mod_opt, autocast)
    }
    flops = {
        "dense": training_flops(dense, steps["dense"].batch, None, dense_flops_mode, **settings),
        "mod": training_flops(mod, steps["mod"].batch, trace, trainable, **settings),
    }
    first_call = None
    if compile:
        from vlmod.tools.compile import compile_layers

        first_call = {}
        for name, model_ in (("dense", dense), ("mod", mod)):
            compile_layers(model_)
            start = time.perf_counter()
            steps[name]()
            synchronize(torch.device(device))
            first_call[name] = time.perf_counter() - start
            steps[name].optimizer_s.clear()
    timings = time_interleaved(steps, warmup=max(warmup, 1), repeats=repeats,
                               progress="train step dense/MoD" if progress else None, device=device)
    judged = contention(timings)
    peaks = {name: peak_memory_bytes(step, device) for name, step in steps.items()}
    tokens = int(inputs["attention_mask"].sum())
    result: dict[str, Any] = {}
    warm = max(warmup, 1)  # `time_interleaved` made these calls first; the repeats follow, then the peaks'
    for name, groups in (("dense", dense_groups), ("mod", mod_groups)):
        step_s = timings[name].median(judged.clean_repeats)
        result[name] = {
            "step_s": step_s,
            "optimizer_s": statistics.median(steps[name].optimizer_s[warm + r] for r in judged.clean_repeats),
            "tokens_per_s": tokens / step_s,
            "peak_memory_bytes": peaks[name],
            "flops": flops[name]["total"] * batch,
            "flops_causal_attention": flops[name]["total_causal"] * batch,
            "flops_split": {k: v * batch for k, v in flops[name].items()},
            "trainable_parameters": groups,
            "step_samples_s": timings[name].wall_s,
        }
    result.update(step_speedups(result))
    result["compile"] = None if first_call is None else {"first_call_s": first_call}
    result["skipped_token_share"] = skipped_token_share(trace, inputs, dense.config.text_config.num_hidden_layers)
    base = mod.get_base_model() if hasattr(mod, "get_base_model") else mod
    media = int((inputs["input_ids"][0] == (dense.config.video_token_id if video else dense.config.image_token_id)).sum())
    result.update(
        benchmark="train",
        model=model or f"preset:{preset}",
        batch=batch,
        trainable=trainable,
        dense_trainable="projector" if trainable == "router" else trainable,
        gradient_checkpointing=gradient_checkpointing,
        mixed_precision=mixed_precision,
        device=describe_device(torch.device(device)),
        dtype=str(frozen).removeprefix("torch."),
        mod_layers={f"{p}:{i}": c for (p, i), c in vlmod.mod_layers(base).items()},
        mod_source=mod_source,
        media_tokens=media,
        text_tokens=int(inputs["attention_mask"][0].sum()) - media,
        answer_tokens=int((inputs["labels"][0] != -100).sum()),
        language_layers=dense.config.text_config.num_hidden_layers,
        contended=judged.contended,
        contention={"step": judged.as_dict()},
        timed_repeats=judged.clean_repeats,
        repeats=repeats,
        warmup=max(warmup, 1),
        torch=torch.__version__,
        threads=num_threads,
        load_average=load_average(),
    )
    return result


def skipped_token_share(trace: Any, inputs: dict[str, Any], layers: int) -> float:
    """The share of (token, language layer) pairs MoD skips: the share of the language blocks'
    activations a MoD step need not keep, what its peak memory saving is held against."""
    from vlmod.tools.flops import processed_counts

    tokens = float(inputs["attention_mask"].sum(1, dtype=torch.float64).mean())
    counts = processed_counts(trace.processed, "language")
    return sum(tokens - n for n in counts.values()) / (tokens * layers)


def step_speedups(result: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Measured step speedup (dense ms / MoD ms) against both FLOPs predictions, and the change
    in peak memory, MoD over dense; with each model's AdamW update timed apart (`optimizer_s`),
    also the speedup and efficiency of the rest of the step, what the prediction counts."""
    d, m = result["dense"], result["mod"]
    predicted = d["flops"] / m["flops"]
    causal = d["flops_causal_attention"] / m["flops_causal_attention"]
    speedup = d["step_s"] / m["step_s"]
    peak = peak_memory_change(d, m)
    figures = {
        "predicted_step_speedup": predicted,
        "step_speedup": speedup,
        "step_efficiency": speedup / predicted,
        "predicted_step_speedup_causal_attention": causal,
        "step_efficiency_causal_attention": speedup / causal,
        "peak_memory_change": peak,
    }
    if d.get("optimizer_s") is not None and m.get("optimizer_s") is not None:
        without = (d["step_s"] - d["optimizer_s"]) / (m["step_s"] - m["optimizer_s"])
        figures.update(step_speedup_without_optimizer=without, step_efficiency_without_optimizer=without / predicted)
    return figures


def _without_optimizer(result: dict[str, Any]) -> str:
    if "step_efficiency_without_optimizer" not in result:
        return ""
    d, m = (result[n]["optimizer_s"] * 1e3 for n in ("dense", "mod"))
    return (
        f"  without the AdamW update (timed apart, not in the prediction: dense {d:.1f} ms, MoD {m:.1f} ms): "
        f"measured {result['step_speedup_without_optimizer']:.3f}x  efficiency "
        f"{result['step_efficiency_without_optimizer']:.3f}\n"
    )


def format_train_result(result: dict[str, Any]) -> str:
    """The plain-text report of `bench_train`."""
    rows = []
    for name, label in (("dense", "dense"), ("mod", "MoD")):
        r = result[name]
        peak = r["peak_memory_bytes"]
        rows.append([
            label, f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.1f}",
            "-" if peak is None else f"{peak / 2**20:.1f}", f"{r['flops'] / 1e9:.2f}",
            f"{sum(r['trainable_parameters'].values()):,}",
        ])
    trains = result["trainable"] + ("" if result["dense_trainable"] == result["trainable"]
                                    else f" (dense reference: {result['dense_trainable']})")
    threads = "" if result["device"] != "cpu" else f", {result['threads']} threads"
    header = (
        f"{result['model']}: batch {result['batch']}, {result['media_tokens']} vision + {result['text_tokens']} text "
        f"tokens per sequence ({result['answer_tokens']} answer), MoD: {describe_layers(result['mod_layers'])} of "
        f"{result['language_layers']} language layers ({result['mod_source']}); trains {trains}, "
        f"gradient checkpointing {'on' if result['gradient_checkpointing'] else 'off'}, mixed precision "
        f"{result['mixed_precision']}; {result['device']} {result['dtype']}, torch {result['torch']}"
        f"{threads}, median of "
        f"{len(result['timed_repeats'])}/{result['repeats']} repeats"
    )
    table = format_table(["model", "step ms", "tokens/s", "peak MiB", "GFLOPs/step", "trainable params"], rows)
    peak = result["peak_memory_change"]
    summary = (
        f"predicted step speedup {result['predicted_step_speedup']:.3f}x  measured {result['step_speedup']:.3f}x  "
        f"efficiency {result['step_efficiency']:.3f}\n"
        f"  attention counted as a causal kernel computes it: predicted "
        f"{result['predicted_step_speedup_causal_attention']:.3f}x  efficiency "
        f"{result['step_efficiency_causal_attention']:.3f}\n"
        + _without_optimizer(result)
        + f"peak memory of a step (above weights and optimizer state): {'-' if peak is None else signed_percent(peak)}; "
        f"MoD skips {100 * result['skipped_token_share']:.1f}% of the language layers' token activations"
    )
    if result.get("compile"):
        first = result["compile"]["first_call_s"]
        summary += (
            f"\ndecoder layers compiled (dynamic shapes); what compiling cost, the first step of each: "
            f"dense {first['dense']:.1f} s, MoD {first['mod']:.1f} s"
        )
    lines = [header, table, summary]
    c = result["contention"]["step"]
    if c["contended"]:
        lines.append(f"warning: step figures are unreliable: {c['reason']}; rerun on an idle machine.")
    return "\n".join(lines)


__all__ = [
    "DENSE_TRAINABLE",
    "MIXED_PRECISION",
    "TRAINABLE",
    "TRAIN_PRESETS",
    "TrainingStep",
    "bench_train",
    "format_train_result",
    "frozen_dtype",
    "prepare_training",
    "step_speedups",
    "synthetic_batch",
]
