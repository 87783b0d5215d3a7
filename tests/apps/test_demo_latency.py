"""The demo's latency figures: prefill (time to first token) and decode per token timed apart
inside each generate, MoD and dense interleaved with the server's other requests held off, each
figure with its interval and a verdict only outside the noise (`vlmod.demo.latency`)."""

from __future__ import annotations

import contextlib
import io
import threading
import time

import numpy as np
import pytest
from helpers.checkpoints import save_converted, spread_routers
from PIL import Image

pytest.importorskip("starlette")
pytest.importorskip("multipart")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

import vlmod  # noqa: E402
from vlmod.demo import analysis, latency  # noqa: E402
from vlmod.demo.app import create_app  # noqa: E402
from vlmod.models import tiny  # noqa: E402


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    """A tiny LLaVA, language layers 1 and 2 converted at capacity 0.5, and its dense original."""
    root = tmp_path_factory.mktemp("latency")
    dense = tiny.save("llava", root / "dense", image_size=32, patch_size=8)
    language = vlmod.MoDConfig(capacity=0.5, layers=[1, 2], routable=("image", "video"))
    mod = save_converted(dense, root / "mod", language, routers=spread_routers)
    return TestClient(create_app(mod, dense, max_new_tokens=4, timing_runs=1))


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _clean(timings, extra_samples=None):
    from vlmod.bench.timing import Contention

    repeats = len(next(iter(timings.values())).wall_s)
    return Contention(list(range(repeats)), False, 0.0, {})


