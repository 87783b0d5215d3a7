"""The demo page as a person meets it, in headless Chromium: a real-size photo shows the crop and
resolution the model saw (sharp by default, the crop outlined on the picture as the server turned
it), a 32-frame clip steps and plays frame by frame with its strip following, a new or refused file
clears what was on screen, errors are said once, the latency panel shows prefill and decode apart
with their spread and predictions, the FLOPs and budget cards say what they count, and the overlay
and its legend stay readable.

Needs Debian's Chromium at /usr/bin/chromium and playwright (skipped without them). One server and
one browser serve the whole module; each test opens its own page.
"""

from __future__ import annotations

import re
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
    (root / "truncated.mp4").write_bytes((root / "clip.mp4").read_bytes()[:1500])
    # Stored 400x300, top half red, bottom half blue, with EXIF orientation 6 (turn 90 degrees
    # clockwise to show): a browser shows it 300x400, blue on the left, red on the right.
    turned = np.zeros((300, 400, 3), np.uint8)
    turned[:150] = (220, 30, 30)
    turned[150:] = (30, 60, 220)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(turned).save(root / "turned.jpg", quality=92, exif=exif)
    # Dark marks on a transparent background.
    clear = Image.new("RGBA", (200, 120), (0, 0, 0, 0))
    ImageDraw.Draw(clear).rectangle((20, 40, 180, 80), fill=(20, 20, 20, 255))
    clear.save(root / "transparent.png")
    return {"photo": root / "photo.jpg", "bright": root / "bright.png", "clip": root / "clip.mp4",
            "bad": root / "bad.png", "truncated": root / "truncated.mp4", "turned": root / "turned.jpg",
            "transparent": root / "transparent.png"}


def _run(page: Any, path: Path, prompt: str = "what color is the circle ?") -> None:
    page.set_input_files("#file", str(path))
    page.fill("#prompt", prompt)
    page.click("#run")
    page.wait_for_function("['done', 'error'].includes(document.body.dataset.state)", timeout=120_000)


def _card_in_strip(page: Any, k: int) -> bool:
    """Whether frame card `k` lies wholly inside the strip's visible part."""
    return page.evaluate(
        """k => {
          const strip = document.getElementById('strip').getBoundingClientRect();
          const card = document.querySelector(`.frame-card[data-index="${k}"]`).getBoundingClientRect();
          return card.left >= strip.left - 1 && card.right <= strip.right + 1;
        }""",
        k,
    )


def _canvas_pixels(page: Any, selector: str) -> np.ndarray:
    import base64
    import io

    url = page.evaluate(f"document.querySelector('{selector}').toDataURL('image/png')")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


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
    # An upload is shown sharp by default; "Model's pixels" draws the model's own 32x32 as blocks.
    assert page.inner_text("#pixels-toggle .active") == "Sharp"
    sharp = _stage_pixels(page)
    page.click("#pixels-toggle button:not(.active)")
    assert "Model's pixels 32×32" in page.inner_text("#pixels-toggle .active")
    blocky = _stage_pixels(page)
    assert blocky.shape == sharp.shape and not np.array_equal(blocky, sharp)
    result = page.evaluate("state.result.media[0]")
    assert result["crop"] == {"x": 128, "y": 0, "width": 768, "height": 768}
    assert (result["original"]["width"], result["original"]["height"]) == (1024, 768)
    assert result["model_size"] == {"width": 32, "height": 32}
    assert page.inner_text("#answer").strip()
    assert page.is_hidden("#ood-note")  # not the embedded model: no warning about it


