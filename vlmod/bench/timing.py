"""Timing that survives a shared machine: interleaved runs, medians, and contention detected from
what was measured.

Two signals say whether a benchmark had the CPU it asked for:

- **Other processes' CPU time** during each timed call: the machine's busy time (`/proc/stat`,
  all cores) minus this process's own CPU time, per second of wall time, i.e. how many cores
  other jobs held. A call is contended when fewer cores than this process's threads were left
  free. This is what the previous rule (own CPU time / wall time) tried to see, but that rule
  misfires on small models, whose small ops run on one thread however many are allowed.
- **Spread** of the samples of one function (repeats, or decode steps): a median absolute
  deviation above `MAX_SPREAD` of the median says the timings are noisy whatever the cause.

`/proc/stat` counts in clock ticks (10 ms), too coarse for one millisecond call, so repeats are
judged one by one only when they are long enough (`MIN_JUDGED_S`); shorter ones are judged
together. Where there is no `/proc/stat`, CPU time / wall time is the fallback.

On a GPU each timed call ends with a device synchronize (the kernels it queued are part of its
time), and only the spread judges the samples: the host's CPU accounting says nothing of the
GPU's, and a process waiting on its kernels looks idle to it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Other jobs may hold this many cores beyond the ones left for our threads before a repeat counts
# as contended (background daemons, the progress bar).
SLACK_CORES = 0.25
# A repeat is judged on its own when it ran at least this long (25 clock ticks of /proc/stat).
MIN_JUDGED_S = 0.25
# Median absolute deviation / median above this: the samples are too noisy to compare.
MAX_SPREAD = 0.1
# Fallback without /proc/stat: own CPU time / (wall time * threads) below this is contended.
MIN_UTILIZATION = 0.8


def _busy_seconds() -> float | None:
    """CPU seconds all cores of the machine spent busy since boot, or None without /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    ticks = [int(v) for v in fields[1:9]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    return busy / os.sysconf("SC_CLK_TCK")


def available_cores() -> int:
    """The CPUs this process may run on (its affinity, which a container or `taskset` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows: no affinity call
        return os.cpu_count() or 1


@dataclass
class Timings:
    """Wall-clock and CPU seconds of each timed call of one function, and the CPU seconds other
    processes used meanwhile (None where the OS does not tell)."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    others_cpu_s: list[float | None] = field(default_factory=list)
    threads: int = 1
    gpu: bool = False  # timed on a GPU: judged by spread alone

    @property
    def utilization(self) -> list[float]:
        """Own CPU seconds / (wall seconds * threads) per call."""
        return [
            c / (w * self.threads) if w > 0 else 0.0 for w, c in zip(self.wall_s, self.cpu_s, strict=True)
        ]

    def median(self, repeats: Sequence[int] | None = None) -> float:
        """Median wall seconds over all calls, or over the calls numbered in `repeats`."""
        picked = self.wall_s if repeats is None else [self.wall_s[i] for i in repeats]
        return statistics.median(picked)


def spread(samples: Sequence[float]) -> float:
    """Median absolute deviation / median: 0 for identical samples; robust to a few outliers."""
    if len(samples) < 2:
        return 0.0
    mid = statistics.median(samples)
    if mid <= 0:
        return 0.0
    return statistics.median(abs(s - mid) for s in samples) / mid


def paired_ratio(base: Timings, other: Timings, repeats: Sequence[int] | None = None) -> float:
    """Median over repeats of base / other, each pair timed back to back: a drift of the machine
    that lasts longer than one repeat cancels within each pair, where a ratio of medians keeps it."""
    picked = range(min(len(base.wall_s), len(other.wall_s))) if repeats is None else repeats
    return statistics.median(base.wall_s[r] / other.wall_s[r] for r in picked)


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the kernels queued on `device` (a no-op on the CPU, whose ops finish in the call)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: torch.device) -> str:
    """"cpu", or the GPU's name ("cuda:0 (NVIDIA H100 80GB HBM3)"): which machine a figure is from."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    warmup: int = 3,
    repeats: int = 10,
    progress: str | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Timings]:
    """Time each function in `fns` `repeats` times, under `torch.inference_mode`.

    The functions take turns within each repeat, and the order is reversed on every other repeat
    (A B, B A, A B, ...): slow drifts of a shared machine (load, thermal state, caches) hit all of
    them alike, and neither gains from running first. Take medians: they ignore the occasional
    call hit by an outside burst. Sustained contention is not fair even so (a model of many small
    ops loses more than one of few large ones), hence the CPU accounting (`contention`).

    warmup: untimed calls of each function first (allocator, oneDNN kernel selection, caches).
    progress: a tqdm description, or None for no progress bar.
    device: where the functions run; a CUDA device is synchronized before and after each timed call.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    names = list(fns)
    threads = torch.get_num_threads()
    gpu = device is not None and torch.device(device).type == "cuda"
    timings = {name: Timings(threads=threads, gpu=gpu) for name in names}
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                fns[name]()
        synchronize(device)
        steps: Any = range(repeats)
        if progress is not None:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc=progress, unit="rep", leave=False)
        for rep in steps:
            for name in names if rep % 2 == 0 else names[::-1]:
                busy = _busy_seconds()
                cpu = time.process_time()
                wall = time.perf_counter()
                fns[name]()
                synchronize(device)
                wall = time.perf_counter() - wall
                cpu = time.process_time() - cpu
                busy_after = _busy_seconds()
                t = timings[name]
                t.wall_s.append(wall)
                t.cpu_s.append(cpu)
                t.others_cpu_s.append(None if busy is None or busy_after is None else busy_after - busy - cpu)
    return timings


