"""Shared test setup: offline hub, few CPU threads, a fixed seed for every test, and the tiny
checkpoints several test files build the same way (factories where each file needs its own)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

THREADS = min(2, os.cpu_count() or 1)
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # A test that runs a command in-process (bench --threads 1, recipe --threads) must not change
    # the kernels, and so the last bits of the numbers, of the tests after it.
    torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def llava_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA saved with its processor, like a hub checkpoint. Shared by every test
    that takes it, so tests only read it."""
    from vlmod.models import tiny

    return tiny.save("llava", tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def llava_workdir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `make(name, train=None, val=None)` is a new folder holding `dense/`, a tiny LLaVA
    (32 px pictures, 8 px patches: a 4 x 4 token grid), and with `train` or `val` given, `data/`:
    the synthetic set's train.json and val.json of that many samples, pictures of 32 px. Each
    caller gets its own folder to write runs and conversions beside the model."""
    from vlmod.data.synthetic import generate
    from vlmod.models import tiny

    def make(name: str, train: int | None = None, val: int | None = None) -> Path:
        root = tmp_path_factory.mktemp(name)
        tiny.save("llava", root / "dense", image_size=32, patch_size=8)
        if train is not None or val is not None:
            generate(root / "data", train or 0, val or 0, image_size=32)
        return root

    return make
