"""Benchmarks that cannot mislead: what they measure, how they time decode, how they judge
contention, and one error line for each bad input."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

import vlmod
from vlmod.bench import (
    Timings,
    bench_llava,
    bench_video,
    contention,
    format_generation_result,
    peak_memory_bytes,
    signed_percent,
)
from vlmod.bench.decode import decode_weight_bytes
from vlmod.bench.generation import prompt_counts
from vlmod.bench.report import FOOTNOTE
from vlmod.cli import main
from vlmod.errors import InputError
from vlmod.models import tiny

FAST = ["--warmup", "0", "--repeats", "2", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def converted_checkpoint(tmp_path_factory):
    """A tiny LLaVA saved converted at capacity 0.25 on layers 1 and 2 (not the bench defaults)."""
    model, processor = tiny.build("llava")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.25, layers=[1, 2]))
    directory = tmp_path_factory.mktemp("mod")
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def _one_error_line(capsys: pytest.CaptureFixture[str], message: str) -> None:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err


def test_bench_llava_measures_a_converted_checkpoint_as_saved(converted_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "llava", "--model", str(converted_checkpoint), "--new-tokens", "4", "--json", str(out), *FAST]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "language 1,2 at capacity 0.25 (the checkpoint's own MoD layers)" in printed
    result = json.loads(out.read_text())
    assert result["mod_layers"] == {"language:1": 0.25, "language:2": 0.25}
    assert result["mod_source"] == "the checkpoint's own MoD layers"
    # Decode comes from the per-step clock inside generate: 3 steps after the first token per call.
    for name in ("dense", "mod"):
        r = result[name]
        steps = r["decode_step_samples_s"]
        assert len(steps) == 2 and all(len(call) == 3 for call in steps)
        assert all(s > 0 for call in steps for s in call)
        used = result["timed_repeats"]["generate"]
        # The samples are stored rounded to the microsecond: the median of them is within 1 us.
        assert r["decode_step_s"] == pytest.approx(statistics.median(s for i in used for s in steps[i]), abs=1e-6)
        assert math.isfinite(r["decode_tokens_per_s"]) and r["decode_tokens_per_s"] > 0
        assert r["decode_tokens_per_s"] == pytest.approx(1 / r["decode_step_s"])
        assert r["peak_memory_bytes"] > 0
    assert math.isfinite(result["decode_speedup"]) and result["decode_speedup"] > 0
    # And in lockstep: one step of each model in turn, as many steps as generate timed.
    lockstep = result["decode_lockstep"]
    assert lockstep["steps"] == 4 * 2 and all(len(lockstep["samples_s"][n]) == 8 for n in ("dense", "mod"))
    pairs = [d / m for d, m in zip(*(lockstep["samples_s"][n] for n in ("dense", "mod")), strict=True)]
    assert lockstep["speedup"] == pytest.approx(statistics.median(pairs), rel=1e-3)
    assert math.isfinite(lockstep["speedup"]) and lockstep["speedup"] > 0
    assert "decode in lockstep (dense and MoD one step each in turn, 8 pairs)" in printed
    # Decode's prediction: the bytes a step reads, the same weights (+ the router) and a smaller cache.
    dense_read, mod_read = (result[n]["decode_read_bytes"] for n in ("dense", "mod"))
    kv_saved = result["dense"]["kv_cache_bytes"] - result["mod"]["kv_cache_bytes"]
    assert kv_saved > 0 and dense_read - mod_read == kv_saved - 4 * (1 + 64)  # tiny width 64: the router's bytes
    assert result["predicted_decode_speedup"] == pytest.approx(dense_read / mod_read)
    assert result["decode_efficiency"] == pytest.approx(lockstep["speedup"] / result["predicted_decode_speedup"])
    assert "predicted from the bytes a step reads (weights + KV cache)" in printed
    assert result["mod"]["flops"] < result["dense"]["flops"]
    assert set(result["contention"]) == {"prefill", "decode"}


def test_bench_decode_bound_adds_the_routing_bypassed_copy_to_the_lockstep(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "llava", "--preset", "tiny", "--new-tokens", "3", "--decode-bound", "--json", str(out), *FAST]
    assert main(argv) == 0
    lockstep = json.loads(out.read_text())["decode_lockstep"]
    assert set(lockstep["samples_s"]) == {"dense", "mod", "bypassed"} and len(lockstep["samples_s"]["bypassed"]) == 6
    pairs = [d / b for d, b in zip(*(lockstep["samples_s"][n] for n in ("dense", "bypassed")), strict=True)]
    assert lockstep["bypassed_speedup"] == pytest.approx(statistics.median(pairs), rel=1e-3)
    assert "with MoD's router and gate bypassed (same caches and masks)" in capsys.readouterr().out


def test_bench_control_times_a_second_dense_model_in_the_prefill(tmp_path, capsys):
    """`--control`: a second dense model over the same weights joins the prefill rotation; the
    paired ratios are medians over the repeats of each pair timed back to back."""
    out = tmp_path / "bench.json"
    argv = ["bench", "llava", "--preset", "tiny", "--new-tokens", "2", "--control", "--json", str(out), *FAST]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    dense, mod = result["dense"]["prefill_samples_s"], result["mod"]["prefill_samples_s"]
    control = result["prefill_control"]
    used = result["timed_repeats"]["prefill"]
    assert len(control["samples_s"]) == len(dense) == len(mod) == 2
    assert control["ratio"] == pytest.approx(statistics.median(dense[i] / control["samples_s"][i] for i in used))
    assert result["prefill_speedup_paired"] == pytest.approx(statistics.median(dense[i] / mod[i] for i in used))
    assert "dense / a second dense (same weights, the noise floor)" in printed
    # Without --control: the paired ratio alone, and no third model.
    assert main(["bench", "llava", "--preset", "tiny", "--new-tokens", "2", "--json", str(out), *FAST]) == 0
    result = json.loads(out.read_text())
    assert "prefill_control" not in result and result["prefill_speedup_paired"] > 0
    assert "noise floor" not in capsys.readouterr().out


def test_bench_llava_refuses_to_reconvert_a_converted_checkpoint(converted_checkpoint, capsys):
    argv = ["bench", "llava", "--model", str(converted_checkpoint), "--capacity", "0.5", *FAST]
    assert main(argv) == 2
    _one_error_line(capsys, "already converted to MoD (language: capacity 0.25, layers [1, 2])")


def test_bench_llava_one_new_token_has_no_decode_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "llava", "--preset", "tiny", "--new-tokens", "1", "--json", str(out), *FAST]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["dense"]["decode_tokens_per_s"] is None and result["decode_speedup"] is None
    assert result["decode_lockstep"] is None and "lockstep" not in printed
    assert "no decode step to time" in printed and "e+" not in printed


def test_bench_restores_the_thread_count_and_records_its_cache(tmp_path, capsys):
    """`--threads 1` holds only while the benchmark runs, also when it fails; `--cache` picks the
    KV cache both models generate with (default: preallocated)."""
    torch.set_num_threads(2)
    out = tmp_path / "bench.json"
    argv = ["bench", "llava", "--preset", "tiny", "--new-tokens", "2", "--cache", "dynamic", "--json", str(out), *FAST]
    assert main(argv) == 0
    assert torch.get_num_threads() == 2
    assert "dynamic KV cache" in capsys.readouterr().out
    assert json.loads(out.read_text())["cache"] == "dynamic"
    with pytest.raises(InputError, match="cache must be one of"):
        bench_llava(preset="tiny", cache="static", threads=1)
    with pytest.raises(InputError):  # fails after the threads were set: no checkpoint there
        bench_llava(model=str(tmp_path / "missing"), threads=1)
    assert torch.get_num_threads() == 2
    with pytest.raises(InputError):
        bench_video(model=str(tmp_path / "missing"), threads=1)
    assert torch.get_num_threads() == 2


def test_bench_vit_image_smaller_than_a_patch_is_one_error_line(capsys):
    argv = ["bench", "vit", "--model", "vit_tiny_patch16_224", "--image-size", "7", "--no-progress"]
    assert main(argv) == 2
    _one_error_line(capsys, "smaller than one 16x16 patch")


def test_kv_cache_change_is_signed_and_prompt_counts_are_never_negative():
    assert signed_percent(-0.225) == "-22.5%" and signed_percent(0.048) == "+4.8%" and signed_percent(0.0) == "0.0%"
    # Row 0 left-padded: padding is neither media nor text.
    inputs = {
        "input_ids": torch.tensor([[0, 0, 5, 9, 9, 7], [3, 4, 5, 9, 9, 7]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
    }
    assert prompt_counts(inputs, media_token_id=9) == (2, 2)


def _fake_generation_result(kv_dense: int, kv_mod: int) -> dict:
    side = dict(prefill_s=0.1, decode_step_s=0.01, decode_tokens_per_s=100.0, kv_cache_bytes=0,
                peak_memory_bytes=None, flops=1e9)
    return {
        "model": "m", "batch": 1, "image_tokens": 4, "prompt_tokens": 3, "mod_layers": {"language:1": 1.0},
        "mod_source": "converted here", "new_tokens": 2, "torch": "x", "threads": 1,
        "dense": {**side, "kv_cache_bytes": kv_dense}, "mod": {**side, "kv_cache_bytes": kv_mod},
        "predicted_speedup": 1.0, "prefill_speedup": 1.0, "prefill_efficiency": 1.0,
        "predicted_speedup_causal_attention": 1.0, "prefill_efficiency_causal_attention": 1.0,
        "decode_speedup": 1.0, "kv_cache_reduction": 1 - kv_mod / kv_dense, "peak_memory_change": None,
        "contention": {},
    }


@pytest.mark.parametrize("tied", [False, True])
def test_decode_reads_the_language_weights_once_and_not_the_vision_side(tied: bool):
    model, _ = tiny.build("llava")
    if tied:
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = sum(
        p.numel() * p.element_size() for n, p in params.items()
        if n.startswith("model.language_model.") and "embed_tokens" not in n
    ) + model.lm_head.weight.numel() * 4
    assert decode_weight_bytes(model) == expected
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5))
    assert decode_weight_bytes(model) == expected + 4 * (model.config.text_config.hidden_size + 1)


def test_report_of_a_larger_mod_cache_says_plus():
    text = format_generation_result(_fake_generation_result(1000, 1048))
    assert "KV cache +4.8%" in text and "--4" not in text


def test_a_contended_report_says_so_first_and_flags_its_figures():
    """Before: on a contended machine `bench llava` printed the contention warning last, a decode
    row of 0.178x in the table and summary like any result, and "measured 1.079x" beside "median of
    the per-repeat ratios 2.014x" with nothing saying which to read. Now: the warning comes first,
    every contended figure carries " *" with a footnote, and one line under the table names the
    headline and why the other figures differ."""
    result = _fake_generation_result(1000, 800)
    result.update(
        prefill_speedup=1.079, prefill_speedup_paired=2.014, decode_speedup=0.178,
        decode_lockstep={"speedup": 0.963, "steps": 8, "dense_step_s": 0.01, "mod_step_s": 0.0104, "spread": 0.02},
        contention={"prefill": {"contended": False}, "decode": {"contended": True, "reason": "other processes held 1.5 cores"}},
    )
    lines = format_generation_result(result).splitlines()
    assert lines[0].startswith("warning: decode figures are unreliable: other processes held 1.5 cores")
    dense_row = next(line for line in lines if line.startswith("dense "))
    assert "100.0 *" in dense_row and "10.00 *" in dense_row and "100.0 " in dense_row.split("*")[0]
    assert "decode (per step, inside generate): 0.178x *" in "\n".join(lines)
    assert "measured 1.079x  " in "\n".join(lines)  # the prefill was clean: no mark
    assert lines[lines.index(next(line for line in lines if line.startswith("dense "))) + 2] == FOOTNOTE
    headline = next(line for line in lines if line.startswith("headline: "))
    assert "prefill 1.079x" in headline and "per-repeat ratios" in headline and "decode 0.963x in lockstep" in headline
    clean = format_generation_result(_fake_generation_result(1000, 800))
    assert " *" not in clean and FOOTNOTE not in clean and not clean.startswith("warning")


def _timings(wall: list[float], cpu: list[float], others: list[float | None], threads: int = 2) -> Timings:
    return Timings(wall_s=wall, cpu_s=cpu, others_cpu_s=others, threads=threads)


def test_contention_is_not_flagged_for_small_idle_calls(monkeypatch):
    """A small model's calls use one of two threads (utilization 0.5) on an idle machine: clean."""
    monkeypatch.setattr("vlmod.bench.timing.available_cores", lambda: 2)
    fast = [0.002, 0.0021, 0.002, 0.002]
    t = {"dense": _timings(fast, [w * 1.0 for w in fast], [0.0] * 4), "mod": _timings(fast, fast, [0.0] * 4)}
    judged = contention(t)
    assert not judged.contended and judged.clean_repeats == [0, 1, 2, 3]


