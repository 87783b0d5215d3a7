"""`vlmod bench train` within bounds (issue 58): a batch whose training memory or synthetic files do
not fit is refused in one line before the batch is built, and a killed run leaves none of its
pictures in the temp folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
from helpers.interrupt import terminate, wait_for_mark

from vlmod.cli import main

FAST = ["--warmup", "0", "--repeats", "1", "--no-progress", "--threads", "1"]


@pytest.fixture
def one_row_only(monkeypatch):
    """Fail the test if a batch of more than one row (the probe that measures a row) is built."""
    import vlmod.bench.train as train

    real = train.synthetic_batch

    def batch(processor, size, rows, *args, **kwargs):
        if rows > 1:
            pytest.fail(f"a batch of {rows} rows was built")
        return real(processor, size, rows, *args, **kwargs)

    monkeypatch.setattr(train, "synthetic_batch", batch)
    monkeypatch.delenv("VLMOD_SKIP_MEMORY_CHECK", raising=False)


def test_a_batch_that_cannot_fit_memory_is_refused_before_it_is_built(one_row_only, capsys) -> None:
    """Before: `--batch-size 1000000` wrote 372,000 PNGs in 3 minutes and large batches ended in
    allocator tracebacks. Now the training memory of both models is estimated from one row, as
    `vlmod finetune` estimates it, and a run that cannot fit is refused in one line."""
    assert main(["bench", "train", "--preset", "tiny", "--batch-size", "1000000", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this fine-tune needs about ") and err.count("\n") == 1, err
    assert "activations" in err and "lower batch_size" in err


def test_a_batch_that_cannot_fit_the_temp_folder_is_refused(one_row_only, monkeypatch, capsys) -> None:
    """Before: nothing checked the temp folder's free space for the batch's pictures. Now one row
    is written and measured, and a batch whose files would not fit is refused in one line."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**4, 10**4))
    assert main(["bench", "train", "--preset", "tiny", "--batch-size", "100", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --batch-size 100 writes about ") and err.count("\n") == 1, err
    assert "of synthetic pictures or clips" in err and "which has 0.0 MB free" in err


# `vlmod bench train` whose synthetic pictures are slow to make: after the fifth it notes $MARKS.
DRIVER = r'''
import os, sys, time
import vlmod.bench.train as train
real = train.synthetic_image
made = []

def slow(size, seed):
    made.append(seed)
    if len(made) == 5:
        open(os.environ["MARKS"], "w").close()
    time.sleep(0.05)
    return real(size, seed)

train.synthetic_image = slow
from vlmod.cli import main
sys.exit(main(sys.argv[1:]))
'''


def test_a_killed_run_leaves_no_pictures(tmp_path) -> None:
    """Before: a killed bench train left its batch's pictures in the temp folder (1.5 GB of them
    for --batch-size 1000000). Now SIGTERM unwinds as Ctrl-C does: the temp folder is removed and
    the command says it was interrupted."""
    temp, marks = tmp_path / "tmp", tmp_path / "marks"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "MARKS": str(marks), "HF_HUB_OFFLINE": "1"}
    run = subprocess.Popen([sys.executable, "-c", DRIVER, "bench", "train", "--preset", "tiny", "--batch-size", "400",
                            *FAST], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_mark(run, marks, "the batch was not started")
        assert list(temp.glob("vlmod-bench-train-*/*.png"))
        terminate(run)
        assert list(temp.glob("vlmod-bench-train-*")) == []
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
