"""Stopping a command's subprocess mid-work, as a user's SIGTERM does, once it marked that it got there."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

INTERRUPTED = "error: interrupted (Ctrl-C); nothing was left half-written"


def wait_for_mark(run: subprocess.Popen, marks: Path, what: str, timeout: float = 300) -> None:
    """Wait until the command (whose patched driver writes `marks` at the point under test) gets
    there; fail naming `what` if it exits or takes longer than `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not marks.exists():
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def terminate(run: subprocess.Popen) -> str:
    """SIGTERM the command; check it stopped as on Ctrl-C (exit 130, the one-line message last)
    and return its stderr."""
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    assert err.strip().splitlines()[-1] == INTERRUPTED
    return err