def test_contention_from_other_processes_and_from_spread(monkeypatch):
    monkeypatch.setattr("vlmod.bench.timing.available_cores", lambda: 2)
    wall = [1.0, 1.0, 1.0, 1.0]
    # Other processes held 1.5 cores in every repeat: nothing clean, flagged, medians over all.
    busy = {"a": _timings(wall, wall, [1.5] * 4), "b": _timings(wall, wall, [1.5] * 4)}
    judged = contention(busy)
    assert judged.contended and "other processes held 1.50 cores" in judged.reason
    assert judged.clean_repeats == [0, 1, 2, 3]
    # One busy repeat of four is left out of the medians, and the rest is trusted.
    one = {"a": _timings(wall, wall, [0.0, 0.9, 0.0, 0.0]), "b": _timings(wall, wall, [0.0, 0.9, 0.0, 0.0])}
    judged = contention(one)
    assert not judged.contended and judged.clean_repeats == [0, 2, 3]
    # An idle machine but decode steps all over the place: flagged on decode.
    idle = {"a": _timings(wall, wall, [0.0] * 4), "b": _timings(wall, wall, [0.0] * 4)}
    judged = contention(idle, extra_samples={"mod decode steps": [0.01, 0.02, 0.01, 0.03, 0.01, 0.025]})
    assert judged.contended and "mod decode steps" in judged.reason
    # Without /proc/stat figures the CPU-time utilization decides.
    blind = {"a": _timings(wall, [2.0, 0.6, 2.0, 2.0], [None] * 4), "b": _timings(wall, [2.0] * 4, [None] * 4)}
    judged = contention(blind)
    assert judged.others_cores is None and judged.clean_repeats == [0, 2, 3]


