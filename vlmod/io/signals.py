"""SIGTERM handled as Ctrl-C: a plain `kill` of a command that writes temp files or runs child
processes then unwinds through its `finally` blocks and context managers (temp folders removed,
children stopped) instead of ending at once with them left behind."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def handling(handler: Any, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within (in the main thread, the only one Python lets set a handler; elsewhere it does
    nothing): `signals` go to `handler` (a function or `signal.SIG_IGN`), the earlier handlers
    restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, earlier in before.items():
            signal.signal(sig, earlier)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within (in the main thread; elsewhere it does nothing): SIGTERM raises KeyboardInterrupt
    as Ctrl-C does, so the command stops with its cleanup and says "interrupted" in one line."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with handling(interrupt, (signal.SIGTERM,)):
        yield


__all__ = ["handling", "sigterm_as_interrupt"]
