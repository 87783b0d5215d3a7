"""Plain-text reports of the benchmarks: one table per result, the speedups against their FLOPs
predictions, and a warning wherever the machine was contended."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlmod.io.tables import format_table


def signed_percent(change: float) -> str:
    """A relative change as "-22.5%" / "+4.8%" / "0.0%" (never "--4.8%")."""
    return f"{100 * change:+.1f}%" if round(100 * change, 1) else "0.0%"


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def _machine(result: Mapping[str, Any]) -> str:
    """Where the figures come from: "cpu float32, torch 2.14.1, 2 threads" or "cuda:0 (NVIDIA H100
    80GB HBM3) bfloat16, torch 2.11.0" (a GPU's host threads do not matter)."""
    device = result.get("device", "cpu")
    where = " ".join(x for x in (device, result.get("dtype")) if x)
    threads = "" if not device.startswith("cpu") else f", {_threads(result['threads'])}"
    return f"{where}, torch {result['torch']}{threads}"


def describe_layers(mod_layers: Mapping[str, float]) -> str:
    """{"language:3": 0.5, ...} -> "language 2-30 at capacity 0.5" (per part, runs of indices
    collapsed, several capacities listed as a range)."""
    parts: dict[str, list[tuple[int, float]]] = {}
    for key, capacity in mod_layers.items():
        part, index = key.rsplit(":", 1)
        parts.setdefault(part, []).append((int(index), float(capacity)))
    out = []
    for part, entries in parts.items():
        entries.sort()
        indices = [i for i, _ in entries]
        caps = sorted({c for _, c in entries})
        contiguous = len(indices) > 2 and indices == list(range(indices[0], indices[-1] + 1))
        span = f"{indices[0]}-{indices[-1]}" if contiguous else ",".join(map(str, indices))
        cap = f"{caps[0]:g}" if len(caps) == 1 else f"{caps[-1]:g}..{caps[0]:g}"
        out.append(f"{part} {span} at capacity {cap}")
    return "; ".join(out) or "none"


def _contention_lines(result: Mapping[str, Any]) -> list[str]:
    lines = []
    hint = "on an idle machine" + (" or with --threads 1" if result.get("threads", 1) > 1 else "")
    for stage, c in (result.get("contention") or {}).items():
        if c["contended"]:
            lines.append(
                f"warning: {stage} figures are unreliable: {c['reason']}. Other jobs distort a comparison "
                f"(against the model with more, smaller ops); rerun {hint}."
            )
    return lines


# A figure timed while other jobs held the CPU is marked in the table and the summary, so a
# contended number never reads as a result (the warning that says why comes first).
FLAG = " *"
FOOTNOTE = "* contended: timed while other jobs held the CPU (the warning above); not a result"


def _contended(result: Mapping[str, Any], stage: str) -> bool:
    return bool(((result.get("contention") or {}).get(stage) or {}).get("contended"))


def _flag(text: str, contended: bool) -> str:
    return text + FLAG if contended and text != "-" else text


def _footnote(result: Mapping[str, Any]) -> list[str]:
    return [FOOTNOTE] if any(c.get("contended") for c in (result.get("contention") or {}).values()) else []


def _headline(result: Mapping[str, Any], prefill: str = "prefill") -> str:
    """The one line under a generation table: which figures are the headline and why the others differ."""
    line = (
        f"headline: {prefill} {_flag(_speedup(result['prefill_speedup']), _contended(result, 'prefill'))} "
        "(dense / MoD of the median prefill times over "
        "the interleaved repeats); the median of the per-repeat ratios pairs each repeat with itself, so it "
        "differs when the machine's speed drifts between repeats"
    )
    lockstep = (result.get("decode_lockstep") or {}).get("speedup")
    if lockstep is not None:
        line += (
            f"; decode {_speedup(lockstep)} in lockstep (one step of each model in turn, so load hits both alike); "
            "decode inside generate times each model's whole generate apart and swings with load"
        )
    return line


