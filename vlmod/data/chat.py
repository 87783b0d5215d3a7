"""LLaVA-format conversations as chat-template messages: the roles, and the media placeholders
(`<image>`, `<video>`) as typed content items where they stand, so the processor's own chat
template renders the prompt the model was trained with."""

from __future__ import annotations

import re
from typing import Any

from vlmod.data.llava_format import (
    ASSISTANT_ROLES,
    HUMAN_ROLES,
    IMAGE_TOKEN,
    SYSTEM_ROLES,
    VIDEO_TOKEN,
    DataError,
    LlavaRecord,
)

_PLACEHOLDER = re.compile(f"({re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)})")


def _role(name: str, record_id: str) -> str:
    if name in HUMAN_ROLES:
        return "user"
    if name in ASSISTANT_ROLES:
        return "assistant"
    if name in SYSTEM_ROLES:
        return "system"
    roles = ", ".join(HUMAN_ROLES + ASSISTANT_ROLES + SYSTEM_ROLES)
    raise DataError(f"record {record_id!r}: unknown speaker {name!r} (expected one of {roles})")


def to_messages(record: LlavaRecord) -> list[dict[str, Any]]:
    """The record's conversation as chat-template messages (`role` + typed `content` list).

    `<image>` / `<video>` placeholders in human turns become `{"type": "image"}` /
    `{"type": "video"}` items where they stand; `<image>` in a video-only record means the
    video (the LLaVA-Video convention). A record with media but no placeholder gets them at
    the start of its first human turn. Placeholder counts must match the media."""
    n_images = len(record.images)
    n_videos = 1 if record.video_path is not None else 0
    used = {"image": 0, "video": 0}
    messages: list[dict[str, Any]] = []
    for turn in record.conversations:
        role = _role(turn["from"], record.id)
        if role != "user":
            messages.append({"role": role, "content": [{"type": "text", "text": turn["value"].strip()}]})
            continue
        content: list[dict[str, Any]] = []
        for piece in _PLACEHOLDER.split(turn["value"]):
            if piece == VIDEO_TOKEN or (piece == IMAGE_TOKEN and n_images == 0 and n_videos):
                kind = "video"
            elif piece == IMAGE_TOKEN:
                kind = "image"
            else:
                if piece.strip():
                    content.append({"type": "text", "text": piece.strip()})
                continue
            used[kind] += 1
            content.append({"type": kind})
        messages.append({"role": "user", "content": content})
    if used["image"] == 0 and used["video"] == 0 and (n_images or n_videos):
        first_user = next(m for m in messages if m["role"] == "user")
        first_user["content"][:0] = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
    elif used["image"] != n_images or used["video"] != n_videos:
        raise DataError(
            f"record {record.id!r}: its human turns hold {used['image']} {IMAGE_TOKEN} and {used['video']} "
            f"{VIDEO_TOKEN} placeholder(s) for {n_images} image(s) and {n_videos} video(s)"
        )
    return messages


def last_assistant(messages: list[dict[str, Any]], record_id: str) -> int:
    """Index of the last assistant turn: the answer a record is trained and evaluated on."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return i
    raise DataError(f"record {record_id!r} has no answer (no turn from {' or '.join(ASSISTANT_ROLES)})")


def message_text(message: dict[str, Any]) -> str:
    """The text items of a message, joined by spaces."""
    return " ".join(c["text"] for c in message["content"] if c.get("type") == "text")


__all__ = ["last_assistant", "message_text", "to_messages"]
