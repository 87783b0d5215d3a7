"""`LlavaDataset`: LLaVA-format records as the inputs and answer-only labels a model trains on.

Each record's conversation goes through the processor's own chat template (`vlmod.data.chat`), so
the prompt is the one the model was trained with; the processor expands the image/video
placeholders and makes the pixel tensors, and `labels` hold the token ids of the assistant turns
only (-100 everywhere else). That last part also decides the MoD token types: the LLaVA plugin
marks RESPONSE where labels != -100, and the rest of the text stays INSTRUCTION, which is never
skipped.

Labels come from the template, not from guessing its format. For each assistant turn the
conversation up to it is rendered with `add_generation_prompt=True` (the prefix) and with the
turn itself; the tokens between the two renderings are the answer, including whatever the
template emits to close the turn (an end-of-turn token), so the model learns to stop. When a
template tokenizes the prefix differently inside the full text (a merge across the boundary),
the answer is located by character offsets instead; when even that fails, `DataError` says so.

A missing or unreadable image or video skips its record (counted in `dataset.skipped`, with a
warning) or, with `strict=True`, raises `DataError`. For generation-based evaluation,
`prompt_inputs` gives the prompt alone (generation prompt appended) and the reference answer.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vlmod.data.answers import IGNORE_INDEX
from vlmod.data.chat import last_assistant, message_text, to_messages
from vlmod.data.collate import collate, to_frame_count
from vlmod.data.llava_format import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    DataError,
    LlavaRecord,
    check_regular_file,
    load_image,
    load_records,
    parse_record,
)


def _media_errors() -> tuple[type[BaseException], ...]:
    """What loading a broken image or video raises: OSError (missing, truncated, not an image),
    ValueError (`VideoError`, a corrupt video) and PIL's decompression-bomb guard."""
    from PIL import Image

    return (OSError, ValueError, Image.DecompressionBombError)


class FrameCountError(DataError):
    """`num_frames` is more than a clip has, by so much that repeating its frames is over the
    pixel budget of a clip: the setting is wrong, not the clip."""


@dataclass(frozen=True)
class SkippedRecord:
    """A record left out because its image or video could not be loaded."""

    id: str
    path: str
    reason: str


class PromptInputs(NamedTuple):
    """One evaluation prompt: `inputs` in dataset-item form (batch with `collate`), the
    reference `answer` and the record `id`."""

    inputs: dict[str, Tensor]
    answer: str
    id: str


@dataclass
class _TextEncoding:
    text: str
    add_special_tokens: bool
    ids: list[int]
    answer_mask: list[bool]