def test_measure_latency_times_prefill_and_decode_apart_interleaved(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Time to first token and seconds per decode step read inside each generate (a clock called
    per new token), MoD and dense interleaved in alternating order, inside the caller's hold-off."""
    loaded = client.app.state.loaded
    calls: list[tuple[str, bool]] = []
    # (first token, decode step) per call: MoD's prefill clearly faster, decode the same.
    times = {"mod": iter([(0.10, 0.050), (0.11, 0.051), (0.09, 0.049)]),
             "dense": iter([(0.20, 0.050), (0.21, 0.049), (0.19, 0.051)])}
    held: list[bool] = []

    def fake(model, inputs, processor, max_new_tokens, exact=False, clock=None):
        name = "mod" if model is loaded.model else "dense"
        calls.append((name, exact))
        first, step = next(times[name])
        start = clock.calls[-1][0]
        clock.calls[-1] += [start + first + i * step for i in range(max_new_tokens)]
        held.append(bool(inside))
        return "x", 0.0

    inside: list[int] = []

    @contextlib.contextmanager
    def hold_off():
        inside.append(1)
        yield
        inside.pop()

    monkeypatch.setattr(latency, "generate", fake)
    monkeypatch.setattr(latency, "contention", _clean)
    timing = latency.measure_latency(loaded, {}, 4, runs=3, predicted={"prefill": 2.5, "decode": 1.0}, hold_off=hold_off)
    assert [c[0] for c in calls] == ["mod", "dense", "dense", "mod", "mod", "dense"]  # alternating order
    assert all(exact for _, exact in calls) and all(held)  # same tokens for both, others held off
    prefill, decode = timing["prefill"], timing["decode"]
    assert prefill["mod_s"] == pytest.approx(0.10) and prefill["dense_s"] == pytest.approx(0.20)
    assert prefill["speedup"] == pytest.approx(2.0) and prefill["verdict"] == "faster"
    assert prefill["interval"] == pytest.approx([0.21 / 0.11, 0.19 / 0.09])  # lowest, highest paired ratio
    assert prefill["predicted_speedup"] == 2.5 and decode["predicted_speedup"] == 1.0
    assert decode["mod_s"] == pytest.approx(0.050) and decode["verdict"] == "within noise"
    assert timing["samples"]["mod"]["first_token_s"] == pytest.approx([0.10, 0.11, 0.09])
    assert "interleaved" in timing["method"] and "held off" in timing["method"]
    assert latency.measure_latency(loaded, {}, 4, runs=0) is None
    monkeypatch.setattr(loaded, "warm_up_s", None)
    assert latency.measure_latency(loaded, {}, 4, runs=3) is None  # not warmed up: nothing fair to show


def test_contended_timing_carries_no_verdict(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from vlmod.bench.timing import Contention

    loaded = client.app.state.loaded

    def fake(model, inputs, processor, max_new_tokens, exact=False, clock=None):
        first = 0.1 if model is loaded.model else 0.3
        clock.calls[-1] += [clock.calls[-1][0] + first + i * 0.01 for i in range(max_new_tokens)]
        return "x", 0.0

    busy = Contention([0, 1, 2], True, 1.5, {}, "other processes held 1.50 cores on average in 3 of 3 repeats")
    monkeypatch.setattr(latency, "generate", fake)
    monkeypatch.setattr(latency, "contention", lambda timings, extra_samples=None: busy)
    timing = latency.measure_latency(loaded, {}, 4, runs=3)
    assert timing["contended"] is True and "1.50 cores" in timing["contention"]["reason"]
    assert timing["prefill"]["speedup"] == pytest.approx(3.0) and timing["prefill"]["verdict"] == "contended"
    assert timing["decode"]["verdict"] == "contended"


@pytest.mark.parametrize(
    ("dense", "mod", "verdict"),
    [
        ([1.16, 0.88, 1.39, 0.77, 1.08], [1.0] * 5, "within noise"),  # the five uploads
        ([0.086, 0.086, 0.087], [0.085, 0.086, 0.085], "within noise"),  # 86 vs 85 ms
        ([0.20, 0.21, 0.19], [0.10, 0.11, 0.09], "faster"),
        ([0.10, 0.11, 0.09], [0.13, 0.14, 0.12], "slower"),
        ([1.05, 1.06, 1.04], [1.0, 1.1, 0.9], "within noise"),  # every pair above 1, by less than the spread
        ([0.2], [0.1], "one run"),
    ],
)
def test_paired_figures_say_within_noise_instead_of_a_verdict(dense: list, mod: list, verdict: str) -> None:
    figure = latency.paired(dense, mod)
    assert figure["verdict"] == verdict
    ratios = [d / m for d, m in zip(dense, mod, strict=True)]
    assert figure["interval"] == pytest.approx([min(ratios), max(ratios)])


def test_timing_holds_the_other_requests_off() -> None:
    """While one request is timed (exclusive) no other decodes (shared), and the timing waits for
    decodes already under way; decodes run side by side otherwise."""
    from vlmod.demo.guards import QuietTurn

    turn = QuietTurn()
    events: list[str] = []
    decoding = threading.Event()
    release = threading.Event()

    def decode(tag: str, hold: threading.Event | None = None) -> None:
        with turn.shared():
            events.append(f"{tag} in")
            decoding.set()
            if hold is not None:
                hold.wait(5)
            events.append(f"{tag} out")

    def timed() -> None:
        with turn.exclusive():
            events.append("timing in")
            time.sleep(0.2)
            events.append("timing out")

    first = threading.Thread(target=decode, args=("a", release))
    first.start()
    decoding.wait(5)
    timer = threading.Thread(target=timed)
    timer.start()
    time.sleep(0.1)
    assert "timing in" not in events  # waits for the decode under way
    late = threading.Thread(target=decode, args=("b",))
    late.start()  # arrives while the timing waits: goes after it
    time.sleep(0.1)
    release.set()
    for t in (first, timer, late):
        t.join(5)
    assert events == ["a in", "a out", "timing in", "timing out", "b in", "b out"]


def test_the_server_times_inside_its_hold_off(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    demo = next(r.endpoint.__self__ for r in client.app.routes if getattr(r, "path", "") == "/api/analyze")
    seen: list[bool] = []

    def fake(loaded, inputs, max_new_tokens, runs, predicted, hold_off):
        with hold_off():
            seen.append(demo.quiet._exclusive)
        return None

    monkeypatch.setattr(analysis, "measure_latency", fake)
    r = client.post("/api/analyze", data={"prompt": "what ?"}, files={"file": ("x.png", _png(), "image/png")})
    assert r.status_code == 200, r.text
    assert seen == [True]


def test_the_command_line_default_is_the_demo_default():
    from vlmod.cli import build_parser
    from vlmod.demo.latency import TIMING_RUNS

    assert build_parser().parse_args(["demo", "--model", "m"]).timing_runs == TIMING_RUNS


@pytest.mark.parametrize(
    ("dense", "mod", "said"),
    [
        ([0.0875, 0.0877, 0.0880], [0.100, 0.100, 0.100], "1.14x slower"),  # the 0.87-0.89x
        ([0.20, 0.21, 0.19], [0.10, 0.11, 0.09], "2.00x faster"),
        ([0.086, 0.086, 0.087], [0.085, 0.086, 0.085], "within this request's noise"),
    ],
)
def test_the_decode_sentence_follows_the_measured_ratio(dense: list, mod: list, said: str) -> None:
    """Before: the panel's sentence said decode "stays about even" whatever was measured, beside
    0.87-0.89x. Now: it ends with what this request's decode measured, a ratio below 1 as
    "1.14x slower" (never "0.88x slower"), and says which FLOPs the prefill prediction is from."""
    text = latency.purpose(latency.paired(dense, mod))
    assert said in text and "about even" not in text
    assert "0.8" not in text  # a ratio below 1 is never said as "slower"
    assert "vision tower included" in text and "falls short" in text
    assert latency.times(0.877) == "1.14x slower" and latency.times(1.14) == "1.14x faster"
    assert latency.purpose(None).endswith("so decode follows the bytes read.")
