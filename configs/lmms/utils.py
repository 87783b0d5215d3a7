"""Fields of the synthetic set's LLaVA-format records for the `vlmod_synthetic` lmms-eval task.
Image paths are relative to the data folder: data/synthetic, or $VLMOD_SYNTHETIC_DIR."""

import os
from pathlib import Path

from PIL import Image

DATA = Path(os.environ.get("VLMOD_SYNTHETIC_DIR", "data/synthetic"))


def doc_to_visual(doc):
    return [Image.open(DATA / doc["image"]).convert("RGB")]


def doc_to_text(doc):
    return doc["conversations"][0]["value"].replace("<image>", "").strip()


def doc_to_target(doc):
    return doc["conversations"][-1]["value"]
