"""Image-text data: LLaVA-format records and images (calibration and fine-tuning share them),
the training dataset/collator with answer-only labels, and the synthetic shapes set
(`vlmod.data.synthetic`, imported on use)."""

from vlmod.data.collate import (
    IGNORE_INDEX,
    LlavaDataset,
    PromptInputs,
    SkippedRecord,
    collate,
    exact_match,
    normalize_answer,
    to_messages,
)
from vlmod.data.llava_format import (
    IMAGE_EXTENSIONS,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    DataError,
    LlavaRecord,
    list_images,
    load_image,
    load_records,
    parse_record,
    read_json_records,
    resolve_image_path,
    strip_image_tokens,
)

__all__ = [
    "IGNORE_INDEX",
    "IMAGE_EXTENSIONS",
    "IMAGE_TOKEN",
    "VIDEO_TOKEN",
    "DataError",
    "LlavaDataset",
    "LlavaRecord",
    "PromptInputs",
    "SkippedRecord",
    "collate",
    "exact_match",
    "list_images",
    "load_image",
    "load_records",
    "normalize_answer",
    "parse_record",
    "read_json_records",
    "resolve_image_path",
    "strip_image_tokens",
    "to_messages",
]
