"""What keeps the demo server within bounds: the request body cap and its deadline, the gate that
bounds how many requests decode and run at once, the turn that holds other requests off while one
is timed, and uploads copied to disk in chunks."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmod.io.signals import handling

# A request body must arrive within UPLOAD_GRACE_S plus its size at MIN_UPLOAD_RATE, and once the
# grace has passed, at MIN_UPLOAD_RATE or faster over every RATE_WINDOW_S: a client that trickles
# its upload (a byte a second) would otherwise hold one of the few request slots for as long as it
# likes (a body that claims 26 MB had 407 s), and ten of them lock everyone out.
UPLOAD_GRACE_S = 10.0
MIN_UPLOAD_RATE = 64 * 1024  # bytes a second
RATE_WINDOW_S = 10.0
# How long a request waits for a slot or for the model before it gets a 503: a request that holds
# the model for long (a large model, many timing runs) must not leave the others hanging.
MAX_WAIT_S = 120.0
# After SIGINT / SIGTERM the requests in progress stop at their next token; uvicorn cancels what is
# still running after this long.
STOP_GRACE_S = 5.0


class BodyTooLarge(Exception):
    """A request body went past the limit while it was read."""


class BodyTooSlow(Exception):
    """A request body did not arrive by its deadline, or arrived slower than the least rate."""


class Cancelled(Exception):
    """The request's work stopped: its client went away, or the server is stopping."""


class Busy(Exception):
    """A request waited `MAX_WAIT_S` for a slot or the model without getting it."""


_request = threading.local()  # the running request's cancel events and wait deadline, per thread


@contextlib.contextmanager
def cancellable(events: tuple[threading.Event, ...], deadline: float) -> Iterator[None]:
    """Within, in this thread: `check_cancelled` raises Cancelled once one of `events` is set (the
    model's generate checks at every token), and `wait_turn` gives up at `deadline` (monotonic)."""
    before = getattr(_request, "state", None)
    _request.state = (events, deadline)
    try:
        yield
    finally:
        _request.state = before


def check_cancelled() -> None:
    """Raise Cancelled when this thread's request was cancelled (`cancellable`)."""
    state = getattr(_request, "state", None)
    if state is not None and any(event.is_set() for event in state[0]):
        raise Cancelled


def wait_turn(acquire: Callable[[float], bool], poll: float = 0.2) -> None:
    """Call `acquire(timeout)` until it returns True; Cancelled when the request is cancelled
    meanwhile, Busy past its deadline (outside `cancellable`: wait as long as it takes)."""
    state = getattr(_request, "state", None)
    while True:
        check_cancelled()
        if state is None:
            if acquire(poll):
                return
            continue
        remaining = state[1] - time.monotonic()
        if remaining <= 0:
            raise Busy
        if acquire(min(remaining, poll)):
            return


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

    def acquire(self, timeout: float | None = None) -> bool:
        return self._slots.acquire(timeout=timeout)

    def release(self) -> None:
        self._slots.release()


class BodyLimit:
    """Refuse request bodies over `limit` bytes (by Content-Length up front, else while reading)
    and bodies that arrive slower than their deadline or, after `grace` seconds, slower than
    `min_rate` over any `window` seconds (`BodyTooSlow` from the app's `receive`). None: the
    module's UPLOAD_GRACE_S, MIN_UPLOAD_RATE and RATE_WINDOW_S as they are when the app starts."""

    def __init__(self, app: ASGIApp, limit: int, grace: float | None = None, min_rate: float | None = None,
                 window: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.grace = UPLOAD_GRACE_S if grace is None else grace
        self.min_rate = MIN_UPLOAD_RATE if min_rate is None else min_rate
        self.window = RATE_WINDOW_S if window is None else window

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
        start = loop.time()
        deadline = start + self.grace + expected / self.min_rate
        rate = _RateFloor(start, start + self.grace + self.window, self.window, self.min_rate)

        async def counted() -> Message:
            nonlocal seen, complete
            if complete:  # the body is in: later receives (a disconnect) wait as long as they need
                return await receive()
            pending = asyncio.ensure_future(receive())
            try:
                while True:  # wake at least when the deadline or the rate floor would be missed
                    cutoff = min(deadline, rate.cutoff(seen))
                    done, _ = await asyncio.wait({pending}, timeout=max(cutoff - loop.time(), 0.0))
                    if done:
                        break
                    if loop.time() >= min(deadline, rate.cutoff(seen)):
                        raise BodyTooSlow
            except BaseException:  # too slow, or this request was cancelled: stop waiting for the body
                pending.cancel()
                raise
            message = pending.result()
            seen += len(message.get("body", b""))
            rate.record(loop.time(), seen)
            if seen > self.limit:
                raise BodyTooLarge
            complete = message.get("type") != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, counted, send)


class _RateFloor:
    """A body's bytes over time against the least rate: from `check_from` on, the bytes that came
    in over the last `window` seconds must be at least `rate * window` (a sliding window)."""

    def __init__(self, begin: float, check_from: float, window: float, rate: float) -> None:
        self.check_from, self.window, self.needed = check_from, window, rate * window
        self.samples: deque[tuple[float, int]] = deque([(begin, 0)])  # (time, bytes by then)

    def record(self, now: float, seen: int) -> None:
        self.samples.append((now, seen))
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.window:
            self.samples.popleft()  # keeps the last sample at or before the window's start

    def cutoff(self, seen: int) -> float:
        """When the body, with no byte more than `seen`, falls under the rate: the first time t
        >= check_from at which fewer than the needed bytes came in over (t - window, t]."""
        for at, count in self.samples:
            if count > seen - self.needed:
                return max(self.check_from, at + self.window)
        return self.check_from  # not reached: the last sample holds `seen`


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
    or two requests could wait on each other. A cancelled request stops waiting (`cancellable`),
    and a shared wait gives up at the request's deadline (Busy)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._queued = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            wait_turn(lambda timeout: self._cond.wait_for(lambda: not self._exclusive and not self._queued, timeout))
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
            try:  # the request holds the model: no deadline, only its cancellation
                while not self._cond.wait_for(lambda: not self._exclusive and not self._shared, 0.2):
                    check_cancelled()
            finally:
                self._queued -= 1
                self._cond.notify_all()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


async def watch_disconnect(request: Any, left: threading.Event, poll: float = 0.25) -> None:
    """Set `left` once the client of `request` (a Starlette Request) has gone, checked every `poll`
    seconds while the request runs: its work then stops holding a slot or the model."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll)
    left.set()


def stoppable_server(config: Any, stopping: threading.Event) -> Any:
    """uvicorn's server, but a SIGINT or SIGTERM also sets `stopping`, which stops the requests in
    progress at their next token or wait (`cancellable`): a `kill` ends the server in seconds, not
    when a long request would have. uvicorn raises the signal again on its way out, before its
    caller could clean up; here the caller does it with `raise_caught` once it has."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.caught: list[int] = []

        def handle_exit(self, sig: int, frame: Any) -> None:
            stopping.set()
            self.caught.append(sig)
            super().handle_exit(sig, frame)

        def capture_signals(self) -> contextlib.AbstractContextManager[None]:
            return handling(self.handle_exit)

        def raise_caught(self) -> None:
            if self.caught:
                signal.raise_signal(self.caught[-1])

    return Server(config)
