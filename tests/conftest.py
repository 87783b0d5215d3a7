"""Shared test setup: offline hub, few CPU threads, a fixed seed for every test."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
