"""What keeps the demo server within bounds: the request body cap and its deadline, the gate that
bounds how many requests decode and run at once, the turn that holds other requests off while one
is timed, and uploads copied to disk in chunks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A request body must arrive within UPLOAD_GRACE_S plus its size at MIN_UPLOAD_RATE: a client that
# trickles its upload (a byte a second) would otherwise hold one of the few request slots for as
# long as it likes, and ten of them lock everyone out.
UPLOAD_GRACE_S = 10.0
MIN_UPLOAD_RATE = 64 * 1024  # bytes a second


class BodyTooLarge(Exception):
    """A request body went past the limit while it was read."""


class BodyTooSlow(Exception):
    """A request body did not arrive by its deadline."""


def error(message: str, status: int) -> JSONResponse:
    """The demo's error response: `{"error": message}`."""
    return JSONResponse({"error": message}, status_code=status)


def too_large(limit: int) -> JSONResponse:
    return error(f"the upload is too large: the demo takes files up to {limit / 2**20:.0f} MB", 413)


class WorkGate:
    """At most `active` requests inside the heavy section (decode + model), at most `waiting` more
    queued for it; `admit` is False when both are full (the caller answers 503). Thread-based, so
    it does not depend on which event loop serves the request."""

    def __init__(self, active: int, waiting: int) -> None:
        self.active, self.waiting = active, waiting
        self._slots = threading.Semaphore(active)
        self._lock = threading.Lock()
        self._admitted = 0

    def admit(self) -> bool:
        with self._lock:
            if self._admitted >= self.active + self.waiting:
                return False
            self._admitted += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._admitted -= 1

    def acquire(self) -> None:
        self._slots.acquire()

    def release(self) -> None:
        self._slots.release()


class BodyLimit:
    """Refuse request bodies over `limit` bytes (by Content-Length up front, else while reading)
    and bodies that arrive slower than their deadline (`BodyTooSlow` from the app's `receive`)."""

    def __init__(self, app: ASGIApp, limit: int, grace: float = UPLOAD_GRACE_S, min_rate: float = MIN_UPLOAD_RATE) -> None:
        self.app = app
        self.limit = limit
        self.grace, self.min_rate = grace, min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await too_large(self.limit)(scope, receive, send)
            return
        seen, complete = 0, False
        loop = asyncio.get_running_loop()
        expected = int(length) if length is not None and length.isdigit() else self.limit
        deadline = loop.time() + self.grace + expected / self.min_rate

        async def counted() -> Message:
            nonlocal seen, complete
            if complete:  # the body is in: later receives (a disconnect) wait as long as they need
                return await receive()
            remaining = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise BodyTooSlow from None
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge
            complete = message.get("type") != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, counted, send)


async def save_upload(upload: UploadFile, path: Path, limit: int) -> int | None:
    """Copy an upload to `path` in chunks; None (and nothing kept) when it is over `limit` bytes."""
    size = 0
    with path.open("wb") as out:
        while chunk := await upload.read(1 << 20):
            size += len(chunk)
            if size > limit:
                break
            out.write(chunk)
    if size > limit:
        path.unlink(missing_ok=True)
        return None
    return size


class QuietTurn:
    """Lets the timed section of one request run with the other requests held off: any number
    may be `shared` (decoding an upload) at once, while `exclusive` (timing the models) waits for
    them to finish and keeps new ones out until it ends. Exclusive turns go first: a stream of
    decodes cannot starve the timing. A section must not wait for the model lock while shared,
    or two requests could wait on each other."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._queued = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._queued)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._queued += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._queued -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
