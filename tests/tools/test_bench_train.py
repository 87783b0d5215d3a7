"""Training-step FLOPs and `bench train`: the prediction counts what autograd runs, the benchmark
steps what the finetune path trains, reports every figure, and refuses bad input in one line."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vlmod
from vlmod.bench.train import bench_train, prepare_training, synthetic_batch
from vlmod.cli import main
from vlmod.errors import InputError
from vlmod.models import tiny
from vlmod.tools.flops import DecoderDims
from vlmod.tools.training_flops import language_training_flops, training_flops
from vlmod.training.logits import answer_logits_inputs

FAST = ["--warmup", "0", "--repeats", "1", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Two rows of a synthetic image, question and answer, collated as the finetune path does."""
    _, processor = tiny.build("llava")
    return synthetic_batch(processor, 32, 2, 6, False, tmp_path_factory.mktemp("batch"))


def _model(mod: bool, trainable: str, checkpointing: bool = False):
    """A tiny eager-attention LLaVA (every attention matmul visible to the FLOP counter), prepared
    to train as `bench train` prepares it."""
    model, _ = tiny.build("llava", attn_implementation="eager")
    if mod:
        vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="every_other"), part="language")
    mode = "lora" if trainable == "projector" else trainable
    model, _, groups = prepare_training(model, mode, trainable == "lora", checkpointing, seed=0)
    return model, groups