def format_vit_result(result: Mapping[str, Any]) -> str:
    """The plain-text report of `bench_vit`."""
    rows = []
    busy = _contended(result, "timing")
    for name, label in (("dense", "dense"), ("mod", "MoD")):
        r = result[name]
        rows.append(
            [
                label,
                _flag(f"{r['images_per_s']:.2f}", busy),
                _flag(f"{r['latency_s'] * 1e3:.1f}", busy),
                f"{r['flops_per_image'] / 1e9:.2f}",
            ]
        )
    layers = ",".join(map(str, result["mod_layers"]))
    counts = sorted(set(round(c, 2) for c in result["processed_tokens"].values()))
    header = (
        f"{result['model']} ({result['source']}), batch {result['batch']}, "
        f"{result['image_size'][0]}x{result['image_size'][1]}, capacity {result['capacity']:g} on "
        f"{len(result['mod_layers'])} MoD layers ({layers}: "
        f"{'/'.join(f'{c:g}' for c in counts)} of {result['tokens']} tokens), "
        f"{_machine(result)}, "
        f"median of {len(result['timed_repeats'])}/{result['repeats']} repeats"
    )
    table = format_table(["model", "images/s", "latency ms", "GFLOPs/image"], rows)
    summary = (
        f"predicted speedup {result['predicted_speedup']:.3f}x  "
        f"measured {_flag(_speedup(result['speedup']), busy)}  "
        f"efficiency {result['efficiency']:.3f}  "
        f"(paired-repeat speedup {result['speedup_paired']:.3f}x)"
    )
    headline = (
        f"headline: measured {result['speedup']:.3f}x (dense / MoD of the median latencies); the paired-repeat "
        "speedup is the median of each repeat's own ratio, so it differs when the machine's speed drifts"
    )
    lines = [*_contention_lines(result), header, table, *_footnote(result), headline, summary]
    left_out = result["repeats"] - len(result["timed_repeats"])
    if left_out and not result["contended"]:
        lines.append(f"note: {left_out} repeats ran while other jobs held the CPU and were left out of the medians")
    return "\n".join(lines)


def _decode(r: Mapping[str, Any]) -> str:
    return "-" if r.get("decode_tokens_per_s") is None else f"{r['decode_tokens_per_s']:.1f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _speedup(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def generation_summary(result: Mapping[str, Any], label: str = "predicted prefill speedup") -> str:
    """Prefill against both FLOPs predictions, decode, KV cache and peak memory."""
    peak = result.get("peak_memory_change")
    decode_stage = "decode" if "decode" in (result.get("contention") or {}) else "end to end and decode"
    prefill = _flag(f"{result['prefill_speedup']:.3f}x", _contended(result, "prefill"))
    return (
        f"{label} {result['predicted_speedup']:.3f}x  measured {prefill}  "
        f"efficiency {result['prefill_efficiency']:.3f}\n"
        + _prefill_pairs(result)
        + f"  attention counted as a causal kernel computes it: predicted "
        f"{result['predicted_speedup_causal_attention']:.3f}x  efficiency "
        f"{result['prefill_efficiency_causal_attention']:.3f}\n"
        f"decode (per step, inside generate): {_flag(_speedup(result['decode_speedup']), _contended(result, decode_stage))}  "
        f"KV cache {signed_percent(-result['kv_cache_reduction'])}  "
        f"peak memory of generate {'-' if peak is None else signed_percent(peak)}"
        + _lockstep(result)
        + _compiled(result)
    )


def _compiled(result: Mapping[str, Any]) -> str:
    compiled = result.get("compile")
    if not compiled:
        return ""
    first = compiled["first_call_s"]
    return (
        "\ndecode compiled (vlmod.compile: one graph a step, the prefill eager); what compiling cost, the first "
        f"generate call of each: dense {first['dense']:.1f} s, MoD {first['mod']:.1f} s"
    )


def _prefill_pairs(result: Mapping[str, Any]) -> str:
    """The paired prefill ratio, and the dense / dense control's when `--control` ran one."""
    paired = result.get("prefill_speedup_paired")
    if paired is None:
        return ""
    line = f"  median of the per-repeat dense / MoD ratios {paired:.3f}x"
    control = result.get("prefill_control")
    if control:
        line += (
            f"; dense / a second dense (same weights, the noise floor) {control['ratio']:.3f}x "
            f"({control['control_s'] * 1e3:.1f} ms)"
        )
    return line + "\n"


def _lockstep(result: Mapping[str, Any]) -> str:
    lockstep = result.get("decode_lockstep")
    if not lockstep or "speedup" not in lockstep:
        return ""
    predicted = result.get("predicted_decode_speedup")
    against = "" if predicted is None else (
        f"\n  predicted from the bytes a step reads (weights + KV cache) {predicted:.3f}x  "
        f"efficiency {result['decode_efficiency']:.3f}"
    )
    if "bypassed_speedup" in lockstep:
        against += (
            f"\n  with MoD's router and gate bypassed (same caches and masks) "
            f"{_speedup(lockstep['bypassed_speedup'])} ({lockstep['bypassed_step_s'] * 1e3:.2f} ms a step): "
            "what routing-free MoD would decode at"
        )
    return (
        f"\ndecode in lockstep (dense and MoD one step each in turn, {lockstep['steps']} pairs): "
        f"{_speedup(lockstep['speedup'])} (dense {lockstep['dense_step_s'] * 1e3:.2f} ms, "
        f"MoD {lockstep['mod_step_s'] * 1e3:.2f} ms a step; pair ratios spread {100 * lockstep['spread']:.1f}%)"
        + against
    )


