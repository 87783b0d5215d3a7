"""The demo server under hostile uploads, as a real server process: its peak resident memory
(VmHWM) for a tiny PNG of an extreme shape and parallel uploads of large pictures, and its log when
clients drop mid-upload. Plus the shape checks and the body deadline themselves, in process."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("starlette")
pytest.importorskip("multipart")
httpx = pytest.importorskip("httpx")

from vlmod.demo import media  # noqa: E402

MB = 2**20


def _png(width: int, height: int, block: int = 1) -> bytes:
    """A PNG of random `block`-pixel squares (0: one colour): large blocks compress a huge picture
    to a small file."""
    buf = io.BytesIO()
    if block == 0:
        Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
        return buf.getvalue()
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (-(-height // block), -(-width // block), 3), dtype=np.uint8)
    pixels = np.kron(small, np.ones((block, block, 1), dtype=np.uint8))[:height, :width]
    Image.fromarray(np.ascontiguousarray(pixels)).save(buf, format="PNG")
    return buf.getvalue()


class Server:
    """`vlmod demo` (the embedded model) in a subprocess, with its memory counters."""

    def __init__(self, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlmod.cli", "demo", "--port", str(self.port), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the demo server exited: {self.proc.stdout.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/api/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError("the demo server did not start in 120 s")

    def memory(self, key: str) -> int:
        """VmHWM (peak) or VmRSS (now) of the server, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def analyze(self, png: bytes) -> httpx.Response:
        return httpx.post(f"{self.url}/api/analyze", data={"prompt": "what color is the circle ?"},
                          files={"file": ("a.png", png, "image/png")}, timeout=300)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    if not Path("/proc/self/status").is_file():
        pytest.skip("needs /proc to read the server's memory")
    srv = Server("--max-active", "1", "--max-waiting", "2")
    try:
        yield srv
    finally:
        srv.close()


def test_extreme_aspect_png_is_refused_without_memory(server: Server) -> None:
    """A 200,000 x 1 PNG is 700 bytes; resized by the processor (short side to 32 px) it was a
    6,400,000 x 32 float array and 2.7 GB of server memory. Refused from its header: 422."""
    server.reset_peak()
    before = server.memory("VmHWM")
    for size in ((200_000, 1), (1, 200_000)):
        data = _png(*size, block=0)
        assert len(data) < 4096
        r = server.analyze(data)
        assert r.status_code == 422, r.text
        assert "aspect ratio" in r.json()["error"] and f"{size[0]}x{size[1]}" in r.json()["error"]
    # Elongated within the limit (20:1): answered.
    r = server.analyze(_png(400, 20))
    assert r.status_code == 200, r.text
    assert server.memory("VmHWM") - before < 150 * MB


def test_parallel_large_uploads_keep_memory_bounded(server: Server) -> None:
    """12 parallel uploads of a 16 MP picture (48 MB decoded each): one decodes and runs at a time,
    two wait, the rest get 503; the peak stays near one request's, and memory goes back after."""
    data = _png(4000, 4000, block=50)
    server.reset_peak()
    before = server.memory("VmHWM")
    results: list[int] = []

    def post() -> None:
        results.append(server.analyze(data).status_code)

    threads = [threading.Thread(target=post) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(results)) == [200, 503], results
    assert 1 <= results.count(200) <= 6
    assert server.memory("VmHWM") - before < 500 * MB
    assert server.memory("VmRSS") - before < 150 * MB  # handed back after the requests


# ----------------------------------------------------------------------------- in process


def test_check_shape_refuses_before_decoding() -> None:
    with pytest.raises(media.MediaError) as err:
        media.check_shape(21, 1)
    assert err.value.status == 422
    media.check_shape(20, 1)
    with pytest.raises(media.MediaError) as err:
        media.check_shape(0, 5)
    assert err.value.status == 400
    with pytest.raises(media.MediaError) as err:
        media.check_shape(8000, 6000, max_pixels=40_000_000)
    assert err.value.status == 413