def test_peak_memory_sees_a_transient_allocation():
    def work() -> torch.Tensor:
        a = torch.ones(1024, 1024)  # 4 MiB, freed before the end
        return (a * 2).sum()

    assert peak_memory_bytes(work) >= 8 * 2**20


def test_bench_runs_in_the_dtype_asked_and_says_where(tmp_path, capsys):
    """`--dtype bfloat16` builds the preset in bfloat16 (the inputs follow it), and the result says
    which device and dtype its figures come from."""
    out = tmp_path / "bench.json"
    argv = ["bench", "llava", "--preset", "tiny", "--dtype", "bfloat16", "--new-tokens", "2", "--json", str(out), *FAST]
    assert main(argv) == 0
    assert "cpu bfloat16, torch" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["device"], result["dtype"]) == ("cpu", "bfloat16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_device_cuda_without_a_gpu_is_one_error_line(capsys):
    assert main(["bench", "llava", "--preset", "tiny", "--device", "cuda"]) == 2
    _one_error_line(capsys, "--device cuda: this machine has no CUDA GPU torch can use; use cpu")


def test_full_presets_are_the_real_7b_shapes_in_bfloat16():
    """The -full presets build the real models straight on the device in bfloat16 (here the meta
    device: shapes only, no memory)."""
    from vlmod.bench.generation import LLAVA_PRESETS, build_preset
    from vlmod.bench.video import VIDEO_PRESETS

    for preset, presets in (("llava-1.5-7b-full", LLAVA_PRESETS), ("llava-next-video-7b-full", VIDEO_PRESETS)):
        model, processor, _ = build_preset(preset, presets, device="meta")
        text = model.config.text_config
        assert (text.hidden_size, text.num_hidden_layers, model.config.vision_config.image_size) == (4096, 32, 336)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert {p.device.type for p in model.parameters()} == {"meta"}


def test_gpu_timings_are_judged_by_spread_alone(monkeypatch):
    """On a GPU the host's CPU accounting says nothing of the kernels' time: every repeat counts,
    and only the spread can flag the figures."""
    monkeypatch.setattr("vlmod.bench.timing.available_cores", lambda: 2)
    wall = [1.0, 1.0, 1.0, 1.0]
    busy = {n: _timings(wall, wall, [1.5] * 4) for n in ("a", "b")}
    for t in busy.values():
        t.gpu = True
    judged = contention(busy)
    assert not judged.contended and judged.others_cores is None and judged.clean_repeats == [0, 1, 2, 3]


@pytest.mark.slow
def test_bench_llava_compile_decodes_compiled_and_reports_what_compiling_cost(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "llava", "--preset", "tiny", "--new-tokens", "3", "--compile", "--json", str(out), *FAST]) == 0
    printed = capsys.readouterr().out
    assert "decode compiled (vlmod.compile" in printed
    result = json.loads(out.read_text())
    first = result["compile"]["first_call_s"]
    assert first["dense"] > 0 and first["mod"] > 0
    assert result["decode_lockstep"] is None  # compiled steps are timed inside generate only
    assert result["mod"]["decode_step_s"] > 0


