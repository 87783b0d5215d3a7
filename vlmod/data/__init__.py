"""Image-text data: LLaVA-format records and images (calibration and fine-tuning share them),
chat messages, the training dataset with answer-only labels, batching, answer scoring, and the
synthetic shapes set (`vlmod.data.synthetic`, imported on use)."""

from vlmod.data.answers import IGNORE_INDEX, exact_match, is_correct, normalize_answer
from vlmod.data.chat import to_messages
from vlmod.data.collate import collate
from vlmod.data.dataset import LlavaDataset, PromptInputs, SkippedRecord
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
    "is_correct",
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