def test_resized_size_follows_the_processor() -> None:
    """The processor's resize (short side up to its input size) is what is bounded, not pixels."""
    from transformers import CLIPImageProcessor, LlavaNextImageProcessor

    clip = media.processor_resized_pixels(CLIPImageProcessor(size={"shortest_edge": 336}))
    assert clip(1000, 100) == 3360 * 336
    assert clip(336, 336) == 336 * 336
    fixed = media.processor_resized_pixels(CLIPImageProcessor(size={"height": 224, "width": 224}))
    assert fixed(5000, 400) == 224 * 224
    anyres = media.processor_resized_pixels(LlavaNextImageProcessor())
    assert anyres(10, 10) >= 672 * 672  # the largest pinpoint
    with pytest.raises(media.MediaError) as err:
        media.check_shape(2000, 100, resized_pixels=clip, max_resized_pixels=1_000_000)
    assert err.value.status == 413 and "resize" in str(err.value)


def test_decode_image_checks_shape_from_the_header(tmp_path: Path) -> None:
    path = tmp_path / "wide.png"
    path.write_bytes(_png(50_000, 1, block=0))
    with pytest.raises(media.MediaError) as err:
        media.decode_media(path)
    assert err.value.status == 422


def test_a_body_that_trickles_in_is_cut_at_its_deadline() -> None:
    """A client sending its upload a byte at a time loses its request slot at the deadline (grace
    plus size at the minimum rate) instead of holding it as long as it likes; a body that arrives
    in time passes, and once it is in, later receives (a disconnect) are not cut."""
    import asyncio

    from vlmod.demo.guards import BodyLimit, BodyTooSlow

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        scope["body_done"] = True
        scope["after"] = await receive()

    def request(chunks: list[bytes], stall: bool) -> tuple[dict, float]:
        async def run() -> tuple[dict, float]:
            queue = list(chunks)

            async def receive() -> dict:
                if queue:
                    body = queue.pop(0)
                    return {"type": "http.request", "body": body, "more_body": bool(queue) or stall}
                if stall:
                    await asyncio.sleep(3600)  # a client that stops sending
                await asyncio.sleep(0.5)  # the disconnect comes later than the deadline
                return {"type": "http.disconnect"}

            scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"100")]}
            start = asyncio.get_running_loop().time()
            guarded = BodyLimit(app, limit=1000, grace=0.2, min_rate=1e6)
            try:
                await guarded(scope, receive, lambda message: None)
            except BodyTooSlow:
                scope["too_slow"] = True
            return scope, asyncio.get_running_loop().time() - start

        return asyncio.run(run())

    scope, seconds = request([b"x"], stall=True)
    assert scope.get("too_slow") and not scope.get("body_done") and seconds < 2.0
    scope, _ = request([b"x" * 50, b"y" * 50], stall=False)
    assert scope.get("body_done") and scope["after"]["type"] == "http.disconnect" and not scope.get("too_slow")


def test_a_client_that_drops_mid_upload_leaves_no_traceback() -> None:
    """Clients that send part of an upload and hang up: the server's own log (stdout and stderr
    of `vlmod demo`) stays free of tracebacks, and the server keeps answering."""
    srv = Server("--timing-runs", "0")
    try:
        boundary = "vlmodtestboundary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhi\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode() + b"\0" * 4096
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(b"POST /api/analyze HTTP/1.1\r\nHost: x\r\n"
                          + f"Content-Type: multipart/form-data; boundary={boundary}\r\n".encode()
                          + b"Content-Length: 100000\r\n\r\n" + head)
                time.sleep(0.2)
        time.sleep(1.0)
        assert httpx.get(f"{srv.url}/api/health", timeout=10).status_code == 200
    finally:
        srv.close()
    log = srv.proc.stdout.read().decode(errors="replace")
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