def test_latency_panel_shows_prefill_and_decode_apart_with_spread_and_predictions(
    page: Any, media: dict[str, Path]
) -> None:
    assert page.is_hidden("#latency")
    _run(page, media["photo"])
    assert page.is_visible("#latency")
    text = page.inner_text("#latency")
    rows = page.locator("#latency .latency-row")
    assert rows.count() == 2
    prefill, decode = rows.nth(0).inner_text(), rows.nth(1).inner_text()
    # Before: "predicted 1.4x from FLOPs", which FLOPs unsaid; a ratio below 1 read "0.88x slower".
    assert prefill.startswith("Time to first token") and "predicted" in prefill
    assert "from the whole prefill's FLOPs, vision tower included" in prefill
    assert decode.startswith("Decode") and "/token" in decode and "from bytes read" in decode
    assert "MoD is for the prefill" in text
    assert "untraced" in text and "interleaved" in text and "held off" in text and "3 greedy generates" in text
    timing = page.evaluate("state.result.stats.latency")
    assert len(timing["samples"]["mod"]["first_token_s"]) == len(timing["samples"]["dense"]["first_token_s"]) == 3
    for k, name in enumerate(("prefill", "decode")):
        figure = timing[name]
        words = rows.nth(k).locator(".speedup").inner_text()
        # Never a verdict inside the noise or on a contended machine.
        if figure["verdict"] == "within noise":
            assert words.startswith("within noise") and "faster" not in words and "slower" not in words
        elif figure["verdict"] == "contended":
            assert "contended, no verdict" in words and "faster" not in words and "slower" not in words
        else:
            lo, hi = figure["interval"]
            assert (lo > 1) == (figure["verdict"] == "faster") and (hi < 1) == (figure["verdict"] == "slower")
            assert figure["verdict"] in words
            # Faster or slower by a ratio of at least 1: never "0.88× slower".
            said = [float(x) for x in re.findall(r"([0-9.]+)× (?:faster|slower)", words)]
            assert said and min(said) >= 1.0, words
            assert f"{max(figure['speedup'], 1 / figure['speedup']):.2f}× {figure['verdict']}" in words
    assert page.is_visible("#latency .latency-contended") == timing["contended"]


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
    # The last frame's card is scrolled into the strip's view and marked.
    assert page.get_attribute(f".frame-card[data-index='{FRAMES - 1}']", "aria-current") == "true"
    assert _card_in_strip(page, FRAMES - 1)
    # Per-frame token counts for one layer; the slider and the arrow keys scrub. Before: the strip's
    # heading said "vision tokens run" over counts of token-layer passes (all layers).
    assert page.text_content("#strip-what") == "vision token-layer passes run (all MoD layers)"
    page.fill("#layer", "1")
    page.dispatch_event("#layer", "input")
    assert page.text_content("#strip-what") == "vision tokens run in layer L1"
    last = page.inner_text(f".frame-card[data-index='{FRAMES - 1}'] .frame-count")
    assert last == f"{counts[FRAMES - 1]}/16"
    assert f"{counts[FRAMES - 1]} of 16 tokens run" in page.inner_text("#frame-label")
    page.fill("#frame", "5")
    page.dispatch_event("#frame", "input")
    assert page.inner_text("#frame-label").startswith(f"Frame 6 / {FRAMES}")
    assert _card_in_strip(page, 5)  # the strip follows the slider back
    page.focus("#stage")
    page.keyboard.press("ArrowLeft")
    assert page.inner_text("#frame-label").startswith(f"Frame 5 / {FRAMES}")
    # Each slider has its heading.
    assert page.text_content("#frame-heading") == "Frame" and page.is_visible("#frame-heading")
    assert page.text_content("#layer-heading") == "Language-model layer" and page.is_visible("#layer-heading")
    # Play steps through the frames by itself, the strip following; pause stops it.
    assert page.inner_text("#frame-play") == "▶ Play"
    page.click("#frame-play")
    assert page.get_attribute("#frame-play", "aria-pressed") == "true" and "Pause" in page.inner_text("#frame-play")
    page.wait_for_function("state.frame >= 12", timeout=20_000)
    assert _card_in_strip(page, page.evaluate("state.frame"))
    page.click("#frame-play")
    assert page.get_attribute("#frame-play", "aria-pressed") == "false"
    stopped = page.evaluate("state.frame")
    page.wait_for_timeout(800)
    assert page.evaluate("state.frame") == stopped
    # A new run starts the strip at its first frame.
    page.fill("#frame", str(FRAMES - 1))
    page.dispatch_event("#frame", "input")
    assert page.evaluate("document.getElementById('strip').scrollLeft") > 0
    _run(page, media["clip"], "which direction is it moving ?")
    assert _card_in_strip(page, 0)
    # At a phone's width nothing is wider than the screen and the frame controls stay.
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(200)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.is_visible("#frame-controls") and page.is_visible("#stage")
    for k in (5, 20, 3):  # the narrow strip still shows the selected card whole
        page.fill("#frame", str(k))
        page.dispatch_event("#frame", "input")
        page.wait_for_timeout(100)
        assert _card_in_strip(page, k), k