@dataclass
class Contention:
    """Whether other jobs held the CPU while a benchmark ran, and the evidence."""

    clean_repeats: list[int]  # the repeats medians are taken over
    contended: bool  # too few clean repeats, or too noisy: the figures are unreliable
    others_cores: float | None  # mean cores other processes held during the timed calls
    spread: dict[str, float]  # per function: MAD / median of its samples over clean_repeats
    reason: str = ""  # why `contended`, in words

    def as_dict(self) -> dict[str, Any]:
        return {
            "contended": self.contended,
            "reason": self.reason,
            "others_cores": None if self.others_cores is None else round(self.others_cores, 3),
            "spread": {k: round(v, 4) for k, v in self.spread.items()},
            "clean_repeats": self.clean_repeats,
        }


def _repeat_others(timings: Mapping[str, Timings], rep: int) -> tuple[float | None, float]:
    """(cores other processes held, wall seconds) over the calls of repeat `rep`."""
    wall = sum(t.wall_s[rep] for t in timings.values())
    others = [t.others_cpu_s[rep] for t in timings.values()]
    if any(o is None for o in others) or wall <= 0:
        return None, wall
    return sum(others) / wall, wall  # type: ignore[arg-type]


def contention(
    timings: Mapping[str, Timings],
    extra_samples: Mapping[str, Sequence[float]] | None = None,
    max_spread: float = MAX_SPREAD,
) -> Contention:
    """Judge the repeats of `time_interleaved`: which ran with the CPU they asked for, and whether
    the result as a whole can be trusted.

    extra_samples: other samples whose spread also counts (per-step decode times), by name.
    """
    repeats = min(len(t.wall_s) for t in timings.values())
    threads = next(iter(timings.values())).threads
    budget = max(available_cores() - threads, 0) + SLACK_CORES
    per_rep = [_repeat_others(timings, r) for r in range(repeats)]
    total_wall = sum(w for _, w in per_rep)
    if any(t.gpu for t in timings.values()):
        clean = list(range(repeats))
        others_cores = None
    elif all(o is not None for o, _ in per_rep) and total_wall > 0:
        mean_others = sum(o * w for o, w in per_rep) / total_wall  # type: ignore[operator]
        if total_wall / max(repeats, 1) >= MIN_JUDGED_S:
            clean = [r for r, (o, _) in enumerate(per_rep) if o <= budget]  # type: ignore[operator]
        else:  # repeats too short for clock ticks: judge them together
            clean = list(range(repeats)) if mean_others <= budget else []
        others_cores: float | None = mean_others
    else:
        utils = [t.utilization for t in timings.values()]
        clean = [r for r in range(repeats) if all(u[r] >= MIN_UTILIZATION for u in utils)]
        others_cores = None
    reason = ""
    if not (len(clean) == repeats or len(clean) >= max(3, repeats / 4)):
        what = f"{others_cores:.2f} cores on average" if others_cores is not None else "the CPU"
        reason = f"other processes held {what} in {repeats - len(clean)} of {repeats} repeats"
        clean = list(range(repeats))
    spreads = {name: spread([t.wall_s[r] for r in clean]) for name, t in timings.items()}
    for name, samples in (extra_samples or {}).items():
        spreads[name] = spread(samples)
    noisy = sorted(n for n, s in spreads.items() if s > max_spread)
    if noisy and not reason:
        reason = f"timings of {', '.join(noisy)} vary by more than {100 * max_spread:.0f}% (MAD/median)"
    return Contention(clean, bool(reason), others_cores, spreads, reason)