def test_bench_compile_refuses_transformers_dynamic_cache(capsys):
    assert main(["bench", "llava", "--preset", "tiny", "--compile", "--cache", "dynamic", *FAST]) == 2
    _one_error_line(capsys, "--compile decodes on vlmod's own cache")


def test_bench_sdpa_priority_names_are_checked(capsys):
    assert main(["bench", "llava", "--preset", "tiny", "--sdpa-priority", "flash,fast"]) == 2
    _one_error_line(capsys, "unknown SDPA backend fast")


def test_bench_ops_prints_the_host_cost_table(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["bench", "ops", "--families", "llava", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| llava | 2 |" in printed
    row = json.loads(out.read_text())["families"][0]
    assert row["prefill_per_layer"] <= 15 and row["decode_per_layer"] <= 4
    assert main(["bench", "ops", "--families", "llava,nope"]) == 2
    _one_error_line(capsys, "unknown nope")


def test_the_op_counter_sees_copies_that_may_alias_ops_make_under_inference_mode():
    """Under inference mode `reshape` and `contiguous` reach the counter whole, marked as views,
    and `type_as` whole: a call that returned new memory launched a copy and counts; one that
    returned its input (or a view of it) does not."""
    from vlmod.bench.ops import OpCounter

    x = torch.randn(2, 3, 8, 4)
    wide = x.double()
    with torch.inference_mode(), OpCounter() as counter:
        x.reshape(6, 8, 4)  # a view
        x.contiguous()  # already contiguous: itself
        x[:, :, :4].reshape(2, 12, 4)  # a copy
        x.transpose(1, 2).contiguous()  # a copy
        x.type_as(x)  # itself
        x.type_as(wide)  # a copy
    assert dict(counter.ops) == {"reshape": 1, "contiguous": 1, "type_as": 1}