def test_an_example_answer_is_marked_against_the_expected_one(page: Any, media: dict[str, Path]) -> None:
    """Before: an example's wrong answer stood unmarked beside "expected answer: star". Now: each
    answer to an example asked its own question carries a mark (the fixture's random model: wrong);
    an upload gets none. The prompt box takes at most the server's limit."""
    page.click(".example[data-name='shape-star']")
    page.click("#run")
    page.wait_for_function("['done', 'error'].includes(document.body.dataset.state)", timeout=120_000)
    expected = page.evaluate("state.result.expected")
    assert expected["answer"] == "star" and expected["mod"] is False
    mark = page.inner_text("#answer-mark")
    assert mark == "✗ wrong (expected star)" and "wrong" in page.get_attribute("#answer-mark", "class")
    dense = page.inner_text("#dense-mark")
    assert dense == ("✓ correct" if expected["dense"] else "✗ wrong (expected star)")
    _run(page, media["photo"])
    assert page.locator("#answer-mark").count() == 0 and page.locator("#dense-mark").count() == 0
    # Before: no length limit on the prompt box (a 100 KB prompt got the server's raw error).
    assert page.evaluate("document.getElementById('prompt').maxLength") == 1000


def test_bad_upload_after_a_good_one_clears_the_result(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["photo"])
    assert page.is_visible("#output") and page.inner_text("#answer").strip()
    _run(page, media["bad"])
    assert page.evaluate("document.body.dataset.state") == "error"
    assert page.is_hidden("#output") and page.is_hidden("#latency")
    assert page.evaluate("state.result") is None
    error = page.inner_text("#result-error")
    assert "Could not analyse" in error and "neither as an image" in error
    # Said once: in the result panel, not again beside the Run button.
    assert page.inner_text("body").count("neither as an image") == 1
    assert "neither as an image" not in page.inner_text("#status")
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


def test_stats_say_what_they_count(page: Any, media: dict[str, Path]) -> None:
    """The FLOPs cards name the language model's prefill (what MoD cuts) and the total with the
    tower; the share of tokens skipped is the router's fixed budget, not a measurement."""
    _run(page, media["photo"])
    cards = {page.locator("#stats .stat-label").nth(i).text_content(): page.locator("#stats .stat").nth(i).inner_text()
             for i in range(page.locator("#stats .stat").count())}
    flops = page.evaluate("state.result.stats.flops")
    language = cards["Language-model prefill FLOPs"]
    assert f"{100 * flops['language_saved_fraction']:.1f}% saved" in language and "what MoD cuts" in language
    total = cards["Total prefill FLOPs"]
    assert f"{100 * flops['saved_fraction']:.1f}% saved" in total and "vision tower" in total
    budget = cards["Router budget"]
    assert "capacity 50%" in budget and "fixed budget" in budget and "not a measurement" in budget


def test_a_new_choice_clears_the_old_result_and_error(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["photo"])
    assert page.is_visible("#output") and "1024×768" in page.inner_text("#seen-note")
    page.set_input_files("#file", str(media["bright"]))
    # Nothing about the photo is left on screen before Run.
    assert page.is_hidden("#output") and page.is_visible("#empty")
    assert page.evaluate("state.result") is None and "1024×768" not in page.inner_text("#result")
    _run(page, media["bad"])
    assert page.is_visible("#result-error")
    page.set_input_files("#file", str(media["photo"]))
    assert page.is_hidden("#result-error") and page.inner_text("#status").strip() == ""
    _run(page, media["bad"])
    page.click(".example >> nth=0")  # an example is a new choice too
    assert page.is_hidden("#result-error") and page.is_visible("#empty")


def test_a_refused_file_clears_the_selection(page: Any, media: dict[str, Path]) -> None:
    page.set_input_files("#file", str(media["bright"]))
    page.fill("#prompt", "what color is the circle ?")
    assert page.is_enabled("#run")
    page.evaluate("state.limits.max_upload_bytes = 5000")
    page.set_input_files("#file", str(media["photo"]))  # tens of KB: over the limit
    assert "the demo takes up to" in page.inner_text("#status")
    # Run cannot analyse the refused file, nor the one chosen before it.
    assert page.is_disabled("#run") and page.evaluate("state.source") is None
    assert page.inner_text("#dz-title") == "Drop an image or a video"
    assert page.evaluate("document.getElementById('file').value") == ""


def test_a_truncated_clip_reads_as_a_plain_sentence(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["truncated"], "which direction is it moving ?")
    assert page.evaluate("document.body.dataset.state") == "error"
    message = page.inner_text("#result-error-message")
    assert message.startswith("This video is corrupt or cut short") and "again" in message
    assert "ERROR" not in message and "Invalid data" not in message
    assert page.inner_text("body").count("corrupt or cut short") == 1