class LlavaDataset(torch.utils.data.Dataset):
    """LLaVA-format records as training items for `processor`'s model (see the module doc).

    records: a `.json`/`.jsonl` path, `LlavaRecord`s, or raw record dicts.
    image_root: folder the image/video paths are relative to (default: the JSON's folder for a
        path, the working directory for raw dicts).
    strict: raise `DataError` on a missing or unreadable image/video instead of skipping it.
    num_frames: frames sampled uniformly from each video.
    verify: load every image/video once now, so the skips are known (and `len`) before training.
        Without it, media are only checked to exist, and a record that fails to load later is
        counted then (in the process that reads it: a DataLoader worker keeps its own count) and
        replaced by the next one.
    cache: keep each file's decoded media, each item and each evaluation's item and prompt
        (`eval_inputs`) after its first read, so the check when the set is read decodes each file
        once for everything after it and later epochs (or the next model evaluated) skip decoding
        and the processor (small sets such as the synthetic one; memory grows with the set).
    max_tokens: the model's positions: a record whose text alone is longer is refused now, in
        one `DataError` line, before any work (a 1 MB question would otherwise keep a model busy
        for minutes). None: not checked.

    Items: `input_ids`, `attention_mask`, `labels` (1-D) and the processor's media tensors;
    batch them with `dataset.collate`.
    """

    def __init__(
        self,
        records: str | Path | Sequence[LlavaRecord | dict[str, Any]],
        processor: Any,
        image_root: str | Path | None = None,
        strict: bool = False,
        *,
        num_frames: int = 8,
        verify: bool = True,
        cache: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        if isinstance(records, (str, Path)):
            parsed = load_records(records, image_root)
            source = str(records)
            self.image_root = Path(image_root if image_root is not None else Path(records).parent).expanduser()
        else:
            self.image_root = Path(image_root).expanduser() if image_root is not None else Path.cwd()
            parsed = [
                r if isinstance(r, LlavaRecord) else parse_record(r, i, self.image_root) for i, r in enumerate(records)
            ]
            source = "data"
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        if getattr(processor, "chat_template", None) is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise DataError("the processor has no chat template, so prompts cannot be built; set processor.chat_template")
        self.strict = strict
        self.num_frames = num_frames
        from vlmod.data.video import processor_short_side

        self._frame_side = processor_short_side(processor)  # frames are decoded at the size the processor needs
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
            # refused once, as the setting it is, not once a record as an unreadable video
            raise DataError(f"num_frames must be a whole number >= 1 (frames sampled from each clip), got "
                            f"{num_frames!r}")
        self.padding_side = getattr(self.tokenizer, "padding_side", "left") or "left"
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (getattr(self.tokenizer, "eos_token_id", None) or 0))
        self.media_token_ids = {
            int(t) for t in (self._token_id(IMAGE_TOKEN, "image_token"), self._token_id(VIDEO_TOKEN, "video_token"))
            if t is not None
        }
        self.skipped: list[SkippedRecord] = []
        self._text_cache: dict[int, tuple[LlavaRecord, _TextEncoding]] = {}
        self.cache = cache
        self._item_cache: dict[int, dict[str, Tensor]] = {}
        self._eval_cache: dict[int, tuple[LlavaRecord, dict[str, Tensor], PromptInputs]] = {}
        self._media_cache: dict[tuple[Path, ...], tuple[list[Any], list[Any]]] = {}
        for r in parsed:
            last_assistant(to_messages(r), r.id)  # a malformed record is an error, not a skip
            if max_tokens is not None:
                self._check_length(r, max_tokens, source)
        self.records: list[LlavaRecord] = []
        for r in parsed:
            try:
                if verify:
                    self._load_media(r)
                else:
                    for p in self._media_paths(r):
                        check_regular_file(p, "image/video")
            except FrameCountError:
                raise  # the setting: every clip as short would be skipped
            except _media_errors() as e:
                self._skip(r, e)
                continue
            self.records.append(r)
        if self.skipped:
            first = self.skipped[0]
            warnings.warn(
                f"{source}: skipped {len(self.skipped)} of {len(parsed)} records with a missing or unreadable "
                f"image/video (first: {first.id}: {first.reason}); dataset.skipped lists them",
                stacklevel=2,
            )
        if not self.records:
            raise DataError(f"{source} holds no usable records ({len(self.skipped)} skipped)")

    # -- media ---------------------------------------------------------------------------------

    def _clip(self, path: Path) -> Any:
        """The clip's `num_frames` frames (`to_frame_count` repeats a shorter clip's). A clip is not
        broken for being shorter than asked: FrameCountError (the setting, not the clip) only when
        repeating its frames that many times is over a clip's pixel budget."""
        from vlmod.data.video import MAX_CLIP_PIXELS, load_video

        frames = load_video(path, self.num_frames, short_side=self._frame_side).frames
        n, (have, height, width) = self.num_frames, frames.shape[:3]
        if have < n and n * height * width > MAX_CLIP_PIXELS:
            raise FrameCountError(f"num_frames {n:,} is more than {path} has ({have}): repeated to {n:,}, its "
                                  f"{width}x{height} frames are over the {MAX_CLIP_PIXELS:,}-pixel budget of a clip; "
                                  f"set num_frames to at most {max(have, MAX_CLIP_PIXELS // (height * width)):,}")
        return to_frame_count(frames, n)

    def _token_id(self, token: str, attr: str) -> int | None:
        tok = getattr(self.processor, attr, None) or token
        tid = self.tokenizer.convert_tokens_to_ids(tok)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        return None if tid is None or (unk is not None and tid == unk) else tid

    @staticmethod
    def _media_paths(record: LlavaRecord) -> list[Path]:
        return list(record.images) + ([record.video_path] if record.video_path is not None else [])

    def _load_media(self, record: LlavaRecord) -> tuple[list[Any], list[Any]]:
        """(images, videos) of `record`; with `cache`, each file set decoded once for the dataset's
        life: the check when the set is read, the training items and the evaluation prompts of
        every record showing it (a clip asked about and captioned) share one decoding."""
        key = tuple(self._media_paths(record))
        if key in self._media_cache:
            return self._media_cache[key]
        images = [load_image(p) for p in record.images]
        videos = [self._clip(record.video_path)] if record.video_path is not None else []
        if self.cache:
            self._media_cache[key] = images, videos
        return images, videos

    def _skip(self, record: LlavaRecord, error: BaseException) -> None:
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        if self.strict:
            raise DataError(f"record {record.id!r}: cannot load its image/video: {reason}") from None
        paths = self._media_paths(record)
        self.skipped.append(SkippedRecord(id=record.id, path=str(paths[0]) if paths else "", reason=reason))

    # -- text ----------------------------------------------------------------------------------

    def _check_length(self, record: LlavaRecord, max_tokens: int, source: str) -> None:
        """DataError when the record's conversation is more tokens than the model has positions.
        Only a conversation of more UTF-8 bytes than `max_tokens` is tokenized: a token covers at
        least one byte, so shorter ones fit (the usual case costs no tokenizing)."""
        size = sum(len(turn["value"].encode("utf-8")) for turn in record.conversations)
        if size <= max_tokens:
            return
        tokens = len(self._encode_text(record).ids)
        if tokens > max_tokens:
            raise DataError(
                f"{source}: record {record.id!r} is {tokens:,} text tokens, more than the model's {max_tokens:,} "
                "positions; shorten it or leave the record out"
            )

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _add_special(self, text: str) -> bool:
        """Whether tokenizing `text` should add special tokens: not when the template already
        starts with BOS (what `processor.apply_chat_template(tokenize=True)` does too)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        return not (bos and text.startswith(bos))

    def _tokenize(self, text: str, add_special: bool, offsets: bool = False) -> tuple[list[int], list | None]:
        if offsets and getattr(self.tokenizer, "is_fast", False):
            enc = self.tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
            return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"]), None

    def _answer_span(self, full: str, prefix: str, upto: str, answer: str, cursor: int, record_id: str) -> tuple[int, int]:
        """Character span of an assistant turn in the rendered conversation, when tokens of the
        prefix rendering do not line up with the full one."""
        if full.startswith(prefix) and full.startswith(upto) and len(upto) > len(prefix):
            return len(prefix), len(upto)
        # The answer follows whatever the prompt and the conversation share (earlier turns, the
        # question): searching from there keeps a word of the question from being taken for it.
        shared = len(os.path.commonprefix([prefix, full]))
        start = full.find(answer, max(cursor, shared)) if answer else -1
        if start < 0:
            raise DataError(
                f"record {record_id!r}: cannot find the answer {answer[:60]!r} in the text the chat template "
                "renders, so its labels cannot be computed; check the processor's chat template"
            )
        end = start + len(answer)
        eos = getattr(self.tokenizer, "eos_token", None)
        rest = full[end:]
        if eos and rest.lstrip().startswith(eos):
            end += len(rest) - len(rest.lstrip()) + len(eos)
        return start, end

    def _encode_text(self, record: LlavaRecord) -> _TextEncoding:
        """The rendered conversation (through its last answer), its token ids before media
        expansion and which of them are answer tokens."""
        cached = self._text_cache.get(id(record))
        if cached is not None and cached[0] is record:
            return cached[1]
        messages = to_messages(record)
        messages = messages[: last_assistant(messages, record.id) + 1]
        full = self._render(messages, False)
        add_special = self._add_special(full)
        ids, offsets = self._tokenize(full, add_special, offsets=True)
        mask = [False] * len(ids)
        cursor = 0
        for t, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self._render(messages[:t], True)
            upto = self._render(messages[: t + 1], False)
            answer = message_text(message)
            if upto.startswith(prefix) and answer.strip() not in upto[len(prefix):]:
                raise DataError(
                    f"record {record.id!r}: cannot find the answer {answer[:60]!r} in what the chat template "
                    "renders for its turn, so its labels cannot be computed; check the processor's chat template"
                )
            p_ids, _ = self._tokenize(prefix, add_special)
            u_ids, _ = self._tokenize(upto, add_special)
            if len(p_ids) < len(u_ids) and u_ids[: len(p_ids)] == p_ids and ids[: len(u_ids)] == u_ids:
                mask[len(p_ids): len(u_ids)] = [True] * (len(u_ids) - len(p_ids))
                cursor = len(upto) if full.startswith(upto) else cursor
                continue
            if offsets is None:
                raise DataError(
                    f"record {record.id!r}: the chat template's prompt does not tokenize as a prefix of the "
                    "conversation, and a slow tokenizer gives no offsets to locate the answer; use a fast tokenizer"
                )
            start, end = self._answer_span(full, prefix, upto, answer, cursor, record.id)
            hit = [k for k, (a, b) in enumerate(offsets) if b > a and a < end and b > start]
            if not hit:
                raise DataError(f"record {record.id!r}: no token covers answer turn {t} of the rendered conversation")
            for k in hit:
                mask[k] = True
            cursor = end
        enc = _TextEncoding(text=full, add_special_tokens=add_special, ids=ids, answer_mask=mask)
        self._text_cache[id(record)] = (record, enc)
        return enc

    def _labels(self, enc: _TextEncoding, input_ids: Tensor, record_id: str) -> Tensor:
        """Answer mask of the unexpanded tokens carried over to the processor's ids, where each
        image/video placeholder became a run of media tokens."""
        expanded = input_ids.tolist()
        labels = [IGNORE_INDEX] * len(expanded)
        i = 0
        for j, tok in enumerate(expanded):
            if i < len(enc.ids) and tok == enc.ids[i]:
                if enc.answer_mask[i]:
                    labels[j] = tok
                i += 1
            elif not self._inserted(tok):
                break
        else:
            if i == len(enc.ids):
                return torch.tensor(labels, dtype=torch.long)
        raise DataError(
            f"record {record_id!r}: the processor's input_ids differ from the tokenized chat template by more "
            "than the expanded image/video tokens, so the answer tokens cannot be located"
        )

    def _inserted(self, token: int) -> bool:
        """Whether the processor may have inserted `token` when it expanded a media placeholder:
        the image / video tokens, and the special or whitespace tokens some families put around
        them (InternVL's `<img>` / `</img>`, Gemma 3's begin / end of image and blank lines)."""
        if token in self.media_token_ids or token in self._special_ids:
            return True
        return not self.tokenizer.decode([token]).strip()

    @property
    def _special_ids(self) -> frozenset[int]:
        if not hasattr(self, "_special_id_set"):
            self._special_id_set = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        return self._special_id_set

    def _process(self, text: str, add_special: bool, images: list[Any], videos: list[Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"text": text, "return_tensors": "pt", "add_special_tokens": add_special}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = videos
        return dict(self.processor(**kwargs))

    @staticmethod
    def _item(out: dict[str, Any]) -> dict[str, Tensor]:
        ids = out["input_ids"]
        item = {"input_ids": ids[0], "attention_mask": out["attention_mask"][0]}
        for key, value in out.items():
            if key not in item and isinstance(value, Tensor):
                # Per-token outputs (token types) are 1-D like the text; media keep their batch dim.
                item[key] = value[0] if value.shape == ids.shape and not value.is_floating_point() else value
        return item

    def encode(self, record: LlavaRecord, media: tuple[list[Any], list[Any]] | None = None) -> dict[str, Tensor]:
        """One record as a training item (loads its media unless given)."""
        images, videos = media if media is not None else self._load_media(record)
        enc = self._encode_text(record)
        out = self._process(enc.text, enc.add_special_tokens, images, videos)
        item = self._item(out)
        item["labels"] = self._labels(enc, item["input_ids"], record.id)
        return item

    # -- Dataset -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not -len(self.records) <= index < len(self.records):
            raise IndexError(f"index {index} out of range for a dataset of {len(self.records)} records")
        index %= len(self.records)
        if index in self._item_cache:
            return self._item_cache[index]
        errors = _media_errors()
        for step in range(len(self.records)):
            record = self.records[(index + step) % len(self.records)]
            try:
                media = self._load_media(record)
            except FrameCountError:
                raise
            except errors as e:
                self._skip(record, e)
                warnings.warn(
                    f"record {record.id!r}: cannot load its image/video ({self.skipped[-1].reason}); "
                    "using the next record instead",
                    stacklevel=2,
                )
                continue
            item = self.encode(record, media)
            if self.cache:
                self._item_cache[index] = item
            return item
        raise DataError("no record of the dataset has a loadable image/video any more")

    def collate(self, batch: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
        """`collate` with this tokenizer's pad id and padding side: use as a DataLoader's
        `collate_fn`."""
        return collate(batch, pad_token_id=self.pad_token_id, padding_side=self.padding_side)

    # -- evaluation ----------------------------------------------------------------------------

    def prompt_inputs(self, record: int | LlavaRecord | dict[str, Any],
                      media: tuple[list[Any], list[Any]] | None = None) -> PromptInputs:
        """The prompt of a record's last answer (earlier turns included, generation prompt
        appended) as an item without labels, and that answer as the reference: feed
        `dataset.collate([p.inputs for p in prompts])` to `generate`. Loads its media unless
        given; a broken image raises `DataError`: evaluation decides whether to count it as wrong
        or leave it out."""
        if isinstance(record, int):
            record = self.records[record]
        elif isinstance(record, dict):
            record = parse_record(record, 0, self.image_root)
        messages = to_messages(record)
        last = last_assistant(messages, record.id)
        text = self._render(messages[:last], True)
        images, videos = media if media is not None else self._checked_media(record)
        out = self._process(text, self._add_special(text), images, videos)
        return PromptInputs(inputs=self._item(out), answer=message_text(messages[last]), id=record.id)

    def eval_inputs(self, record: LlavaRecord) -> tuple[dict[str, Tensor], PromptInputs]:
        """A record's item (its answer's loss) and prompt (generation), its media decoded once for
        both; with `cache`, kept: a recipe that evaluates many models and compute points on one
        set decodes each video once, not once an evaluation. A broken image raises `DataError`."""
        cached = self._eval_cache.get(id(record))
        if cached is not None and cached[0] is record:
            return cached[1], cached[2]
        media = self._checked_media(record)
        item, prompt = self.encode(record, media), self.prompt_inputs(record, media)
        if self.cache:
            for key, value in prompt.inputs.items():  # one copy of the pixels: the processor made two
                other = item.get(key)
                if value.is_floating_point() and other is not None and other.shape == value.shape and torch.equal(other, value):
                    prompt.inputs[key] = other
            self._eval_cache[id(record)] = (record, item, prompt)
        return item, prompt

    def _checked_media(self, record: LlavaRecord) -> tuple[list[Any], list[Any]]:
        try:
            return self._load_media(record)
        except FrameCountError:
            raise
        except _media_errors() as e:
            raise DataError(f"record {record.id!r}: cannot load its image/video: {e}") from None


__all__ = ["FrameCountError", "LlavaDataset", "PromptInputs", "SkippedRecord"]
