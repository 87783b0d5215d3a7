"""The demo server does not wedge (issue 58): per-request work flags are bounded at start, an upload
slower than the least rate loses its slot after a short grace, a request whose client left stops
holding the model, a request that cannot get a turn gets a 503 in bounded time, and SIGTERM stops
the server in seconds with its uploads removed. One real server process with a slowed model."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from PIL import Image

pytest.importorskip("starlette")
pytest.importorskip("multipart")
httpx = pytest.importorskip("httpx")

from vlmod.cli import main  # noqa: E402


@pytest.mark.parametrize("flag, value, most", [
    ("--timing-runs", "1000000", "from 0 to 50"), ("--max-new-tokens", "100000", "from 1 to 512"),
    ("--frames", "100000", "from 1 to 64"),
])
def test_per_request_work_is_bounded_at_the_flag(capsys, flag, value, most) -> None:
    """Before: `vlmod demo --timing-runs 1000000` was accepted and one request then held the model
    for hours. Now each flag that sets one request's work has a maximum, refused in one line."""
    assert main(["demo", flag, value]) == 2
    assert capsys.readouterr().err == f"error: argument {flag}: expected an integer {most}, got {value!r} " \
                                      "(see vlmod demo --help)\n"


def test_a_body_under_the_least_rate_is_cut_after_the_grace() -> None:
    """Before: a body was cut only at its total deadline (grace plus its claimed size at 64 KB/s:
    407 s for a body that claims 26 MB), however little of it came. Now, once the grace has
    passed, every window must bring the least rate's bytes; a body above that rate is not cut."""
    from vlmod.demo.guards import BodyLimit, BodyTooSlow

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        scope["body_done"] = True

    async def upload(chunk: int, total: int) -> dict:
        """Send `total` bytes in `chunk`-byte pieces, one every 10 ms."""
        sent = 0

        async def receive() -> dict:
            nonlocal sent
            await asyncio.sleep(0.01)
            sent += chunk
            return {"type": "http.request", "body": b"x" * chunk, "more_body": sent < total}

        scope = {"type": "http", "method": "POST", "headers": [(b"content-length", str(total).encode())]}
        guarded = BodyLimit(app, limit=10**7, grace=0.2, min_rate=5000, window=0.5)  # deadline: 0.2 s + total / 5000
        try:
            await asyncio.wait_for(guarded(scope, receive, lambda message: None), timeout=60)
        except BodyTooSlow:
            scope["too_slow"] = True
        scope["sent"] = sent
        return scope

    trickle = asyncio.run(upload(5, 10**6))  # 500 B/s against 5000 B/s; its total deadline was 200 s
    assert trickle.get("too_slow") and not trickle.get("body_done") and trickle["sent"] < 10**4
    fast = asyncio.run(upload(500, 40_000))  # 50 kB/s: passes the floor
    assert fast.get("body_done") and not fast.get("too_slow")


# `vlmod demo` with the grace, the window and the wait shortened, and every forward of a request
# (after the start-up warm-up) slowed to 50 ms and counted in $MARKS.
DRIVER = r'''
import functools, os, sys, time
import vlmod.demo.app as app
import vlmod.demo.guards as guards
guards.UPLOAD_GRACE_S, guards.RATE_WINDOW_S, guards.MAX_WAIT_S = 1.0, 2.0, 4.0
real_load = app.load_model

def load(*args, **kwargs):
    loaded = real_load(*args, **kwargs)
    for model in (loaded.model, loaded.dense):
        if model is None:
            continue
        @functools.wraps(model.forward)
        def slow(*a, _forward=model.forward, **k):
            if loaded.warm_up_s is not None:
                with open(os.environ["MARKS"], "a") as f:
                    f.write("x")
                time.sleep(0.05)
            return _forward(*a, **k)
        model.forward = slow
    return loaded

app.load_model = load
from vlmod.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _multipart(png: bytes, boundary: str = "vlmodhangs") -> tuple[bytes, str]:
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nwhat color ?\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode() + png + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def _post_head(port: int, kind: str, length: int) -> bytes:
    return (f"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="sends SIGTERM")
def test_the_demo_does_not_wedge(tmp_path) -> None:
    """Before: a trickling upload held its slot until its total deadline; a request whose client
    left held the model to its end, later requests hung with no 503, a plain `kill` did not stop
    the server, and uploads stayed in the temp folder. Now, on one server: a trickle gets 408 after
    grace + window; a request waiting past MAX_WAIT_S gets 503 busy; a request whose client left
    stops at its next token, so the next one gets the model; SIGTERM stops the request in
    progress (503) and the server, which removes its uploads' folder."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp, marks = tmp_path / "tmp", tmp_path / "marks"
    temp.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(temp), "MARKS": str(marks)}
    flags = ["demo", "--port", str(port), "--timing-runs", "50", "--max-active", "1", "--max-waiting", "2"]
    server = subprocess.Popen([sys.executable, "-c", DRIVER, *flags], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, httpx.Response | Exception] = {}

    def post(name: str, timeout: float) -> None:
        try:
            results[name] = httpx.post(f"{url}/api/analyze", data={"prompt": "what color ?"},
                                       files={"file": ("a.png", _png(), "image/png")}, timeout=timeout)
        except httpx.HTTPError as err:
            results[name] = err

    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the demo did not start"
            try:
                if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert list(temp.glob("vlmod-demo-*"))  # the server's uploads folder

        # A trickle: 20 bytes every 0.2 s of a body that claims 1 MB (its total deadline: 16 s).
        with socket.create_connection(("127.0.0.1", port)) as trickler:
            trickler.sendall(_post_head(port, "multipart/form-data; boundary=x", 10**6)
                             + b'--x\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n')
            trickler.settimeout(0.2)
            sent, answer = 0, b""
            while not answer and sent < 10**4:
                try:
                    trickler.sendall(b"\0" * 20)
                    sent += 20
                    answer = trickler.recv(4096)
                except TimeoutError:
                    continue
                except OSError:  # the server closed the connection after its answer
                    answer = answer or trickler.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert sent < 1500, sent  # cut at about 3 s (60 bytes in each 2 s window), not at 16 s

        # A: a request whose client will leave, once it is in the model.
        body, kind = _multipart(_png())
        leaver = socket.create_connection(("127.0.0.1", port))
        leaver.sendall(_post_head(port, kind, len(body)) + body)
        while not marks.exists():
            assert time.monotonic() < deadline, "the request did not reach the model"
            time.sleep(0.1)
        # B: waits for the slot A holds, and gets a 503 after MAX_WAIT_S (4 s), not when A ends (minutes).
        post("busy", 60)
        busy = results["busy"]
        assert isinstance(busy, httpx.Response) and busy.status_code == 503, busy
        assert "busy" in busy.json()["error"]
        leaver.close()
        # C: gets the slot and the model A gave up when its client left (else a 503 busy after 4 s) ...
        running = threading.Thread(target=post, args=("stopped", 120))
        running.start()
        time.sleep(6)
        # ... and SIGTERM stops it at its next token, then the server.
        server.send_signal(signal.SIGTERM)
        log, _ = server.communicate(timeout=60)
        running.join(timeout=60)
        stopped = results["stopped"]
        assert isinstance(stopped, httpx.Response) and stopped.status_code == 503, (stopped, log[-3000:])
        assert stopped.json()["error"] == "the demo is stopping: the request was stopped; try again"
        assert server.returncode == -signal.SIGTERM, log[-3000:]
        assert list(temp.glob("vlmod-demo-*")) == []  # no upload left behind
        assert "Traceback" not in log, log[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
