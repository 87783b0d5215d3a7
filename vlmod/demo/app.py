"""The demo server: a Starlette app that serves the static page and a small JSON API.

API (errors are always `{"error": "..."}` with a 4xx status):

- `GET /api/health` -> `{"status": "ok", "model": {...}, "limits": {...}, "examples": N}`
- `GET /api/examples` -> `{"examples": [{"name", "kind", "prompt", "answer", "url"}]}`
- `GET /api/examples/{name}` -> the example's file (names from the bundled list only)
- `POST /api/analyze`, multipart: `prompt` and either `file` (an image or a video) or `example`
  (a bundled example's name) -> the analysis (`vlmod.demo.analysis.analyze`):

      {"kind": "image" | "video", "input": "image" | "frames" | "video", "prompt", "answer",
       "source": {"example": name} | {"upload": {"bytes": n}},
       "layers": {"language": {"total", "mod": [i, ...]}, "vision": {"total", "mod": [...]}},
       "media": [{"index", "time_s", "width", "height", "src": data URL of the part the model saw,
                  "original": {"width", "height"}, "crop": {"x", "y", "width", "height"} of it,
                  "model_size": {"width", "height"}, "model_src": data URL at the model's resolution,
                  "views": [{"name", "rows", "cols",
                             "counts": [rows*cols: MoD language layers that processed the token],
                             "masks": [per MoD language layer: rows*cols of 0/1]}],
                  "vision": null | {"name", "rows", "cols", "counts", "masks", "stats"},
                  "stats": {"tokens", "layer_passes", "dense_layer_passes", "compute_fraction"}}],
       "stats": {"vision_tokens", "text_tokens", "processed_per_layer", "tokens_skipped",
                 "skipped_fraction_mod_layers", "skipped_fraction_all_layers",
                 "flops": {"dense", "mod", "saved_fraction", ...},
                 "latency_s": {"preprocess", "generate" (the traced run), "queue", "decode"},
                 "latency": null | {"mod_s", "dense_s", "speedup", "runs", "new_tokens", "samples",
                                    "method"} (fair: warm, untraced, interleaved, medians),
                 "dense": null | {"answer", "same_answer"},
                 "vision_tower": {...} (when the tower is converted)}}

Safety: the request body is capped (413 past `max_upload_mb`), the upload is checked by decoding
it (`vlmod.demo.media`), it is written under a fixed name in a private temp folder that is removed
when the request ends, and examples are looked up by name. A picture is refused from its header
when too large, too elongated, or one the processor would resize to too many pixels. At most
`max_active` requests decode and run at a time (what bounds memory: a decoded picture exists only
inside that section), at most `max_waiting` more wait for a turn with nothing decoded, and the
rest get a 503; memory is handed back to the system after each request. The model runs in a
worker thread, one request at a time (a lock), so the server keeps answering while it works.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmod.demo.analysis import TIMING_RUNS, AnalysisError, analyze, load_model, warm_up
from vlmod.demo.checkpoints import resolve_checkpoint
from vlmod.demo.examples import EXAMPLES_DIR, about_model, load_examples
from vlmod.demo.media import (
    MAX_ASPECT,
    MAX_PIXELS,
    MAX_RESIZED_PIXELS,
    MediaError,
    decode_media,
    processor_resized_pixels,
    release_memory,
)

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
DEFAULT_MODEL_DIR = HERE / "assets" / "model"
DEFAULT_DENSE_DIR = HERE / "assets" / "dense"
MAX_PROMPT_CHARS = 1000
FORM_OVERHEAD = 64 * 1024  # multipart boundaries, headers, the prompt


class DemoSetupError(RuntimeError):
    """The demo cannot start: no model to serve."""


class _BodyTooLarge(Exception):
    pass


class WorkGate:
    """At most `active` requests inside the heavy section (decode + model), at most `waiting` more
    queued for it; `enter` is False when both are full (the caller answers 503). Thread-based, so
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


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class BodyLimit:
    """Refuse request bodies over `limit` bytes: by Content-Length up front, else while reading."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _too_large(self.limit)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge
            return message

        await self.app(scope, counted, send)


def _too_large(limit: int) -> JSONResponse:
    return _error(f"the upload is too large: the demo takes files up to {limit / 2**20:.0f} MB", 413)


def resolve_model_dirs(
    model_dir: str | Path | None, dense_dir: str | Path | None
) -> tuple[Path | str, Path | str | None]:
    """(model, dense) checkpoints, each a local directory or a hub id (`resolve_checkpoint`: off
    the network a hub id fails in seconds): the given ones, else the embedded default model."""
    dense = None if dense_dir is None else resolve_checkpoint(dense_dir, "--dense")
    if model_dir is not None:
        return resolve_checkpoint(model_dir, "--model"), dense
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise DemoSetupError(
            f"no --model given and the embedded demo model is missing ({DEFAULT_MODEL_DIR} has no "
            "config.json). Pass --model DIR (a checkpoint converted with `vlmod convert`), or build the "
            "embedded model with `python scripts/build_demo_model.py`."
        )
    if dense is None and (DEFAULT_DENSE_DIR / "config.json").is_file():
        dense = DEFAULT_DENSE_DIR
    return DEFAULT_MODEL_DIR, dense


def create_app(
    model_dir: str | Path | None = None,
    dense_dir: str | Path | None = None,
    *,
    max_upload_mb: float = 25.0,
    max_new_tokens: int = 16,
    num_frames: int = 8,
    max_pixels: int = MAX_PIXELS,
    max_aspect: float = MAX_ASPECT,
    max_resized_pixels: int = MAX_RESIZED_PIXELS,
    max_active: int = 2,
    max_waiting: int = 8,
    device: str = "cpu",
    timing_runs: int = TIMING_RUNS,
    tmp_dir: str | Path | None = None,
    examples_dir: Path = EXAMPLES_DIR,
) -> Starlette:
    """The demo app serving `model_dir` (default: the embedded model) and, when given or embedded,
    its dense counterpart for side-by-side answers and latency.

    The model loads here, so a bad checkpoint fails at start, not on the first request; with
    `timing_runs` > 0 both models are warmed up here and each request times them fairly
    (`vlmod.demo.analysis.measure_latency`), 0 reports no latency.
    max_active / max_waiting: requests decoding or running at once / queued for a turn (the rest
    get 503): what bounds the server's memory under parallel uploads.
    """
    model_path, dense_path = resolve_model_dirs(model_dir, dense_dir)
    loaded = load_model(model_path, dense_path, device=device)
    if timing_runs > 0:
        warm_up(loaded)  # before any request is timed: latency is reported only once this ran
    about = about_model(loaded, embedded=model_path == DEFAULT_MODEL_DIR)
    examples = load_examples(examples_dir)
    max_upload = int(max_upload_mb * 2**20)
    model_lock = threading.Lock()
    placeholders = _placeholder_tokens(loaded.processor)
    gate = WorkGate(max_active, max_waiting)
    shape_limits = {
        "max_aspect": max_aspect, "max_resized_pixels": max_resized_pixels,
        "resized_pixels": processor_resized_pixels(loaded.processor),
    }
    if tmp_dir is not None:
        Path(tmp_dir).mkdir(parents=True, exist_ok=True)

    def run_model(media: Any, prompt: str) -> dict[str, Any]:
        """In a worker thread: wait for the model, then analyse (one request at a time)."""
        start = time.perf_counter()
        with model_lock:
            waited = time.perf_counter() - start
            result = analyze(loaded, media, prompt, max_new_tokens=max_new_tokens, timing_runs=timing_runs)
        result["stats"]["latency_s"]["queue"] = waited
        return result

    def decode_and_run(path: Path, prompt: str, received: float) -> tuple[dict[str, Any], float]:
        """In a worker thread, inside one of the gate's slots: decode, then `run_model`. The decoded
        pictures live only in here, so at most `max_active` exist at once; their memory goes back
        to the system before the slot is given up. Returns (result, decode seconds)."""
        start = time.perf_counter()
        gate.acquire()
        try:
            waited = time.perf_counter() - start
            media = decode_media(path, num_frames, max_pixels, **shape_limits)
            decoded = time.perf_counter() - received - waited
            result = run_model(media, prompt)
            result["stats"]["latency_s"]["queue"] += waited
            return result, decoded
        finally:
            media = None
            release_memory()
            gate.release()

    async def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": {**loaded.describe(), "about": about},
                "limits": {
                    "max_upload_bytes": max_upload,
                    "max_prompt_chars": MAX_PROMPT_CHARS,
                    "max_new_tokens": max_new_tokens,
                    "num_frames": num_frames,
                    "timing_runs": timing_runs,
                    "max_pixels": max_pixels,
                    "max_aspect": max_aspect,
                    "max_active": max_active,
                    "max_waiting": max_waiting,
                },
                "examples": len(examples),
            }
        )

    async def list_examples(request: Request) -> Response:
        return JSONResponse(
            {
                "examples": [
                    {"name": e.name, "kind": e.kind, "prompt": e.prompt, "answer": e.answer,
                     "url": f"/api/examples/{e.name}"}
                    for e in examples.values()
                ]
            }
        )

    async def example_file(request: Request) -> Response:
        example = examples.get(request.path_params["name"])
        if example is None:
            return _error(f"unknown example; choose one of: {', '.join(examples) or 'none bundled'}", 404)
        return FileResponse(example.path(examples_dir), media_type=example.media_type)

    async def analyze_route(request: Request) -> Response:
        if not gate.admit():
            return JSONResponse(
                {"error": f"the demo is busy ({gate.active + gate.waiting} requests in progress); try again in a few seconds"},
                status_code=503, headers={"Retry-After": "5"},
            )
        try:
            return await _analyze(request)
        finally:
            gate.leave()

    async def _analyze(request: Request) -> Response:
        received = time.perf_counter()
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
            return _error(
                f"send multipart/form-data with a prompt and a file or an example, not {kind or 'a body without a content type'}",
                400,
            )
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=FORM_OVERHEAD)
        except _BodyTooLarge:
            return _too_large(max_upload)
        except MultiPartException as err:
            return _error(f"bad form data: {err}", 400)
        except (AssertionError, ValueError) as err:  # no / wrong content type
            return _error(f"send multipart/form-data with a prompt and a file or an example ({err})", 400)
        workdir = Path(tempfile.mkdtemp(prefix="vlmod-demo-", dir=tmp_dir))
        try:
            prompt = form.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                return _error("the prompt is empty: ask a question about the picture", 400)
            prompt = prompt.strip()
            if len(prompt) > MAX_PROMPT_CHARS:
                return _error(f"the prompt is too long ({len(prompt)} characters, at most {MAX_PROMPT_CHARS})", 400)
            found = [t for t in placeholders if t in prompt]
            if found:
                return _error(
                    f"the prompt contains {', '.join(found)}: image/video placeholders are added by the demo, "
                    "ask your question in plain text", 400,
                )
            upload, name = form.get("file"), form.get("example")
            has_upload = isinstance(upload, UploadFile) and bool(upload.filename or upload.size)
            if upload is not None and not isinstance(upload, UploadFile):
                return _error("'file' must be an uploaded file", 400)
            if has_upload and name:
                return _error("send either a file or an example name, not both", 400)
            if has_upload:
                path = workdir / "upload"  # never the client's file name
                size = await _save_upload(upload, path, max_upload)
                if size is None:
                    return _too_large(max_upload)
                source: dict[str, Any] = {"upload": {"bytes": size}}
            elif name:
                example = examples.get(str(name))
                if example is None:
                    return _error(f"unknown example {str(name)[:60]!r}; choose one of: {', '.join(examples)}", 404)
                path, source = example.path(examples_dir), {"example": example.name}
            else:
                return _error("no input: upload an image or a video, or pick an example", 400)
            try:
                result, decoded = await run_in_threadpool(decode_and_run, path, prompt, received)
            except MediaError as err:
                return _error(str(err), err.status)
            except AnalysisError as err:
                return _error(f"this model's token layout is not supported by the demo: {err}", 422)
            except ValueError as err:  # the processor or the model refused this prompt / picture
                return _error(f"the model could not process this input: {str(err).splitlines()[0][:300]}", 422)
        finally:
            await form.close()
            shutil.rmtree(workdir, ignore_errors=True)
        result["source"] = source
        result["stats"]["latency_s"]["decode"] = decoded
        return JSONResponse(result)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.detail or "error", exc.status_code)

    routes = [
        Route("/", index),
        Route("/api/health", health),
        Route("/api/examples", list_examples),
        Route("/api/examples/{name}", example_file),
        Route("/api/analyze", analyze_route, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {HTTPException: http_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.add_middleware(BodyLimit, limit=max_upload + FORM_OVERHEAD)
    app.state.loaded = loaded
    app.state.examples = examples
    return app


def _placeholder_tokens(processor: Any) -> list[str]:
    """The processor's image / video placeholder tokens (plus LLaVA's usual spellings): a prompt
    holding one would not match the pictures the demo sends, and the processor or model raises."""
    tokens = {"<image>", "<video>"}
    for attr in ("image_token", "video_token"):
        token = getattr(processor, attr, None)
        if isinstance(token, str) and token:
            tokens.add(token)
    return sorted(tokens)


async def _save_upload(upload: UploadFile, path: Path, limit: int) -> int | None:
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


def serve(
    model_dir: str | Path | None = None,
    dense_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    **kwargs: Any,
) -> None:
    """Load the model and serve the demo with uvicorn until interrupted. The port is bound before
    the model loads, so a busy port fails at once and the address printed is one that listens."""
    import socket

    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise DemoSetupError(
            f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port or --host"
        ) from None
    try:
        app = create_app(model_dir, dense_dir, **kwargs)
        sock.listen(128)
        if host in ("0.0.0.0", "::"):
            where = f"all interfaces, port {port} (http://{socket.gethostname()}:{port}, http://localhost:{port})"
        else:
            where = f"http://{'localhost' if host == '127.0.0.1' else host}:{port}"
        print(f"vlmod demo: serving {app.state.loaded.path} on {where}", flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        server.run(sockets=[sock])
    finally:
        sock.close()