def format_generation_result(result: Mapping[str, Any]) -> str:
    """The plain-text report of `bench_llava`."""
    rows = []
    busy_prefill, busy_decode = _contended(result, "prefill"), _contended(result, "decode")
    for name, label in (("dense", "dense"), ("mod", "MoD")):
        r = result[name]
        rows.append(
            [
                label,
                _flag(f"{r['prefill_s'] * 1e3:.1f}", busy_prefill),
                _flag("-" if r["decode_step_s"] is None else f"{r['decode_step_s'] * 1e3:.2f}", busy_decode),
                _flag(_decode(r), busy_decode),
                _mib(r["kv_cache_bytes"]),
                _mib(r["peak_memory_bytes"]),
                f"{r['flops'] / 1e9:.2f}",
            ]
        )
    header = (
        f"{result['model']}: batch {result['batch']}, {result['image_tokens']} vision + "
        f"{result['prompt_tokens']} text tokens, MoD: {describe_layers(result['mod_layers'])} "
        f"({result['mod_source']}), {result['new_tokens']} new tokens, {result.get('cache', 'dynamic')} KV cache, "
        f"{_machine(result)}"
    )
    table = format_table(
        ["model", "prefill ms", "decode ms/step", "decode tok/s", "KV cache MiB", "peak MiB", "GFLOPs/seq"], rows
    )
    lines = [*_contention_lines(result), header, table, *_footnote(result), _headline(result), generation_summary(result)]
    if result["decode_speedup"] is None:
        lines.append("note: with --new-tokens 1 there is no decode step to time (the first token ends the prefill)")
    return "\n".join(lines)


def format_video_result(result: Mapping[str, Any]) -> str:
    """The plain-text report of `bench_video`: throughput, where the time goes, and the prefill
    speedup against its FLOPs predictions."""
    rows = []
    busy_prefill, busy_e2e = _contended(result, "prefill"), _contended(result, "end to end and decode")
    for name, label in (("dense", "dense"), ("mod", "MoD")):
        r = result[name]
        split = r["time_split"]
        rows.append(
            [
                label,
                _flag(f"{r['frames_per_s']:.2f}", busy_e2e),
                _flag(f"{r['end_to_end_s'] * 1e3:.0f}", busy_e2e),
                _flag(f"{split['decode_video_s'] * 1e3:.1f}", busy_e2e),
                _flag(f"{split['preprocess_s'] * 1e3:.1f}", busy_e2e),
                _flag(f"{split['first_token_s'] * 1e3:.0f}", busy_e2e),
                _flag(f"{r['prefill_s'] * 1e3:.0f}", busy_prefill),
                _flag("-" if r["decode_step_s"] is None else f"{r['decode_step_s'] * 1e3:.2f}", busy_e2e),
                _flag(_decode(r), busy_e2e),
                _mib(r["kv_cache_bytes"]),
                _mib(r["peak_memory_bytes"]),
                f"{r['flops'] / 1e9:.4g}",
            ]
        )
    header = (
        f"{result['model']}: {result['video']}; batch {result['batch']} x {result['frames']} frames, "
        f"{result['video_tokens']} video + {result['prompt_tokens']} text tokens per sequence, "
        f"MoD: {describe_layers(result['mod_layers'])} of {result['language_layers']} language layers "
        f"({result['mod_source']}), {result['new_tokens']} new tokens, {result.get('cache', 'dynamic')} KV cache, "
        f"{_machine(result)}, median of {len(result['timed_repeats']['end_to_end'])}/"
        f"{result['repeats']} repeats"
    )
    table = format_table(
        [
            "model", "frames/s", "end-to-end ms", "decode video ms", "preprocess ms", "first token ms",
            "prefill ms", "decode ms/step", "decode tok/s", "KV cache MiB", "peak MiB", "GFLOPs/seq",
        ],
        rows,
    )
    summary = (
        f"{generation_summary(result, 'prefill (vision + language): predicted speedup')}\n"
        f"end to end: {_flag(_speedup(result['speedup']), busy_e2e)} frames/s  video decoding alone: "
        f"{result['decode_only_frames_per_s']:.1f} frames/s"
    )
    headline = (_headline(result, "prefill (vision + language)") + "; end to end differs from the prefill's "
                "ratio: video decoding, preprocessing and the decode steps are in it, and MoD does not cut them")
    lines = [*_contention_lines(result), header, table, *_footnote(result), headline, summary]
    if result["decode_speedup"] is None:
        lines.append("note: with --new-tokens 1 there is no decode step to time (the first token ends the prefill)")
    return "\n".join(lines)
