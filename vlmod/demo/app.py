"""The demo server: a Starlette app that serves the static page and a small JSON API.

API (errors are always `{"error": "..."}` with a 4xx status):

- `GET /api/health` -> `{"status": "ok", "model": {...}, "limits": {...}, "examples": N}`
- `GET /api/examples` -> `{"examples": [{"name", "kind", "prompt", "answer", "url"}]}`
- `GET /api/examples/{name}` -> the example's file (names from the bundled list only)
- `POST /api/analyze`, multipart: `prompt` and either `file` (an image or a video) or `example`
  (a bundled example's name) -> the analysis (`vlmod.demo.analysis.analyze`):

      {"kind": "image" | "video", "input": "image" | "frames" | "video", "prompt", "answer",
       "source": {"example": name} | {"upload": {"bytes": n}},
       "expected": null | {"answer", "mod": bool, "dense": bool | null} (a bundled example asked
                   its own question: each answer marked correct or wrong, as evaluation scores),
       "layers": {"language": {"total", "mod": [i, ...]}, "vision": {"total", "mod": [...]}},
       "media": [{"index", "time_s", "width", "height", "src": data URL of the part the model saw,
                  "original": {"width", "height", "src" (when cropped: the whole picture, upright)},
                  "crop": {"x", "y", "width", "height"} of it,
                  "model_size": {"width", "height"}, "model_src": data URL at the model's resolution,
                  "views": [{"name", "rows", "cols", "model_size" (this grid's resolution),
                             "model_src" (where it differs from the first grid's),
                             "counts": [rows*cols: MoD language layers that processed the token],
                             "masks": [per MoD language layer: rows*cols of 0/1]}],
                  "vision": null | {"name", "rows", "cols", "counts", "masks", "stats"},
                  "stats": {"tokens", "layer_passes", "dense_layer_passes", "compute_fraction"}}],
       "stats": {"vision_tokens", "text_tokens", "processed_per_layer", "tokens_skipped",
                 "skipped_fraction_mod_layers", "skipped_fraction_all_layers",
                 "flops": {"dense", "mod", "saved_fraction" (prefill, vision tower included),
                           "dense_language", "mod_language", "language_saved_fraction" (what MoD
                           cuts), "dense_vision", "mod_vision"},
                 "capacity": {part: {layer: the router's budget, a fixed fraction}},
                 "latency_s": {"preprocess", "generate" (the traced run), "queue", "decode"},
                 "latency": null | {"prefill" (time to first token), "decode" (seconds per token):
                                    {"mod_s", "dense_s", "speedup", "interval", "verdict",
                                     "predicted_speedup", ...}, "contended", "contention", "runs",
                                    "new_tokens", "samples", "purpose", "method"}
                            (`vlmod.demo.latency`: warm, untraced, interleaved, others held off),
                 "dense": null | {"answer", "same_answer"},
                 "vision_tower": {...} (when the tower is converted)}}

Safety: the request body is capped (413 past `max_upload_mb`), the upload is checked by decoding
it (`vlmod.demo.media`), it is written under a fixed name in a private temp folder that is removed
when the request ends, and examples are looked up by name. A picture is refused from its header
when too large, too elongated, or one the processor would resize to too many pixels. At most
`max_active` requests decode and run at a time (what bounds memory: a decoded picture exists only
inside that section), at most `max_waiting` more wait for a turn with nothing decoded, and the
rest get a 503; memory is handed back to the system after each request. The model runs in a
worker thread, one request at a time (a lock), so the server keeps answering while it works; while
it is timed, no other request decodes (`QuietTurn`). A client that goes away mid-upload ends its
request quietly (no traceback in the log).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from vlmod.demo import guards
from vlmod.demo.analysis import analyze
from vlmod.demo.checkpoints import resolve_checkpoint
from vlmod.demo.examples import EXAMPLES_DIR, Example, about_model, grade, load_examples
from vlmod.demo.guards import (
    MIN_UPLOAD_RATE,
    BodyLimit,
    BodyTooLarge,
    BodyTooSlow,
    Busy,
    Cancelled,
    QuietTurn,
    WorkGate,
    cancellable,
    error,
    save_upload,
    too_large,
    wait_turn,
    watch_disconnect,
)
from vlmod.demo.inference import warm_up
from vlmod.demo.latency import TIMING_RUNS
from vlmod.demo.layout import AnalysisError
from vlmod.demo.media import (
    MAX_ASPECT,
    MAX_PIXELS,
    MAX_RESIZED_PIXELS,
    MediaError,
    decode_media,
    looks_like_video,
    processor_resized_pixels,
)
from vlmod.demo.model import LoadedModel, load_model
from vlmod.training.memory import release_memory

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
DEFAULT_MODEL_DIR = HERE / "assets" / "model"
DEFAULT_DENSE_DIR = HERE / "assets" / "dense"
MAX_PROMPT_CHARS = 1000
FORM_OVERHEAD = 64 * 1024  # multipart boundaries, headers, the prompt


class DemoSetupError(RuntimeError):
    """The demo cannot start: no model to serve."""


class Refusal(Exception):
    """A request the demo answers with `{"error": message}` and a 4xx status."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__()
        self.response = response


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


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, and how many run at once (see `create_app`)."""

    max_upload: int  # bytes
    max_new_tokens: int
    num_frames: int
    timing_runs: int
    max_pixels: int
    max_aspect: float
    max_resized_pixels: int
    max_active: int
    max_waiting: int
    max_wait_s: float

    def report(self) -> dict[str, Any]:
        """The `limits` of /api/health."""
        return {
            "max_upload_bytes": self.max_upload,
            "max_prompt_chars": MAX_PROMPT_CHARS,
            "max_new_tokens": self.max_new_tokens,
            "num_frames": self.num_frames,
            "timing_runs": self.timing_runs,
            "max_pixels": self.max_pixels,
            "max_aspect": self.max_aspect,
            "max_active": self.max_active,
            "max_waiting": self.max_waiting,
            "max_wait_s": self.max_wait_s,
        }


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
    compile: bool = False,  # noqa: A002
    max_wait_s: float | None = None,
) -> Starlette:
    """The demo app serving `model_dir` (default: the embedded model) and, when given or embedded,
    its dense counterpart for side-by-side answers and latency.

    The model loads here, so a bad checkpoint fails at start, not on the first request; with
    `timing_runs` > 0 both models are warmed up here and each request times them fairly
    (`vlmod.demo.latency.measure_latency`), 0 reports no latency.
    max_active / max_waiting: requests decoding or running at once / queued for a turn (the rest
    get 503): what bounds the server's memory under parallel uploads. compile: both models decode
    compiled (`vlmod.compile`), compiled at the warm-up. max_wait_s: how long a request waits for
    a slot or the model before a 503 (None: `guards.MAX_WAIT_S`).
    """
    limits = Limits(
        max_upload=int(max_upload_mb * 2**20), max_new_tokens=max_new_tokens, num_frames=num_frames,
        timing_runs=timing_runs, max_pixels=max_pixels, max_aspect=max_aspect,
        max_resized_pixels=max_resized_pixels, max_active=max_active, max_waiting=max_waiting,
        max_wait_s=guards.MAX_WAIT_S if max_wait_s is None else max_wait_s,
    )
    model_path, dense_path = resolve_model_dirs(model_dir, dense_dir)
    loaded = load_model(model_path, dense_path, device=device, compile=compile)
    if timing_runs > 0:
        warm_up(loaded)  # before any request is timed: latency is reported only once this ran
    about = about_model(loaded, embedded=model_path == DEFAULT_MODEL_DIR)
    if tmp_dir is not None:
        Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    demo = Demo(loaded, about, load_examples(examples_dir), examples_dir, limits, tmp_dir)
    return demo.app()


class Demo:
    """The served model and the request handlers over it."""

    def __init__(
        self,
        loaded: LoadedModel,
        about: dict[str, Any],
        examples: dict[str, Example],
        examples_dir: Path,
        limits: Limits,
        tmp_dir: str | Path | None,
    ) -> None:
        self.loaded, self.about, self.limits, self.tmp_dir = loaded, about, limits, tmp_dir
        self.examples, self.examples_dir = examples, examples_dir
        self.model_lock = threading.Lock()
        self.stopping = threading.Event()  # set on SIGINT / SIGTERM: requests in progress end at their next token
        self.gate = WorkGate(limits.max_active, limits.max_waiting)
        self.quiet = QuietTurn()
        self.placeholders = _placeholder_tokens(loaded.processor)
        self.shape_limits = {
            "max_aspect": limits.max_aspect, "max_resized_pixels": limits.max_resized_pixels,
            "resized_pixels": processor_resized_pixels(loaded.processor),
        }

    def app(self) -> Starlette:
        """The Starlette app: the page, the static files and the JSON API, behind the body cap."""
        routes = [
            Route("/", self.index),
            Route("/api/health", self.health),
            Route("/api/examples", self.list_examples),
            Route("/api/examples/{name}", self.example_file),
            Route("/api/analyze", self.analyze, methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]
        handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {HTTPException: _http_error}
        app = Starlette(routes=routes, exception_handlers=handlers)
        app.add_middleware(BodyLimit, limit=self.limits.max_upload + FORM_OVERHEAD)
        app.state.loaded = self.loaded
        app.state.stopping = self.stopping
        app.state.examples = self.examples
        return app

    # -- the small routes ----------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": {**self.loaded.describe(), "about": self.about},
                "limits": self.limits.report(),
                "examples": len(self.examples),
            }
        )

    async def list_examples(self, request: Request) -> Response:
        return JSONResponse(
            {
                "examples": [
                    {"name": e.name, "kind": e.kind, "prompt": e.prompt, "answer": e.answer,
                     "url": f"/api/examples/{e.name}"}
                    for e in self.examples.values()
                ]
            }
        )

    async def example_file(self, request: Request) -> Response:
        example = self.examples.get(request.path_params["name"])
        if example is None:
            return error(f"unknown example; choose one of: {', '.join(self.examples) or 'none bundled'}", 404)
        return FileResponse(example.path(self.examples_dir), media_type=example.media_type)

    # -- POST /api/analyze: admit, read the form, check the prompt, find the input, run -------

    async def analyze(self, request: Request) -> Response:
        if not self.gate.admit():
            return self._busy()
        try:
            return await self._analyze(request)
        except Refusal as refusal:
            return refusal.response
        finally:
            self.gate.leave()

    def _busy(self) -> JSONResponse:
        return JSONResponse(
            {"error": f"the demo is busy ({self.gate.active + self.gate.waiting} requests in progress); try again in a few seconds"},
            status_code=503, headers={"Retry-After": "5"},
        )

    async def _analyze(self, request: Request) -> Response:
        received = time.perf_counter()
        form = await self._read_form(request)
        workdir = Path(tempfile.mkdtemp(prefix="vlmod-demo-", dir=self.tmp_dir))
        left = threading.Event()  # the client went away: its request stops holding a slot or the model
        watch = asyncio.ensure_future(watch_disconnect(request, left))
        try:
            prompt = self._prompt(form)
            path, source = await self._input(form, workdir)
            try:
                result, decoded = await run_in_threadpool(self.decode_and_run, path, prompt, received, left)
            except Busy:
                return self._busy()
            except Cancelled:
                why = "the demo is stopping" if self.stopping.is_set() else "the client went away"
                return error(f"{why}: the request was stopped; try again", 503)
            except MediaError as err:
                return error(_plain_media_error(err, path), err.status)
            except AnalysisError as err:
                return error(f"this model's token layout is not supported by the demo: {err}", 422)
            except ValueError as err:  # the processor or the model refused this prompt / picture
                return error(f"the model could not process this input: {str(err).splitlines()[0][:300]}", 422)
        finally:
            watch.cancel()
            await form.close()
            shutil.rmtree(workdir, ignore_errors=True)
        result["source"] = source
        example = self.examples.get(source.get("example", ""))
        dense = result["stats"]["dense"]
        result["expected"] = None if example is None else grade(
            example, prompt, result["answer"], None if dense is None else dense["answer"]
        )
        result["stats"]["latency_s"]["decode"] = decoded
        return JSONResponse(result)

    async def _read_form(self, request: Request) -> FormData:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
            raise Refusal(error(
                f"send multipart/form-data with a prompt and a file or an example, not {kind or 'a body without a content type'}",
                400,
            ))
        try:
            return await request.form(max_files=1, max_fields=8, max_part_size=FORM_OVERHEAD)
        except BodyTooLarge:
            raise Refusal(too_large(self.limits.max_upload)) from None
        except ClientDisconnect:  # nobody is left to read an answer: end without a traceback
            raise Refusal(error("the client went away before its upload arrived", 400)) from None
        except BodyTooSlow:
            raise Refusal(error(
                f"the upload arrived too slowly (the demo needs {MIN_UPLOAD_RATE // 1024} KB a second, over any "
                f"{guards.RATE_WINDOW_S:.0f} s once the first {guards.UPLOAD_GRACE_S:.0f} s have passed); try again "
                "on a faster connection", 408,
            )) from None
        except (MultiPartException, HTTPException) as err:  # Starlette raises the parser's as a 400
            detail = str(getattr(err, "detail", None) or getattr(err, "message", None) or err)
            if "exceeded maximum size" in detail:  # a text field (the prompt) over FORM_OVERHEAD
                raise Refusal(error(
                    f"the prompt is too long (over {FORM_OVERHEAD // 1024} KB; at most {MAX_PROMPT_CHARS} characters)", 413,
                )) from None
            raise Refusal(error(f"bad form data: {detail}", 400)) from None
        except (AssertionError, ValueError) as err:  # no / wrong content type
            raise Refusal(error(f"send multipart/form-data with a prompt and a file or an example ({err})", 400)) from None

    def _prompt(self, form: FormData) -> str:
        prompt = form.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise Refusal(error("the prompt is empty: ask a question about the picture", 400))
        prompt = prompt.strip()
        if len(prompt) > MAX_PROMPT_CHARS:
            raise Refusal(error(f"the prompt is too long ({len(prompt)} characters, at most {MAX_PROMPT_CHARS})", 400))
        found = [t for t in self.placeholders if t in prompt]
        if found:
            raise Refusal(error(
                f"the prompt contains {', '.join(found)}: image/video placeholders are added by the demo, "
                "ask your question in plain text", 400,
            ))
        return prompt

    async def _input(self, form: FormData, workdir: Path) -> tuple[Path, dict[str, Any]]:
        """(the file to decode, the result's `source`): the upload, saved under a fixed name in
        `workdir`, or a bundled example by name."""
        upload, name = form.get("file"), form.get("example")
        has_upload = isinstance(upload, UploadFile) and bool(upload.filename or upload.size)
        if upload is not None and not isinstance(upload, UploadFile):
            raise Refusal(error("'file' must be an uploaded file", 400))
        if has_upload and name:
            raise Refusal(error("send either a file or an example name, not both", 400))
        if has_upload:
            path = workdir / "upload"  # never the client's file name
            size = await save_upload(upload, path, self.limits.max_upload)
            if size is None:
                raise Refusal(too_large(self.limits.max_upload))
            return path, {"upload": {"bytes": size}}
        if name:
            example = self.examples.get(str(name))
            if example is None:
                raise Refusal(error(f"unknown example {str(name)[:60]!r}; choose one of: {', '.join(self.examples)}", 404))
            return example.path(self.examples_dir), {"example": example.name}
        raise Refusal(error("no input: upload an image or a video, or pick an example", 400))

    # -- the heavy section, in worker threads ----------------------------------------------------

    def decode_and_run(self, path: Path, prompt: str, received: float,
                       left: threading.Event | None = None) -> tuple[dict[str, Any], float]:
        """Inside one of the gate's slots: decode, then `run_model`. The decoded pictures live only
        in here, so at most `max_active` exist at once; their memory goes back to the system before
        the slot is given up. Returns (result, decode seconds). Busy when no slot or no turn at the
        model comes within `max_wait_s`; Cancelled once `left` or `stopping` is set (a wait gives up,
        a generate stops at its next token)."""
        events = (self.stopping,) if left is None else (self.stopping, left)
        with cancellable(events, time.monotonic() + self.limits.max_wait_s):
            return self._decode_and_run(path, prompt, received)

    def _decode_and_run(self, path: Path, prompt: str, received: float) -> tuple[dict[str, Any], float]:
        start = time.perf_counter()
        wait_turn(self.gate.acquire)
        try:
            waited = time.perf_counter() - start
            limits = self.limits
            with self.quiet.shared():  # never while another request is timed
                media = decode_media(path, limits.num_frames, limits.max_pixels, **self.shape_limits)
            decoded = time.perf_counter() - received - waited
            result = self.run_model(media, prompt)
            result["stats"]["latency_s"]["queue"] += waited
            return result, decoded
        finally:
            media = None
            release_memory()
            self.gate.release()

    def run_model(self, media: Any, prompt: str) -> dict[str, Any]:
        """Wait for the model, then analyse (one request at a time)."""
        start = time.perf_counter()
        wait_turn(lambda timeout: self.model_lock.acquire(timeout=timeout))
        try:
            waited = time.perf_counter() - start
            result = analyze(
                self.loaded, media, prompt, max_new_tokens=self.limits.max_new_tokens,
                timing_runs=self.limits.timing_runs, hold_off=self.quiet.exclusive,
            )
        finally:
            self.model_lock.release()
        result["stats"]["latency_s"]["queue"] = waited
        return result


def _plain_media_error(err: MediaError, path: Path) -> str:
    """The page's sentence for an upload that did not decode: a video that starts like one but does
    not decode is cut short or damaged (the decoder's own words help nobody: "ERROR opening: ...,
    Invalid data found when processing input"); other refusals already say what to do."""
    if err.status != 400:
        return str(err)
    try:
        with path.open("rb") as f:
            video = looks_like_video(f.read(16))
    except OSError:
        video = False
    if video:
        return ("This video is corrupt or cut short, so it could not be decoded (an upload or download "
                "that stopped early does this). Export or download it again, or try another file.")
    return str(err)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error(exc.detail or "error", exc.status_code)


def _placeholder_tokens(processor: Any) -> list[str]:
    """The processor's image / video placeholder tokens (plus LLaVA's usual spellings): a prompt
    holding one would not match the pictures the demo sends, and the processor or model raises."""
    tokens = {"<image>", "<video>"}
    for attr in ("image_token", "video_token"):
        token = getattr(processor, attr, None)
        if isinstance(token, str) and token:
            tokens.add(token)
    return sorted(tokens)
