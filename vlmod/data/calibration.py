"""Calibration data for ARank: the prompts and pictures of a LLaVA-format JSON or an image
folder, batched by the model's own processor."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmod.data.llava_format import IMAGE_EXTENSIONS, DataError, list_images, load_image, load_records


@dataclass(frozen=True)
class CalibrationSample:
    """One prompt and its images (none for a text-only record) or its video."""

    id: str
    text: str
    images: tuple[Path, ...] = ()
    video: Path | None = None


def calibration_samples(
    data: str | Path, image_root: str | Path | None = None, prompt: str | None = None
) -> list[CalibrationSample]:
    """The samples of DATA: a LLaVA-format JSON (first human turn of each record; `prompt`, if
    given, replaces it) or a folder of images, each asked `prompt`. A video record feeds its
    clip (8 frames, sampled uniformly)."""
    path = Path(data).expanduser()
    if not path.exists():
        from vlmod.io.paths import not_found

        raise DataError(f"data {path} {not_found(path)}")
    if path.is_dir():
        if not prompt:
            raise DataError(
                f"{path} is a folder of images: give the question to ask about them with --prompt"
            )
        images = list_images(path)
        if not images:
            raise DataError(f"{path} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
        return [CalibrationSample(id=p.name, text=prompt, images=(p,)) for p in images]
    samples = [
        CalibrationSample(
            id=record.id, text=prompt or record.first_question, images=record.images, video=record.video_path
        )
        for record in load_records(path, image_root)
    ]
    if not samples:
        raise DataError(f"{path} holds no usable records")
    return samples


class CalibrationBatches:
    """Processor batches of calibration samples, drawn in a seeded random order (LLaVA mixes are
    sorted by source, so the first N records are not a sample of the mix).

    A sample whose image is missing or unreadable is skipped and counted (`skipped`), and the
    next one takes its place; a warning gives the count at the end. If no sample can be used at
    all, iterating raises `DataError`.
    """

    def __init__(
        self,
        processor: Any,
        samples: Sequence[CalibrationSample],
        batch_size: int = 4,
        num_samples: int | None = None,
        seed: int | None = 0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.processor = processor
        self.samples = list(samples)
        self.batch_size = batch_size
        self.total = len(self.samples) if num_samples is None else min(num_samples, len(self.samples))
        self.seed = seed
        self.used = 0
        self.skipped: list[tuple[str, str]] = []  # (sample id, reason)

    def encode(
        self, samples: Sequence[CalibrationSample], images: Sequence[Any], videos: Sequence[Any] = ()
    ) -> dict[str, Any]:
        """Model inputs for `samples`: the processor's chat template with one image slot per image
        and one video slot per video."""
        texts = []
        for s in samples:
            content = [{"type": "image"} for _ in s.images] + [{"type": "video"}] * (s.video is not None)
            content.append({"type": "text", "text": s.text})
            texts.append(
                self.processor.apply_chat_template(
                    [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
                )
            )
        media = {"videos": list(videos)} if videos else {}
        # Images nested per sample: what every family's processor takes (Gemma 3's requires it).
        flat, nested = list(images), []
        for s in samples:
            nested.append(flat[: len(s.images)])
            flat = flat[len(s.images):]
        return dict(
            self.processor(images=nested if images else None, text=texts, return_tensors="pt", padding=True, **media)
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from PIL import Image

        order = list(range(len(self.samples)))
        if self.seed is not None:
            random.Random(self.seed).shuffle(order)
        self.used, self.skipped = 0, []
        from vlmod.data.video import load_video, processor_short_side

        side = processor_short_side(self.processor)  # frames decoded at the size the processor needs

        pending: list[CalibrationSample] = []
        images: list[Any] = []
        videos: list[Any] = []
        for idx in order:
            if self.used + len(pending) >= self.total:
                break
            sample = self.samples[idx]
            try:
                loaded = [load_image(p) for p in sample.images]
                clip = [load_video(sample.video, short_side=side).frames] if sample.video is not None else []
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
                self.skipped.append((sample.id, f"{type(e).__name__}: {e}"))
                continue
            pending.append(sample)
            images.extend(loaded)
            videos.extend(clip)
            if len(pending) == self.batch_size:
                batch = self.encode(pending, images, videos)
                self.used += len(pending)
                pending, images, videos = [], [], []
                yield batch
        if pending:
            batch = self.encode(pending, images, videos)
            self.used += len(pending)
            yield batch
        if self.skipped:
            first_id, reason = self.skipped[0]
            warnings.warn(
                f"skipped {len(self.skipped)} sample(s) with a missing or unreadable image "
                f"(first: {first_id}: {reason})",
                stacklevel=2,
            )
        if self.used == 0:
            raise DataError(
                f"none of the {len(self.samples)} samples could be used: every image was missing or unreadable"
            )


def calibration_batches(
    processor: Any,
    data: str | Path | Sequence[CalibrationSample],
    *,
    image_root: str | Path | None = None,
    prompt: str | None = None,
    batch_size: int = 4,
    num_samples: int | None = 64,
    seed: int | None = 0,
) -> CalibrationBatches:
    """Processor batches for a LLaVA model from DATA (see `calibration_samples`), ready for
    `rank_layers`; `num_samples` caps how many samples are used (None: all)."""
    samples = (
        data
        if isinstance(data, Sequence) and not isinstance(data, str)
        else calibration_samples(data, image_root=image_root, prompt=prompt)
    )
    return CalibrationBatches(processor, samples, batch_size=batch_size, num_samples=num_samples, seed=seed)



__all__ = ["CalibrationBatches", "CalibrationSample", "calibration_batches", "calibration_samples"]
