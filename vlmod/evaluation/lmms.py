"""The lmms-eval model `vlmod`: any lmms-eval task on a vlmod checkpoint, converted or dense.

    lmms-eval --model vlmod --model_args pretrained=DIR[,capacity=0.25,router=random] --tasks ...

Registered through the `lmms_eval.models` entry-point group (`manifest`). The checkpoint loads
through `vlmod.load_pretrained`, so a converted checkpoint runs with the MoD layers it was saved
with and a plain one runs dense (the side-by-side); `capacity=` calls `vlmod.set_capacity`,
`router=` calls `vlmod.set_router`. Requests are batched (`--batch_size N`, left padding); visuals
are PIL images or video paths (`max_frames` frames sampled uniformly, `vlmod.data.video`).

Compute figures land in the run's results JSON under `throughput` (lmms-eval prefixes every
figure a model logs with `avg_`): `vlmod_prefill_flops_per_sample` and
`vlmod_dense_prefill_flops_per_sample` (vision tower + language model, `vlmod.tools.flops`; LLaVA
families), their ratio, and `vlmod_vision_tokens_ran` (the mean over MoD layers of the fraction of
image/video tokens the layer ran; 1.0 for a dense model) with one `vlmod_vision_tokens_ran/PART.LAYER`
per layer. For generation they describe the prefill (the first forward of `generate`).

Every `model_args` value is checked before anything loads (`check_model_args`): a bad one stops
the command with one `error:` line and status 2 (`ModelArgsError`), where lmms-eval itself would
print the traceback of any exception a model raises and exit 0.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from lmms_eval.api.model import lmms
from loguru import logger
from tqdm.auto import tqdm

import vlmod
from vlmod.config import DTYPES, ROUTERS, TokenType
from vlmod.errors import InputError, brief
from vlmod.plugins import llava as llava_plugin
from vlmod.tools.cache import generate_cache

MODEL_ID = "vlmod"
MODEL_ARGS = ("pretrained", "capacity", "router", "device", "dtype", "max_frames", "max_new_tokens", "compile")
# What lmms-eval passes beside `--model_args` from its own flags (`--batch_size` always, default 1):
# the same key in `--model_args` is refused (`VLMod.create_from_arg_string`).
RUN_FLAGS = {"batch_size": "--batch_size", "max_batch_size": "--max_batch_size", "device": "--device"}
_VISION = (int(TokenType.IMAGE), int(TokenType.VIDEO))


def manifest() -> Any:
    """The `lmms_eval.models` entry point. It must never raise: one failing entry point stops
    lmms-eval from loading the others."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=f"{__name__}.VLMod")


def _passed_through(result: tuple[float, bool]) -> Any:
    """A loglikelihood result as lmms-eval's evaluator keeps it: 0.7.3 unwraps every response as
    generated text, which turns a (loss, greedy) tuple into its string; a `GenerationResult` holding
    the tuple passes through unchanged."""
    from lmms_eval.api.instance import GenerationResult, unwrap_generation_output

    if isinstance(unwrap_generation_output(result)[0], tuple):
        return result
    return GenerationResult(text=result)  # type: ignore[arg-type]


def pick_device(device: str | None) -> torch.device:
    """The device asked for, or CUDA when there is one and CPU otherwise; a CUDA device on a
    machine without CUDA falls back to CPU with a warning."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        logger.warning(f"vlmod: device {device!r} asked for but CUDA is not available; running on CPU")
        return torch.device("cpu")
    return chosen


class ModelArgsError(SystemExit):
    """A bad `--model_args` value. lmms-eval's `cli_evaluate` catches every `Exception` a model
    raises, prints its traceback and exits 0; this one passes through (a `SystemExit`), so the
    command stops with its one `error:` line and status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _refuse(message: str) -> ModelArgsError:
    import sys

    print(f"error: vlmod model_args: {message}", file=sys.stderr, flush=True)
    return ModelArgsError(message)


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise _refuse(f"{name} must be a positive integer, got {brief(value)}") from None
    if number < 1:
        raise _refuse(f"{name} must be a positive integer, got {brief(value)}")
    return number