def test_crop_is_outlined_on_the_picture_as_the_server_turned_it(page: Any, media: dict[str, Path]) -> None:
    """A photo with an EXIF orientation: the browser shows it turned; the crop box is in the
    pixels the server decoded, so the outline is drawn on the server's picture, whichever way the
    server turned it."""
    _run(page, media["turned"])
    assert page.evaluate("document.body.dataset.state") == "done"
    item = page.evaluate("state.result.media[0]")
    o, c = item["original"], item["crop"]
    assert page.is_visible("#crop-thumb")
    box = page.locator("#crop-thumb").bounding_box()
    w, h = box["width"], box["height"]
    assert abs(h - w * o["height"] / o["width"]) <= 1  # the server's shape, not the browser's
    import base64
    import io

    server = np.asarray(Image.open(io.BytesIO(base64.b64decode(o["src"].split(",", 1)[1]))).convert("RGB")).astype(int)
    thumb = _canvas_pixels(page, "#crop-thumb").astype(int)
    # A point inside the crop, off its centre: the thumb shows the server's colour there.
    fx, fy = (c["x"] + 0.3 * c["width"]) / o["width"], (c["y"] + 0.3 * c["height"]) / o["height"]
    want = server[int(fy * server.shape[0]), int(fx * server.shape[1])]
    got = thumb[int(fy * thumb.shape[0]), int(fx * thumb.shape[1])]
    assert np.abs(want - got).max() <= 40, (want, got)


def test_a_transparent_png_is_shown_on_a_light_background(page: Any, media: dict[str, Path]) -> None:
    import io

    page.set_input_files("#file", str(media["transparent"]))
    page.wait_for_selector("#dz-preview img")
    page.wait_for_function("document.querySelector('#dz-preview img').complete")
    shot = np.asarray(Image.open(io.BytesIO(page.locator("#dz-preview").screenshot())).convert("L"))
    assert shot.mean() > 140  # transparent parts light (checkerboard), not black


def test_the_shading_legend_has_levels_that_can_be_told_apart(page: Any, media: dict[str, Path]) -> None:
    _run(page, media["photo"])
    dims = page.evaluate(
        "[...document.querySelectorAll('#legend .swatch')].map(s => parseFloat(s.style.getPropertyValue('--dim')))"
    )
    assert len(dims) == 3  # 2 MoD layers: ran at both, at one, at none
    assert min(abs(a - b) for i, a in enumerate(dims) for b in dims[i + 1 :]) >= 0.2
    # However many MoD layers, at most four shades, each at least 0.2 apart.
    for n in (2, 3, 7, 16):
        levels = sorted(set(page.evaluate(f"[...Array({n} + 1).keys()].map(k => dimFor(k, {n}))")))
        assert len(levels) <= 4 and all(b - a >= 0.2 for a, b in zip(levels, levels[1:], strict=False))


def test_overview_caption_states_its_own_grid_and_cells(
    browser: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An anyres model: a wide picture gets a high-res grid and an overview; each caption states
    the resolution and cell size of its own grid."""
    from vlmod.models import tiny

    root = tmp_path_factory.mktemp("anyres")
    tiny.save("llava_next_video", root / "dense", image_size=32, patch_size=8)
    language = vlmod.MoDConfig(capacity=0.5, layers=[1, 2], routable=("image", "video"))
    mod = save_converted(root / "dense", root / "mod", language, routers=spread_routers)
    wide = root / "wide.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 80, 3), dtype=np.uint8)).save(wide)
    for url in _serve(create_app(mod, None, max_new_tokens=2, timing_runs=0)):
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        try:
            page.goto(url)
            _run(page, wide, "what ?")
            assert page.evaluate("document.body.dataset.state") == "done", page.inner_text("#result")
            views = page.evaluate("state.result.media[0].views")
            high = views[0]
            note = page.inner_text("#seen-note")
            assert f"resized to {high['cols'] * 8}×{high['rows'] * 8} px" in note
            assert f"{high['cols']}×{high['rows']} grid of 8×8 px (high-res)" in note
            page.click("#view-toggle button:has-text('overview')")
            note = page.inner_text("#seen-note")
            assert "resized to 32×32 px" in note and "4×4 grid of 8×8 px (overview)" in note, note
            page.click("#pixels-toggle button:not(.active)")  # the model's pixels of the overview: square
            w, h = page.evaluate("[document.getElementById('stage').width, document.getElementById('stage').height]")
            assert abs(w - h) <= 1
        finally:
            page.close()
