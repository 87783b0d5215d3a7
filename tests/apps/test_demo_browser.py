"""The demo page as a person meets it, in headless Chromium: a real-size photo shows the crop and
resolution the model saw, a 32-frame clip steps frame by frame, a bad upload after a good one
clears the old result, the latency panel appears only after a fair measurement, and the overlay
stays readable on a bright picture.

Needs Debian's Chromium at /usr/bin/chromium and playwright (skipped without them). One server and
one browser serve the whole module; each test opens its own page.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.checkpoints import save_converted, spread_routers
from PIL import Image, ImageDraw

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
playwright_api = pytest.importorskip("playwright.sync_api")

import vlmod  # noqa: E402
from vlmod.demo.app import create_app  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
FRAMES = 32
RUN_EDGE = (0x56, 0xB4, 0xE9)  # the outline of tokens that ran (app.js RUN_EDGE)

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoints(llava_workdir: Callable[..., Path]) -> tuple[Path, Path]:
    """(MoD, dense) tiny LLaVA: 32 px pictures, 8 px patches (a 4x4 token grid), language layers
    1 and 2 converted at capacity 0.5 with random routers, so maps differ from frame to frame."""
    root = llava_workdir("browser-ckpt")
    language = vlmod.MoDConfig(capacity=0.5, layers=[1, 2], routable=("image", "video"))
    return save_converted(root / "dense", root / "mod", language, routers=spread_routers), root / "dense"


def _serve(app: Any) -> Iterator[str]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def url(checkpoints: tuple[Path, Path]) -> Iterator[str]:
    mod, dense = checkpoints
    yield from _serve(create_app(mod, dense, max_new_tokens=4, num_frames=FRAMES, timing_runs=3))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, url: str) -> Iterator[Any]:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector(".example")
    yield page
    page.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 1024x768 photo-like picture, a bright one, a 32-frame clip, and a file that is no picture."""
    from vlmod.data.video import write_video

    root = tmp_path_factory.mktemp("browser-media")
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:768, 0:1024]
    photo = np.stack([xx * 255 // 1023, yy * 255 // 767, np.full_like(xx, 96)], -1).astype(np.uint8)
    img = Image.fromarray(photo)
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rng.integers(0, 900), rng.integers(0, 650)
        draw.ellipse((x, y, x + 120, y + 110), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    img.save(root / "photo.jpg", quality=90)
    # Grass under a bright sky: the scene the old yellow tint could not be read on.
    bright = np.zeros((256, 256, 3), np.uint8)
    bright[:128] = (235, 240, 250)
    bright[128:] = (90, 200, 60)
    Image.fromarray(bright).save(root / "bright.png")
    clip = np.zeros((FRAMES, 64, 64, 3), np.uint8)
    clip[:] = (40, 60, 90)
    for t in range(FRAMES):
        x = 2 * t
        clip[t, 20:40, x : x + 8] = (250, 220, 40)
    write_video(root / "clip.mp4", clip, fps=8)
    (root / "bad.png").write_bytes(b"this is not a picture\n" * 40)
    return {"photo": root / "photo.jpg", "bright": root / "bright.png", "clip": root / "clip.mp4",
            "bad": root / "bad.png"}


def _run(page: Any, path: Path, prompt: str = "what color is the circle ?") -> None:
    page.set_input_files("#file", str(path))
    page.fill("#prompt", prompt)
    page.click("#run")
    page.wait_for_function("['done', 'error'].includes(document.body.dataset.state)", timeout=120_000)


def _stage_pixels(page: Any) -> np.ndarray:
    """The stage canvas as an [H, W, 3] uint8 array (sent as a PNG: a pixel list is slow)."""
    import base64
    import io

    url = page.evaluate("document.getElementById('stage').toDataURL('image/png')")
    png = base64.b64decode(url.split(",", 1)[1])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


# ----------------------------------------------------------------------------- tests


def test_photo_shows_the_crop_and_resolution_the_model_saw(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["photo"])
    assert page.evaluate("document.body.dataset.state") == "done"
    note = page.inner_text("#seen-note")
    assert "centre 768×768 of your 1024×768 picture" in note and "32×32 px" in note
    assert "4×4 grid" in note
    assert page.is_visible("#crop-thumb")  # the photo with the crop outlined
    # The stage is square like the crop, not 4:3 like the upload.
    w, h = page.evaluate("[document.getElementById('stage').width, document.getElementById('stage').height]")
    assert abs(w - h) <= 1
    # Default: the model's own 32x32 pixels, drawn as blocks; "Sharp" shows the crop as uploaded.
    assert "Model's pixels 32×32" in page.inner_text("#pixels-toggle .active")
    blocky = _stage_pixels(page)
    page.click("#pixels-toggle button:not(.active)")
    sharp = _stage_pixels(page)
    assert blocky.shape == sharp.shape and not np.array_equal(blocky, sharp)
    result = page.evaluate("state.result.media[0]")
    assert result["crop"] == {"x": 128, "y": 0, "width": 768, "height": 768}
    assert result["original"] == {"width": 1024, "height": 768}
    assert result["model_size"] == {"width": 32, "height": 32}
    assert page.inner_text("#answer").strip()
    assert page.is_hidden("#ood-note")  # not the embedded model: no warning about it
    assert "FLOPS SAVED" in page.inner_text("#stats").upper()


def test_latency_panel_appears_only_after_a_fair_measurement(page: Any, media: dict[str, Path]) -> None:
    assert page.is_hidden("#latency")
    _run(page, media["photo"])
    assert page.is_visible("#latency")
    text = page.inner_text("#latency")
    assert "MoD" in text and "dense" in text and "×" in text
    assert "untraced" in text and "interleaved" in text and "3 runs each" in text and "median" in text
    timing = page.evaluate("state.result.stats.latency")
    assert len(timing["samples"]["mod"]) == len(timing["samples"]["dense"]) == 3


def test_no_latency_panel_without_a_fair_measurement(
    browser: Any, checkpoints: tuple[Path, Path], media: dict[str, Path]
) -> None:
    """timing_runs=0: no warm-up, no timed runs, so the page shows no latency at all."""
    mod, dense = checkpoints
    for url in _serve(create_app(mod, dense, max_new_tokens=2, timing_runs=0)):
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        try:
            page.goto(url)
            _run(page, media["photo"])
            assert page.evaluate("document.body.dataset.state") == "done"
            assert page.evaluate("state.result.stats.latency") is None
            assert page.is_hidden("#latency")
            assert "latency" not in page.inner_text("#output").lower()
        finally:
            page.close()


def test_a_32_frame_clip_steps_frame_by_frame(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["clip"], "which direction is it moving ?")
    assert page.evaluate("document.body.dataset.state") == "done", page.inner_text("#status")
    assert page.locator(".frame-card").count() == FRAMES
    assert page.is_visible("#frame-controls")
    # The strip scrolls sideways instead of overflowing the page.
    assert page.evaluate("document.getElementById('strip').scrollWidth > document.getElementById('strip').clientWidth")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    counts = page.evaluate("state.result.media.map(m => m.views[0].masks[0].reduce((a, b) => a + b, 0))")
    seen = set()
    for k in range(FRAMES):
        label = page.inner_text("#frame-label")
        assert label.startswith(f"Frame {k + 1} / {FRAMES}"), label
        seen.add(_stage_pixels(page).tobytes())
        if k < FRAMES - 1:
            page.click("#frame-next")
    assert page.is_disabled("#frame-next") and len(seen) > FRAMES // 2  # the stage follows the frame
    # The last frame's card is scrolled into view and marked.
    assert page.get_attribute(f".frame-card[data-index='{FRAMES - 1}']", "aria-current") == "true"
    assert page.locator(f".frame-card[data-index='{FRAMES - 1}']").is_visible()
    # Per-frame token counts for one layer; the slider and the arrow keys scrub.
    page.fill("#layer", "1")
    page.dispatch_event("#layer", "input")
    last = page.inner_text(f".frame-card[data-index='{FRAMES - 1}'] .frame-count")
    assert last == f"{counts[FRAMES - 1]}/16"
    assert f"{counts[FRAMES - 1]} of 16 tokens run" in page.inner_text("#frame-label")
    page.fill("#frame", "5")
    page.dispatch_event("#frame", "input")
    assert page.inner_text("#frame-label").startswith(f"Frame 6 / {FRAMES}")
    page.focus("#stage")
    page.keyboard.press("ArrowLeft")
    assert page.inner_text("#frame-label").startswith(f"Frame 5 / {FRAMES}")
    # At a phone's width nothing is wider than the screen and the frame controls stay.
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(200)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.is_visible("#frame-controls") and page.is_visible("#stage")


def test_bad_upload_after_a_good_one_clears_the_result(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["photo"])
    assert page.is_visible("#output") and page.inner_text("#answer").strip()
    _run(page, media["bad"])
    assert page.evaluate("document.body.dataset.state") == "error"
    assert page.is_hidden("#output") and page.is_hidden("#latency")
    assert page.evaluate("state.result") is None
    error = page.inner_text("#result-error")
    assert "Could not analyse" in error and "neither as an image" in error
    assert "neither as an image" in page.inner_text("#status")
    # The dropzone shows a file icon, not a broken thumbnail.
    page.wait_for_selector("#dz-preview .file-icon")
    assert page.locator("#dz-preview img").count() == 0
    # A good run afterwards brings the result back and hides the error.
    _run(page, media["photo"])
    assert page.is_visible("#output") and page.is_hidden("#result-error")


def test_overlay_dims_skipped_and_outlines_run_tokens_on_a_bright_picture(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["bright"])
    page.click("#pixels-toggle button:not(.active)")  # sharp: flat colours, so cells compare cleanly
    page.fill("#layer", "1")
    page.dispatch_event("#layer", "input")
    mask = page.evaluate("state.result.media[0].views[0].masks[0]")
    px = _stage_pixels(page).astype(int)
    h, w = px.shape[:2]
    cell_h, cell_w = h / 4, w / 4
    sky, grass = np.array((235, 240, 250)), np.array((90, 200, 60))
    edges = 0
    assert 0 < sum(mask) < len(mask)
    for i, ran in enumerate(mask):
        r, c = divmod(i, 4)
        centre = px[int((r + 0.5) * cell_h), int((c + 0.5) * cell_w)]
        scene = sky if r < 2 else grass
        if ran:  # the picture itself, untouched inside the outline
            assert np.abs(centre - scene).max() <= 8, (i, centre)
            band = px[int(r * cell_h) : int((r + 1) * cell_h), int(c * cell_w) : int(c * cell_w + 8)]
            edges += int((np.abs(band - np.array(RUN_EDGE)).sum(-1) < 40).any())
        else:  # dimmed to well under half its brightness, on sky and on grass alike
            assert centre.mean() < 0.5 * scene.mean(), (i, centre)
    assert edges == sum(mask)
    legend = page.inner_text("#legend")
    assert "processed" in legend and "skipped" in legend