def _counted(model, batch) -> float:
    """FLOPs per sequence torch counts in one forward and backward (2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        model(**batch, use_cache=False).loss.backward()
    return counter.get_total_flops() / batch["input_ids"].shape[0]


@pytest.mark.parametrize(
    ("mod", "trainable", "checkpointing", "answers"),
    [
        (False, "full", False, True),
        (True, "full", False, True),
        (True, "full", False, False),
        (False, "projector", False, True),
        (True, "router", False, True),
        (False, "lora", False, True),
        (True, "lora", False, True),
        (True, "full", True, True),
        (True, "router", True, True),
        (False, "projector", True, True),
    ],
)
def test_training_flops_count_what_autograd_runs(batch, mod, trainable, checkpointing, answers):
    """`answers`: the LM head on the answer positions only (what the finetune step runs), else on
    every position."""
    model, groups = _model(mod, trainable, checkpointing)
    if answers:
        batch = {**batch, **answer_logits_inputs(model, batch)}
        assert 0 < batch["logits_to_keep"].numel() < batch["input_ids"].shape[1]
    assert set(groups) == {"full": {"language", "projector"} | ({"router"} if mod else set()),
                           "projector": {"projector"}, "router": {"router"},
                           "lora": {"lora", "projector"} | ({"router"} if mod else set())}[trainable]
    trace = None
    if mod:
        with torch.no_grad(), vlmod.trace_routing(model) as trace:
            model(**batch, use_cache=False)
    predicted = training_flops(model, batch, trace, trainable, gradient_checkpointing=checkpointing)
    assert predicted["total"] == pytest.approx(_counted(model, batch), rel=1e-9)
    assert predicted["total"] == pytest.approx(predicted["vision"] + predicted["forward"] - predicted["vision"]
                                               + predicted["backward"] + predicted["recompute"])
    assert predicted["total_causal"] < predicted["total"]


def test_router_only_gradient_stops_at_the_lowest_mod_layer():
    dims = DecoderDims(dim=64, layers=4, heads=4, kv_heads=2, head_dim=16, mlp_hidden=128, vocab=100)
    low = language_training_flops(dims, 40, {2: 20, 3: 20}, "router")
    high = language_training_flops(dims, 40, {3: 20}, "router")
    # Routers at 2 and 3 send the gradient into layer 3 only; a router at 3 alone into no block.
    assert low["backward"] > high["backward"] > 0
    projector = language_training_flops(dims, 40, {2: 20, 3: 20}, "projector")
    assert projector["backward"] > low["backward"]
    full = language_training_flops(dims, 40, None, "full")
    assert full["backward"] > language_training_flops(dims, 40, None, "projector")["backward"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(trainable="language"), "trainable must be one of"),
        (dict(trainable="router"), "needs MoD layers"),
        (dict(processed_counts_per_layer={7: 3.0}), "out of range"),
        (dict(trainable="lora", lora_targets=("qkv",)), "unknown LoRA targets"),
    ],
)
def test_language_training_flops_refuse_bad_input(kwargs, message):
    dims = DecoderDims(dim=64, layers=4, heads=4, kv_heads=2, head_dim=16, mlp_hidden=128, vocab=100)
    with pytest.raises(ValueError, match=message):
        language_training_flops(dims, 10, **kwargs)


def test_mod_gradients_are_the_same_with_gradient_checkpointing(batch):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, _ = _model(True, "full", checkpointing)
        with torch.no_grad():  # trained-looking routers, so the gate is not 1 everywhere
            for name, p in model.named_parameters():
                if "mod_router" in name:
                    p.normal_(0, 0.5)
        model(**batch, use_cache=False).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("mod_router" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("trainable", "extra"),
    [("full", []), ("router", ["--gradient-checkpointing"]), ("lora", ["--mixed-precision", "bf16", "--batch-size", "2"])],
)
def test_bench_train_reports_every_figure(trainable, extra, tmp_path, capsys):
    out = tmp_path / "train.json"
    argv = ["bench", "train", "--preset", "tiny", "--trainable", trainable, "--json", str(out), *extra, *FAST]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "predicted step speedup" in printed and "peak memory of a step" in printed
    result = json.loads(out.read_text())
    for key in ("step_speedup", "predicted_step_speedup", "step_efficiency", "peak_memory_change", "skipped_token_share",
                "predicted_step_speedup_causal_attention", "contended"):
        assert key in result
    dense, mod = result["dense"], result["mod"]
    assert result["step_speedup"] == pytest.approx(dense["step_s"] / mod["step_s"])
    assert result["step_efficiency"] == pytest.approx(result["step_speedup"] / result["predicted_step_speedup"])
    assert result["predicted_step_speedup"] == pytest.approx(dense["flops"] / mod["flops"])
    assert result["predicted_step_speedup"] > 1.0
    # The AdamW update, timed apart inside each timed step, and the step without it.
    assert 0 < dense["optimizer_s"] < dense["step_s"] and 0 < mod["optimizer_s"] < mod["step_s"]
    without = (dense["step_s"] - dense["optimizer_s"]) / (mod["step_s"] - mod["optimizer_s"])
    assert result["step_speedup_without_optimizer"] == pytest.approx(without)
    assert result["step_efficiency_without_optimizer"] == pytest.approx(without / result["predicted_step_speedup"])
    assert "without the AdamW update (timed apart, not in the prediction" in printed
    assert mod["tokens_per_s"] == pytest.approx(result["batch"] * (result["media_tokens"] + result["text_tokens"]) / mod["step_s"])
    assert result["answer_tokens"] > 0 and result["mod_layers"] == {"language:1": 0.5, "language:3": 0.5}
    # Two of four layers skip half the image tokens.
    tokens = result["media_tokens"] + result["text_tokens"]
    assert result["skipped_token_share"] == pytest.approx(2 * (result["media_tokens"] // 2) / (4 * tokens))
    if trainable == "router":  # the dense reference trains its projector, the MoD model its routers only
        assert set(dense["trainable_parameters"]) == {"projector"} and set(mod["trainable_parameters"]) == {"router"}
        assert dense["flops_split"]["recompute"] > 0
    else:
        assert set(dense["trainable_parameters"]) | {"router"} == set(mod["trainable_parameters"])


def test_bench_train_video_preset_routes_video_tokens():
    result = bench_train(preset="tiny-video", trainable="full", warmup=0, repeats=1, threads=1, progress=False)
    assert result["media_tokens"] > 0 and result["predicted_step_speedup"] > 1.0
    assert result["mod_layers"] == {"language:2": 0.5}  # every layer but the first two and the last


def test_bench_train_lora_on_bfloat16_weights():
    """What a GPU run does (the 7B presets in bfloat16): the frozen weights stay bfloat16, the
    trained projector becomes a float32 master copy, and every forward (the routing trace's too)
    runs under autocast, so the two meet in one dtype."""
    result = bench_train(preset="tiny-video", trainable="lora", dtype="bfloat16", warmup=0, repeats=1, threads=1,
                         progress=False)
    assert result["dtype"] == "bfloat16" and result["predicted_step_speedup"] > 1.0
    assert result["mod"]["step_s"] > 0 and result["skipped_token_share"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainable", "language"], "invalid choice"),
        (["--mixed-precision", "fp16"], "invalid choice"),
        (["--capacity", "0"], "capacity must be in (0, 1]"),
        (["--layers", "9"], "out of range"),
    ],
)
def test_bench_train_refuses_bad_input_in_one_line(argv, message, capsys):
    code = main(["bench", "train", "--preset", "tiny", *argv, *FAST])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err


def test_bench_train_api_refuses_bad_values():
    with pytest.raises(InputError, match="trainable must be one of"):
        bench_train(preset="tiny", trainable="language")
    with pytest.raises(InputError, match="unknown preset"):
        bench_train(preset="nope")


def test_mod_gradients_do_not_depend_on_where_the_gate_logits_come_from(batch):
    """Training without the BCE aux loss computes the gate's logits on the selected tokens only;
    with it (here weighted 0, so the loss is the same) every token's logit keeps its gradient."""
    grads = []
    for aux in (None, "bce"):
        model, _ = tiny.build("llava")
        config = vlmod.MoDConfig(capacity=0.5, layers="every_other", aux_loss=aux, aux_loss_weight=0.0)
        vlmod.apply_mod(model, config, part="language")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "mod_router" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        model.train()
        model(**batch, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert any("mod_router" in n for n in grads[0]) and grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_bench_train_refuses_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    assert main(["bench", "train", "--model", str(tmp_path / "nope"), *FAST]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


def test_head_positions_follow_transformers_logits_to_keep():
    from vlmod.tools.training_flops import head_positions

    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4:] = mask[1, 1:] = True
    assert head_positions(None, 2) is None and head_positions(0, 2) is None
    assert head_positions(3, 2) == 3.0
    assert head_positions(torch.tensor([2, 5]), 2) == 2.0
    assert head_positions(torch.tensor([[1, 2, 3], [0, 4, 5]]), 2) == 3.0
    assert head_positions(mask, 2) == 3.5


def test_bench_train_runs_a_float16_checkpoint_under_bf16_and_refuses_float16_weights(tmp_path, capsys):
    """Before: a traceback, "Unexpected floating ScalarType in at::autocast::prioritize" (bfloat16
    autocast meets float16 weights). A float16 checkpoint (llava-hf's are) now loads in bfloat16, as
    `vlmod finetune` loads it; --dtype float16 with bf16 is one line, before anything loads."""
    model, processor = tiny.build("llava")
    model.to(torch.float16).save_pretrained(tmp_path / "dense16")
    processor.save_pretrained(tmp_path / "dense16")
    out = tmp_path / "train.json"
    argv = ["bench", "train", "--model", str(tmp_path / "dense16"), "--mixed-precision", "bf16", *FAST]
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["dtype"] == "bfloat16"
    capsys.readouterr()
    assert main([*argv, "--dtype", "float16"]) == 2
    assert capsys.readouterr().err == ("error: --dtype float16 with --mixed-precision bf16: bfloat16 autocast cannot run "
                                       "float16 weights; use --dtype bfloat16, auto or float32, or --mixed-precision no\n")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_lora_run_prints_no_future_warning(checkpointing: bool):
    """Before: every LoRA `bench train` (and finetune) printed transformers' "FutureWarning:
    `is_gradient_checkpointing` is deprecated", from peft reading the old alias in `get_peft_model`.
    Now that read is kept quiet at its one call; any other FutureWarning still shows."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model(True, "lora", checkpointing)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
