"""The lmms-eval model `vlmod`: any lmms-eval task on a vlmod checkpoint, converted or dense.

    lmms-eval --model vlmod --model_args pretrained=DIR[,capacity=0.25,router=random] --tasks ...

Registered through the `lmms_eval.models` entry-point group (`manifest`). The checkpoint loads
through `vlmod.load_pretrained`, so a converted checkpoint runs with the MoD layers it was saved
with and a plain one runs dense (the side-by-side); `capacity=` calls `vlmod.set_capacity`,
`router=` calls `vlmod.set_router`. Requests are batched (`--batch_size N`, left padding); visuals
are PIL images or video paths (`max_frames` frames sampled uniformly, `vlmod.video`).

Compute figures land in the run's results JSON under `throughput` (lmms-eval prefixes every
figure a model logs with `avg_`): `vlmod_prefill_flops_per_sample` and
`vlmod_dense_prefill_flops_per_sample` (vision tower + language model, `vlmod.flops`; LLaVA
families), their ratio, and `vlmod_vision_tokens_ran` (the mean over MoD layers of the fraction of
image/video tokens the layer ran; 1.0 for a dense model) with one `vlmod_vision_tokens_ran/PART.LAYER`
per layer. For generation they describe the prefill (the first forward of `generate`).
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
from vlmod.config import TokenType

MODEL_ID = "vlmod"
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


class VLMod(lmms):
    """A vlmod checkpoint for lmms-eval; see the module doc."""

    def __init__(
        self,
        pretrained: str,
        capacity: float | None = None,
        router: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str = 1,
        max_frames: int = 8,
        max_new_tokens: int = 256,
        max_batch_size: int | None = None,  # lmms-eval passes it; batches are --batch_size
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise TypeError(
                f"vlmod: unknown model_args {sorted(unknown)}; accepted: pretrained, capacity, router, device, "
                "dtype, batch_size, max_frames, max_new_tokens"
            )
        from transformers import AutoProcessor

        from vlmod.hf import check_finite

        self._device = pick_device(device)
        if dtype in (None, "", "auto"):  # the checkpoint's dtype on a GPU; float32 on CPU
            torch_dtype: Any = "auto" if self._device.type == "cuda" else torch.float32
        else:
            torch_dtype = getattr(torch, str(dtype))
        self._model = vlmod.load_pretrained(pretrained, dtype=torch_dtype)
        check_finite(self._model, pretrained)
        if capacity is not None:
            vlmod.set_capacity(self._model, float(capacity))
        if router is not None:
            vlmod.set_router(self._model, str(router))
        self._model.to(self._device).eval()
        self.processor = AutoProcessor.from_pretrained(pretrained)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.tokenizer.padding_side = "left"  # prompts end together: generation and scoring read the last columns
        self.batch_size = 1 if str(batch_size).startswith("auto") else max(1, int(batch_size))
        self.max_frames = int(max_frames)
        self.max_new_tokens = int(max_new_tokens)
        self.mod = bool(vlmod.mod_layers(self._model))
        self._stats: dict[str, Any] = {}
        self._logged: dict[str, Any] | None = None
        logger.info(f"vlmod: {pretrained} on {self._device}, MoD layers {vlmod.mod_layers(self._model) or 'none (dense)'}")

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def device(self) -> torch.device:
        return self._device

    # -- inputs --------------------------------------------------------------------------------

    def _visuals(self, args: tuple) -> tuple[list[Any], list[Any]]:
        """(images, videos) of one request: its doc's visuals, PIL images or video paths."""
        from PIL import Image

        if len(args) < 6 or args[2] is None:
            return [], []
        doc_to_visual, doc_id, task, split = args[2:6]
        images, videos = [], []
        for visual in doc_to_visual(self.task_dict[task][split][doc_id]) or []:
            if isinstance(visual, Image.Image):
                images.append(visual.convert("RGB"))
            elif isinstance(visual, (str, Path)):
                videos.append(self._video(visual))
            else:
                raise TypeError(f"vlmod: task {task} gives a {type(visual).__name__} visual; images and video paths are supported")
        return images, videos

    def _video(self, path: str | Path) -> Any:
        from vlmod.data.collate import _to_frame_count
        from vlmod.video import load_video

        if getattr(self.processor, "video_processor", None) is None:
            raise ValueError(f"vlmod: {type(self._model).__name__} takes no video ({path}); use a video checkpoint")
        return _to_frame_count(load_video(path, self.max_frames).frames, self.max_frames)

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
        dtype = next(self._model.parameters()).dtype
        return {
            k: (v.to(self._device, dtype) if v.is_floating_point() else v.to(self._device)) if torch.is_tensor(v) else v
            for k, v in self.processor(**kwargs).items()
        }

    def _batches(self, requests: list[Any], key: Any) -> Any:
        """Index lists of at most `batch_size` requests with equal `key(args)`, longest context
        first (the largest batch runs first, so an out-of-memory shows at once)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[key(request.args)].append(i)
        for indices in groups.values():
            indices.sort(key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(indices), self.batch_size):
                yield indices[start:start + self.batch_size]

    def _media(self, batch: list[tuple]) -> tuple[list[tuple[int, int]], list[Any], list[Any]]:
        counts, images, videos = [], [], []
        for args in batch:
            imgs, vids = self._visuals(args)
            counts.append((len(imgs), len(vids)))
            images += imgs
            videos += vids
        return counts, images, videos

    # -- requests ------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_until(self, requests: list[Any]) -> list[str]:
        self._begin()
        out: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="vlmod generate", disable=self.rank != 0)
        for indices in self._batches(requests, lambda args: json.dumps(args[1], sort_keys=True, default=str)):
            batch = [requests[i].args for i in indices]
            for i, text in zip(indices, self._generate(batch), strict=True):
                out[i] = text
            bar.update(len(indices))
        bar.close()
        self._report()
        return out

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
        counts, images, videos = self._media(batch)
        inputs = self._encode([self._prompt(a[0], *c) for a, c in zip(batch, counts, strict=True)], images, videos)
        with self._trace() as trace:
            began = time.perf_counter()
            ids = self._model.generate(**inputs, **kwargs)
            seconds = time.perf_counter() - began
        new = ids[:, inputs["input_ids"].shape[1]:]
        real = int((new != self.tokenizer.pad_token_id).sum()) if self.tokenizer.pad_token_id is not None else new.numel()
        self._account(inputs, trace.first_step() if trace is not None else None, seconds, real)
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        for stop in until:
            texts = [t.split(stop)[0] if stop else t for t in texts]
        return texts

    @torch.inference_mode()
    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        self._begin()
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        bar = tqdm(total=len(requests), desc="vlmod loglikelihood", disable=self.rank != 0)
        for indices in self._batches(requests, lambda args: ""):
            for i, scored in zip(indices, self._score([requests[i].args for i in indices]), strict=True):
                out[i] = scored
            bar.update(len(indices))
        bar.close()
        self._report()
        return out

    def _continuation(self, args: tuple) -> str:
        target = args[1]
        if isinstance(target, str):
            return target
        return str(target(self.task_dict[args[4]][args[5]][args[3]]))

    def _score(self, batch: list[tuple]) -> list[tuple[float, bool]]:
        """(mean NLL of the continuation's tokens given context and visuals, whether greedy decoding
        gives it) per request. lmms-eval's convention: its models return the loss, and its
        multiple-choice scoring picks the choice with the smallest (argmin)."""
        counts, images, videos = self._media(batch)
        prompts = [self._prompt(a[0], *c) for a, c in zip(batch, counts, strict=True)]
        fulls = [p + self._continuation(a) for p, a in zip(prompts, batch, strict=True)]
        lengths = [len(self.tokenizer(f, add_special_tokens=False)["input_ids"])
                   - len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for f, p in zip(fulls, prompts, strict=True)]
        inputs = self._encode(fulls, images, videos)
        with self._trace() as trace:
            began = time.perf_counter()
            logits = self._model(**inputs, logits_to_keep=max(lengths) + 1).logits
            seconds = time.perf_counter() - began
        self._account(inputs, trace, seconds, 0)
        ids = inputs["input_ids"]
        scored = []
        for row, n in enumerate(lengths):
            if n <= 0:
                scored.append((0.0, True))
                continue
            logp = logits[row, -n - 1:-1].float().log_softmax(-1)
            target = ids[row, -n:]
            loss = -logp.gather(-1, target[:, None]).mean()
            scored.append(_passed_through((float(loss), bool((logp.argmax(-1) == target).all()))))
        return scored

    def generate_until_multi_round(self, requests: list[Any]) -> list[str]:
        raise NotImplementedError("vlmod: multi-round generation is not supported")

    # -- compute figures -----------------------------------------------------------------------

    def _trace(self) -> Any:
        return vlmod.trace_routing(self._model) if self.mod else nullcontext()

    def _account(self, inputs: dict[str, Any], trace: Any, seconds: float, new_tokens: int) -> None:
        """Add one batch to the run's figures (tensors stay on the device until `_report`)."""
        from vlmod.flops import generation_flops

        s = self._stats
        rows = inputs["input_ids"].shape[0]
        s["samples"] = s.get("samples", 0) + rows
        s["seconds"] = s.get("seconds", 0.0) + seconds
        s["new_tokens"] = s.get("new_tokens", 0) + new_tokens
        if trace is not None:
            types: dict[str, torch.Tensor] = {}
            ran = s.setdefault("ran", {})
            for (part, layer), processed in trace.processed.items():
                if part not in types:
                    types[part] = torch.isin(trace.part_token_types(part), torch.tensor(_VISION, device=processed.device))
                vision = types[part]
                counts = torch.stack([(processed & vision).sum(), vision.sum()])
                key = f"{part}.{layer}"
                ran[key] = ran[key] + counts if key in ran else counts
        if s.get("no_flops"):
            return
        try:
            mod, dense = generation_flops(self._model, inputs, trace), generation_flops(self._model, inputs, None)
        except (AttributeError, KeyError, TypeError) as err:  # counted for LLaVA families only
            s["no_flops"] = True
            logger.warning(f"vlmod: prefill FLOPs are not counted for {type(self._model).__name__} ({err})")
            return
        for name, figures in (("flops", mod), ("dense_flops", dense)):
            for part in ("total", "vision", "language"):
                s[f"{name}/{part}"] = s.get(f"{name}/{part}", 0.0) + figures[part] * rows

    def summary(self) -> dict[str, float]:
        """The run's compute figures so far (names as in the module doc, without `avg_`)."""
        s = self._stats
        n = max(1, s.get("samples", 0))
        out: dict[str, float] = {"vlmod_samples": float(s.get("samples", 0)),
                                 "vlmod_mod_layers": float(len(vlmod.mod_layers(self._model)))}
        fractions = {key: (c[0] / c[1]).item() for key, c in s.get("ran", {}).items() if c[1] > 0}
        values = list(fractions.values())
        out["vlmod_vision_tokens_ran"] = sum(values) / len(values) if values else 1.0
        out.update({f"vlmod_vision_tokens_ran/{key}": v for key, v in sorted(fractions.items())})
        if "flops/total" in s:
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

        if self._logged is not None and not any(m is self._logged for m in get_logged_metrics_history()):
            self._stats, self._logged = {}, None

    def _report(self) -> None:
        """Put the figures into lmms-eval's throughput log, which its results JSON carries. The
        run keeps one entry, updated in place after every call, so the figures are over all of the
        run's requests (lmms-eval averages entries, which would weight calls, not samples)."""
        from lmms_eval.models.model_utils.gen_metrics import get_logged_metrics_history, log_metrics

        s = self._stats
        seconds, tokens = s.get("seconds", 0.0), s.get("new_tokens", 0)
        figures = {"total_elapsed_time": seconds, "total_gen_tokens": tokens,
                   "avg_speed": tokens / seconds if seconds > 0 else 0.0, **self.summary()}
        if self._logged is None:
            log_metrics(seconds, tokens, figures["avg_speed"], additional_metrics=self.summary())
            self._logged = get_logged_metrics_history()[-1]
        self._logged.update(figures)
        logger.info("vlmod: " + ", ".join(f"{k} {v:.4g}" for k, v in self.summary().items()))