def robust_repeats(timings: Mapping[str, Timings]) -> tuple[list[int], bool]:
    """The repeats to take medians over, and whether the result is unreliable (`contention`)."""
    c = contention(timings)
    return c.clean_repeats, c.contended


def time_fn(fn: Callable[[], Any], warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds per call of one function (see `time_interleaved`)."""
    return time_interleaved({"fn": fn}, warmup, repeats)["fn"].median()


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages, or None where the OS has none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None: leave them) and return the count in use. Only inside a
    function wrapped by `keeps_threads`, which gives the caller its own count back."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def keeps_threads(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A benchmark entry point that may change torch's thread count (`set_threads`): the caller's
    count is restored when it returns or raises, so the kernels (and last bits) of whatever runs
    next in the process do not depend on a benchmark having run."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    return wrapper


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ log lines (kineto prints start/stop notes and a GPU probe error on
    a CPU-only machine straight to file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int | None:
    """Peak bytes allocated by torch while `fn` runs, above what was allocated before it; None
    where it cannot be measured.

    CUDA: the allocator's peak counter. CPU: the profiler's memory events, summed in time order
    (the CPU allocator keeps no peak counter, and the process's resident size does not shrink when
    torch frees, so it cannot tell two models apart in one process).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    events = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            events.append((e.start_ns(), e.nbytes()))
    if not events:
        return None
    events.sort()
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return int(peak)


def peak_memory_change(dense: Mapping[str, Any], mod: Mapping[str, Any]) -> float | None:
    """MoD's peak memory over dense's, minus 1 (None where either was not measured)."""
    if dense.get("peak_memory_bytes") and mod.get("peak_memory_bytes") is not None:
        return mod["peak_memory_bytes"] / dense["peak_memory_bytes"] - 1.0
    return None


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def sdpa_priority(order: str | None) -> contextlib.AbstractContextManager:
    """While the block runs, torch's scaled_dot_product_attention tries its backends in `order` (a
    comma list of `SDPA_BACKENDS`, e.g. "flash,efficient,cudnn,math": flash before cuDNN, whose
    kernel costs about 1.2 ms of host time a call on an H200, docs/gpu.md); None: torch's own."""
    if not order:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = [n.strip() for n in order.split(",") if n.strip()]
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if unknown or not names:
        raise ValueError(f"unknown SDPA backend {', '.join(unknown) or '(none)'}; use a comma list of {', '.join(SDPA_BACKENDS)}")
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names], set_priority=True)
