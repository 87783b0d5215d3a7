"""Image-text data: LLaVA-format records and images (calibration and fine-tuning share them)."""

from vlmod.data.llava_format import (
    IMAGE_EXTENSIONS,
    IMAGE_TOKEN,
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
    "IMAGE_EXTENSIONS",
    "IMAGE_TOKEN",
    "DataError",
    "LlavaRecord",
    "list_images",
    "load_image",
    "load_records",
    "parse_record",
    "read_json_records",
    "resolve_image_path",
    "strip_image_tokens",
]