def _flag(name: str, value: Any) -> bool:
    """A boolean model arg as lmms-eval passes it (True / "True" / "true" / "1", or False ...)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise _refuse(f"{name} must be true or false, got {brief(value)}")


def check_model_args(
    pretrained: Any, capacity: Any, router: Any, device: Any, dtype: Any, max_frames: Any, max_new_tokens: Any,
    unknown: dict[str, Any],
) -> tuple[float | None, int, int]:
    """Every `model_args` value checked before anything loads, each bad one a `ModelArgsError`
    (printed as one line); returns (capacity, max_frames, max_new_tokens) as numbers."""
    if unknown:
        raise _refuse(f"unknown {', '.join(sorted(unknown))}; accepted: {', '.join(MODEL_ARGS)}")
    if not pretrained:
        raise _refuse("pretrained=DIR is required (a vlmod or Hugging Face checkpoint folder, or a hub id)")
    from vlmod.io.paths import check_model_arg

    local = Path(str(pretrained)).expanduser()
    try:
        if local.exists():
            if not (local / "config.json").is_file():
                raise _refuse(f"pretrained={pretrained} is not a model folder (no config.json)")
        elif str(pretrained).startswith((".", "/", "~")) or str(pretrained).count("/") > 1:
            raise _refuse(f"pretrained={pretrained} does not exist")
        else:
            check_model_arg(str(pretrained), "pretrained=")
    except InputError as e:
        raise _refuse(str(e)) from None
    value = None
    if capacity is not None:
        try:
            value = float(str(capacity))
        except ValueError:
            raise _refuse(f"capacity must be a number in (0, 1], got {brief(capacity)}") from None
        if not 0.0 < value <= 1.0:
            raise _refuse(f"capacity must be in (0, 1] (the fraction of vision tokens a MoD layer runs), got {value:g}")
    if router is not None and str(router) not in ROUTERS:
        raise _refuse(f"router must be one of {', '.join(ROUTERS)}, got {brief(router)}")
    if dtype is not None and str(dtype) != "auto" and str(dtype) not in DTYPES:
        raise _refuse(f"dtype must be auto or one of {', '.join(DTYPES)}, got {brief(dtype)}")
    if device not in (None, "", "auto"):
        try:
            torch.device(str(device))
        except (RuntimeError, ValueError):
            raise _refuse(f"device must be auto, cpu, cuda or cuda:N, got {brief(device)}") from None
    given = [f"{name}={v}" for name, v in (("capacity", capacity), ("router", router)) if v is not None]  # both valid
    if given:
        _check_converted(pretrained, given)
    return value, _positive_int("max_frames", max_frames), _positive_int("max_new_tokens", max_new_tokens)


def _check_converted(pretrained: Any, given: list[str]) -> None:
    """`capacity=` / `router=` (`given`, as passed) change a checkpoint's MoD layers: refuse a dense
    `pretrained`, from its config alone (`vlmod.set_capacity` would raise once it had loaded)."""
    from vlmod.io.hf import load_config

    try:
        converted = bool(getattr(load_config(str(pretrained)), "vlmod", None))
    except (OSError, InputError) as e:
        raise _refuse(str(e).splitlines()[0]) from None
    if not converted:
        drop = " and ".join(g.split("=", 1)[0] + "=" for g in given)
        raise _refuse(f"{', '.join(given)}: pretrained={pretrained} has no MoD layers (a dense checkpoint); convert it "
                      f"first (vlmod convert) or drop {drop}")


class VLMod(lmms):
    """A vlmod checkpoint for lmms-eval; see the module doc."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> VLMod:
        """lmms-eval's constructor from `--model_args`. `batch_size=` there is refused in one line
        naming `--batch_size`: lmms-eval always passes its own (default 1) beside the model args,
        and Python raised "got multiple values for keyword argument" (a traceback, exit 0). So is a
        `device=` given beside `--device` (lmms-eval passes that one only when it is set)."""
        from lmms_eval import utils

        args = utils.simple_parse_args_string(arg_string or "")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        for key, flag in RUN_FLAGS.items():
            if key in args and (key != "device" or key in extra):
                what = "the batch size" if "batch" in key else "the device"
                raise _refuse(f"{key}={args[key]}: give {what} as lmms-eval's {flag} (not in --model_args)")
        return cls(**args, **extra)

    def __init__(
        self,
        pretrained: str | None = None,  # required: check_model_args says so in one line (Python in a traceback)
        capacity: float | None = None,
        router: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str = 1,
        max_frames: int = 8,
        max_new_tokens: int = 256,
        compile: bool | str = False,  # noqa: A002
        max_batch_size: int | None = None,  # lmms-eval passes it; batches are --batch_size
        **unknown: Any,
    ) -> None:
        super().__init__()
        capacity, max_frames, max_new_tokens = check_model_args(
            pretrained, capacity, router, device, dtype, max_frames, max_new_tokens, unknown
        )
        if not str(batch_size).startswith("auto"):
            _positive_int("batch_size", batch_size)
        _flag("compile", compile)  # a bad value refused before anything loads
        from transformers import AutoProcessor

        from vlmod.io.hf import check_finite, loading_kwargs

        self.device = pick_device(device)
        try:  # the checkpoint's own dtype unless dtype= names another; onto a GPU directly
            loading = loading_kwargs(dtype or "auto", self.device)
        except ValueError as e:
            raise ValueError(f"vlmod: model_args {e}") from None
        try:
            self.model = vlmod.load_pretrained(pretrained, **loading)
            check_finite(self.model, pretrained)
        except InputError as e:  # a damaged checkpoint, a family vlmod does not know: also one line
            raise _refuse(str(e)) from None
        try:  # checked against the config already; what only the loaded model tells (attention
            # scoring a family cannot run) is one line too
            if capacity is not None:
                vlmod.set_capacity(self.model, float(capacity))
            if router is not None:
                vlmod.set_router(self.model, str(router))
        except ValueError as e:
            raise _refuse(str(e).splitlines()[0]) from None
        self.model.to(self.device).eval()
        if _flag("compile", compile):
            from vlmod.tools.compile import maybe_compile

            maybe_compile(self.model, True, warn=lambda line: logger.warning(f"vlmod: {line}"))
        self.processor = AutoProcessor.from_pretrained(pretrained)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.tokenizer.padding_side = "left"  # prompts end together: generation and scoring read the last columns
        self.batch_size = 1 if str(batch_size).startswith("auto") else max(1, int(batch_size))
        self.max_frames = int(max_frames)
        self.max_new_tokens = int(max_new_tokens)
        self.mod = bool(vlmod.mod_layers(self.model))
        self.llava = llava_plugin.matches(self.model)
        if not self.llava:  # vlmod.tools.flops reads LLaVA's vision tower (CLIP / SigLIP) and language model
            logger.warning(f"vlmod: prefill FLOPs are counted for LLaVA models, not {type(self.model).__name__}")
        self._stats: dict[str, float] = defaultdict(float)
        self._ran: dict[str, torch.Tensor] = {}  # "part.layer": [vision tokens run, vision tokens]
        self._logged: dict[str, Any] | None = None
        logger.info(f"vlmod: {pretrained} on {self.device}, MoD layers {vlmod.mod_layers(self.model) or 'none (dense)'}")

    # -- inputs --------------------------------------------------------------------------------

    def _inputs(self, batch: list[tuple]) -> tuple[list[str], list[Any], list[Any]]:
        """(prompts, images, videos) of a batch of requests; a request's doc gives PIL images or
        video paths (`doc_to_visual`)."""
        from PIL import Image

        prompts, images, videos = [], [], []
        for args in batch:
            visuals = args[2](self.task_dict[args[4]][args[5]][args[3]]) if len(args) >= 6 and args[2] else []
            imgs = [v.convert("RGB") for v in visuals or [] if isinstance(v, Image.Image)]
            vids = [self._video(v) for v in visuals or [] if isinstance(v, (str, Path))]
            if len(imgs) + len(vids) != len(visuals or []):
                raise TypeError(f"vlmod: task {args[4]} gives visuals other than images and video paths")
            prompts.append(self._prompt(args[0], len(imgs), len(vids)))
            images += imgs
            videos += vids
        return prompts, images, videos

    def _video(self, path: str | Path) -> Any:
        from vlmod.data.collate import to_frame_count
        from vlmod.data.video import load_video, processor_short_side

        if getattr(self.processor, "video_processor", None) is None:
            raise ValueError(f"vlmod: {type(self.model).__name__} takes no video ({path}); use a video checkpoint")
        side = processor_short_side(self.processor)  # frames decoded at the size the processor needs
        return to_frame_count(load_video(path, self.max_frames, short_side=side).frames, self.max_frames)

    def _prompt(self, context: str, n_images: int, n_videos: int) -> str:
        """The user turn through the processor's chat template, ending with the assistant prefix.
        Media placeholders go first unless the task already wrote them into the context."""
        image = getattr(self.processor, "image_token", None) or "<image>"
        video = getattr(self.processor, "video_token", None) or "<video>"
        placed = image in context or video in context
        if getattr(self.processor, "chat_template", None) is None:
            return context if placed else " ".join([image] * n_images + [video] * n_videos + [context])
        content: Any = context
        if not placed:
            content = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": context}]
        messages = [{"role": "user", "content": content}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _encode(self, texts: list[str], images: list[Any], videos: list[Any]) -> dict[str, Any]:
        bos = getattr(self.tokenizer, "bos_token", None)
        kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt", "padding": True,
                                  "add_special_tokens": not (bos and texts[0].startswith(bos))}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = videos
        dtype = next(self.model.parameters()).dtype
        return {
            k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device)) if torch.is_tensor(v) else v
            for k, v in self.processor(**kwargs).items()
        }

    # -- requests ------------------------------------------------------------------------------

    def _run(self, requests: list[Any], key: Any, step: Any, desc: str) -> list[Any]:
        """`step` over batches of at most `batch_size` requests with equal `key(args)`, longest
        context first (the largest batch runs first, so an out-of-memory shows at once)."""
        self._begin()
        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[key(request.args)].append(i)
        out: list[Any] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=desc, disable=self.rank != 0)
        for indices in groups.values():
            indices.sort(key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                for i, result in zip(chunk, step([requests[i].args for i in chunk]), strict=True):
                    out[i] = result
                bar.update(len(chunk))
        bar.close()
        self._report()
        return out

    @torch.inference_mode()
    def generate_until(self, requests: list[Any]) -> list[str]:
        return self._run(requests, lambda args: json.dumps(args[1], sort_keys=True, default=str), self._generate,
                         "vlmod generate")

    @torch.inference_mode()
    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        return self._run(requests, lambda args: "", self._score, "vlmod loglikelihood")

    def _generate(self, batch: list[tuple]) -> list[str]:
        gen = dict(batch[0][1] or {})
        until = gen.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        temperature = float(gen.get("temperature") or 0.0)
        kwargs: dict[str, Any] = {
            "max_new_tokens": int(gen.get("max_new_tokens") or self.max_new_tokens),
            "num_beams": int(gen.get("num_beams") or 1),
            "do_sample": temperature > 0,
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=gen.get("top_p"))
        inputs = self._encode(*self._inputs(batch))
        kwargs.update(generate_cache(self.model, kwargs["max_new_tokens"]))
        with self._trace() as trace:
            began = time.perf_counter()
            ids = self.model.generate(**inputs, **kwargs)
            seconds = time.perf_counter() - began
        new = ids[:, inputs["input_ids"].shape[1]:]
        real = int((new != self.tokenizer.pad_token_id).sum()) if self.tokenizer.pad_token_id is not None else new.numel()
        self._account(inputs, trace.first_step() if trace is not None else None, seconds, real)
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        for stop in until:
            texts = [t.split(stop)[0] if stop else t for t in texts]
        return texts

    def _continuation(self, args: tuple) -> str:
        target = args[1]
        if isinstance(target, str):
            return target
        return str(target(self.task_dict[args[4]][args[5]][args[3]]))

    def _score(self, batch: list[tuple]) -> list[tuple[float, bool]]:
        """(mean NLL of the continuation's tokens given context and visuals, whether greedy decoding
        gives it) per request. lmms-eval's convention: its models return the loss, and its
        multiple-choice scoring picks the choice with the smallest (argmin)."""
        prompts, images, videos = self._inputs(batch)
        fulls = [p + self._continuation(a) for p, a in zip(prompts, batch, strict=True)]
        lengths = [len(self.tokenizer(f, add_special_tokens=False)["input_ids"])
                   - len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for f, p in zip(fulls, prompts, strict=True)]
        inputs = self._encode(fulls, images, videos)
        with self._trace() as trace:
            began = time.perf_counter()
            logits = self.model(**inputs, logits_to_keep=max(lengths) + 1).logits
            seconds = time.perf_counter() - began
        self._account(inputs, trace, seconds, 0)
        ids = inputs["input_ids"]
        scored = []
        for row, n in enumerate(lengths):
            logp = logits[row, -n - 1:-1].float().log_softmax(-1)
            target = ids[row, -n:] if n > 0 else ids[row, :0]
            loss = -logp.gather(-1, target[:, None]).mean() if n > 0 else torch.zeros(())
            scored.append(_passed_through((float(loss), bool((logp.argmax(-1) == target).all()))))
        return scored

    def generate_until_multi_round(self, requests: list[Any]) -> list[str]:
        raise NotImplementedError("vlmod: multi-round generation is not supported")

    # -- compute figures -----------------------------------------------------------------------

    def _trace(self) -> Any:
        return vlmod.trace_routing(self.model) if self.mod else nullcontext()

    def _account(self, inputs: dict[str, Any], trace: Any, seconds: float, new_tokens: int) -> None:
        """Add one batch to the run's figures (routing counts stay on the device until read)."""
        from vlmod.tools.flops import generation_flops

        s, rows = self._stats, inputs["input_ids"].shape[0]
        s["samples"] += rows
        s["seconds"] += seconds
        s["new_tokens"] += new_tokens
        for (part, layer), processed in (trace.processed.items() if trace is not None else ()):
            vision = torch.isin(trace.part_token_types(part), torch.tensor(_VISION, device=processed.device))
            counts = torch.stack([(processed & vision).sum(), vision.sum()])
            key = f"{part}.{layer}"
            self._ran[key] = self._ran[key] + counts if key in self._ran else counts
        if not self.llava:
            return
        mod, dense = generation_flops(self.model, inputs, trace), generation_flops(self.model, inputs, None)
        for part in ("total", "vision", "language"):
            s[f"flops/{part}"] += mod[part] * rows
            s[f"dense_flops/{part}"] += dense[part] * rows

    def summary(self) -> dict[str, float]:
        """The run's compute figures so far (names as in the module doc, without `avg_`)."""
        s, n = self._stats, max(1.0, self._stats["samples"])
        out = {"vlmod_samples": s["samples"], "vlmod_mod_layers": float(len(vlmod.mod_layers(self.model)))}
        fractions = {key: (c[0] / c[1]).item() for key, c in sorted(self._ran.items()) if c[1] > 0}
        out["vlmod_vision_tokens_ran"] = sum(fractions.values()) / len(fractions) if fractions else 1.0
        out.update({f"vlmod_vision_tokens_ran/{key}": v for key, v in fractions.items()})
        if s["flops/total"] > 0:
            out["vlmod_prefill_flops_per_sample"] = s["flops/total"] / n
            out["vlmod_dense_prefill_flops_per_sample"] = s["dense_flops/total"] / n
            out["vlmod_prefill_flops_vs_dense"] = s["flops/total"] / s["dense_flops/total"]
            for part in ("vision", "language"):
                out[f"vlmod_prefill_flops_per_sample/{part}"] = s[f"flops/{part}"] / n
                out[f"vlmod_dense_prefill_flops_per_sample/{part}"] = s[f"dense_flops/{part}"] / n
        return out

    def _begin(self) -> None:
        """A cleared throughput log means a new evaluation: its figures start from zero."""
        from lmms_eval.models.model_utils.gen_metrics import get_logged_metrics_history

        if self._logged is None or not any(m is self._logged for m in get_logged_metrics_history()):
            self._stats, self._ran, self._logged = defaultdict(float), {}, None

    def _report(self) -> None:
        """Put the figures into lmms-eval's throughput log, which its results JSON carries. The run
        keeps one entry, updated in place after every call, so the figures are over all of its
        requests (lmms-eval averages entries, which would weight calls, not samples)."""
        from lmms_eval.models.model_utils.gen_metrics import get_logged_metrics_history, log_metrics

        seconds, tokens, figures = self._stats["seconds"], int(self._stats["new_tokens"]), self.summary()
        speed = tokens / seconds if seconds > 0 else 0.0
        if self._logged is None:
            log_metrics(seconds, tokens, speed, additional_metrics=figures)
            self._logged = get_logged_metrics_history()[-1]
        self._logged.update(total_elapsed_time=seconds, total_gen_tokens=tokens, avg_speed=speed, **figures)
        logger.info("vlmod: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
