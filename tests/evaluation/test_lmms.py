"""The lmms-eval model `vlmod` (vlmod/evaluation/lmms.py): lmms-eval's own command line on a tiny converted
checkpoint and a local task, and the model class on a dense checkpoint, batches and video.

lmms-eval is the `lmms` extra, which the README's set-up line installs; these tests skip where it
is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.checkpoints import save_converted

lmms_eval = pytest.importorskip(
    "lmms_eval", reason='lmms-eval is not installed: pip install -e ".[lmms]" (README, lmms-eval)'
)

import vlmod  # noqa: E402
from vlmod.models import tiny  # noqa: E402

UTILS = """from PIL import Image


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_choice(doc):
    return doc["choices"]
"""


def _task(name: str, data: Path, body: str) -> str:
    return f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_visual: !function utils.doc_to_visual
doc_to_text: question
{body}"""


QA = """output_type: generate_until
doc_to_target: answer
generation_kwargs:
  max_new_tokens: 3
  until: ["."]
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
MC = """output_type: multiple_choice
doc_to_target: label
doc_to_choice: !function utils.doc_to_choice
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def work(llava_workdir: Callable[..., Path]) -> Path:
    """A dense tiny LLaVA, the same converted (language layers 1 and 2 at capacity 0.5), four
    images of different sizes with questions, and two local lmms-eval tasks over them."""
    root = llava_workdir("lmms")
    save_converted(root / "dense", root / "mod", vlmod.MoDConfig(capacity=0.5, layers=[1, 2], routable=("image",)))
    from PIL import Image

    rng = np.random.default_rng(0)
    docs = []
    for i in range(4):
        path = root / f"image{i}.png"
        Image.fromarray(rng.integers(0, 255, (24 + 8 * i, 32, 3), dtype=np.uint8)).save(path)
        docs.append({"image": str(path), "question": "what color is the circle ?", "answer": ["red", "blue"][i % 2],
                     "choices": ["red", "blue", "green"], "label": i % 2})
    (root / "data.json").write_text(json.dumps(docs))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "utils.py").write_text(UTILS)
    (tasks / "qa.yaml").write_text(_task("vlmod_test_qa", root / "data.json", QA))
    (tasks / "mc.yaml").write_text(_task("vlmod_test_mc", root / "data.json", MC))
    return root


def test_the_lmms_eval_command_runs_a_converted_checkpoint_and_reports_its_compute(work: Path) -> None:
    out = work / "out"
    cli = Path(sys.executable).with_name("lmms-eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf")}
    run = subprocess.run(
        [str(cli), "--model", "vlmod", "--model_args", f"pretrained={work / 'mod'},device=cuda",
         "--tasks", "vlmod_test_qa,vlmod_test_mc", "--include_path", str(work / "tasks"), "--batch_size", "2",
         "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, env=env, cwd=work, timeout=600,
    )
    # cli_evaluate exits 0 even when the evaluation raised: the results file is the verdict.
    found = sorted(out.glob("*/*_results.json"))
    assert found, f"no results JSON (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = json.loads(found[-1].read_text())
    exact = results["results"]["vlmod_test_qa"]["exact_match,none"]
    acc = results["results"]["vlmod_test_mc"]["acc,none"]
    assert 0.0 <= exact <= 1.0 and 0.0 <= acc <= 1.0
    figures = results["throughput"]
    assert figures["avg_vlmod_samples"] == 4 + 12  # 4 generations, 4 docs x 3 choices scored
    assert figures["avg_vlmod_mod_layers"] == 2
    # Each row's image tokens: ceil(0.5 n) of n = 16 (even), so exactly half ran.
    for key in ("avg_vlmod_vision_tokens_ran", "avg_vlmod_vision_tokens_ran/language.1",
                "avg_vlmod_vision_tokens_ran/language.2"):
        assert figures[key] == pytest.approx(0.5)
    mod, dense = figures["avg_vlmod_prefill_flops_per_sample"], figures["avg_vlmod_dense_prefill_flops_per_sample"]
    assert 0 < mod < dense and figures["avg_vlmod_prefill_flops_vs_dense"] == pytest.approx(mod / dense)
    assert figures["avg_vlmod_prefill_flops_per_sample/vision"] == figures["avg_vlmod_dense_prefill_flops_per_sample/vision"]
    # device=cuda on a machine without CUDA ran on the CPU instead of failing.
    if not torch.cuda.is_available():
        assert "CUDA is not available; running on CPU" in run.stdout + run.stderr
    samples = [json.loads(line) for f in out.glob("*/*_samples_vlmod_test_mc.jsonl") for line in f.read_text().splitlines()]
    # Each choice's (loss, greedy) reached the scoring intact, which picks the smallest loss.
    assert len(samples) == 4
    for sample in samples:
        losses = [float(resp[0]) for resp in sample["filtered_resps"]]
        assert len(losses) == 3 and sample["acc"] == float(int(np.argmin(losses)) == int(sample["target"]))


def test_the_manifest_resolves_vlmod_to_the_model_class() -> None:
    """What the entry point hands lmms-eval (the command-line test above shows the entry point is
    found; here the registry's own checks: the class is an `lmms`, simple, importable)."""
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    from vlmod.evaluation.lmms import VLMod, manifest

    registry = ModelRegistryV2()
    registry.register_manifest(manifest())
    assert registry.get_model_class("vlmod") is VLMod


def _instances(task: str, docs: list, gen: dict | None = None, visual=None) -> list:
    from lmms_eval.api.instance import Instance

    def images(doc: dict) -> list:
        from PIL import Image

        return [Image.open(doc["image"]).convert("RGB")]

    return [
        Instance("generate_until", (doc["question"], dict(gen or {"max_new_tokens": 4}), visual or images, i, task, "test"),
                 0, metadata={"task": task, "doc_id": i, "repeats": 1})
        for i, doc in enumerate(docs)
    ]


def test_batches_answer_as_single_requests_and_dense_figures(work: Path) -> None:
    from lmms_eval.api.instance import Instance

    from vlmod.evaluation.lmms import VLMod

    docs = json.loads((work / "data.json").read_text())
    answers = {}
    for batch in (1, 3):
        lm = VLMod(pretrained=str(work / "mod"), batch_size=batch)
        lm.task_dict = {"t": {"test": docs}}
        answers[batch] = lm.generate_until(_instances("t", docs))
    assert answers[1] == answers[3]  # left padding and MoD routing do not change any row's answer

    dense = VLMod(pretrained=str(work / "dense"), batch_size=2)
    dense.task_dict = {"t": {"test": docs}}
    dense.generate_until(_instances("t", docs))
    figures = dense.summary()
    assert figures["vlmod_mod_layers"] == 0 and figures["vlmod_vision_tokens_ran"] == 1.0
    assert figures["vlmod_prefill_flops_per_sample"] == figures["vlmod_dense_prefill_flops_per_sample"]

    # Scoring: the greedy next word is what greedy decoding gives, with the smallest loss (lmms-eval's
    # convention: mean NLL, lower is better).
    word = dense.generate_until(_instances("t", docs[:1], {"max_new_tokens": 1}))[0].strip()
    other = "zero" if word != "zero" else "one"
    scored = dense.loglikelihood([
        Instance("loglikelihood", (docs[0]["question"], cont, _instances("t", docs)[0].args[2], 0, "t", "test"), 0,
                 metadata={"task": "t", "doc_id": 0, "repeats": 1})
        for cont in (word, other)
    ])
    (loss, greedy), (other_loss, other_greedy) = (getattr(s, "text", s) for s in scored)
    assert greedy and not other_greedy and loss < other_loss


def test_capacity_and_router_args_and_video(work: Path, tmp_path: Path) -> None:
    from vlmod.data.video import write_video
    from vlmod.evaluation.lmms import VLMod

    lm = VLMod(pretrained=str(work / "mod"), capacity=0.25, router="random")
    assert set(vlmod.mod_layers(lm.model).values()) == {0.25}
    with pytest.raises(SystemExit, match="unknown capacty"):
        VLMod(pretrained=str(work / "mod"), capacty=0.25)

    tiny.save("llava_next_video", tmp_path / "video", image_size=32, patch_size=8)
    model = vlmod.load_pretrained(tmp_path / "video")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1], routable=("video",)))
    model.save_pretrained(tmp_path / "video")
    clip = write_video(tmp_path / "clip.mp4", np.random.default_rng(0).integers(0, 255, (6, 32, 32, 3), dtype=np.uint8))
    lm = VLMod(pretrained=str(tmp_path / "video"), batch_size=2, max_frames=4)
    docs = [{"question": "what moves ?", "video": str(clip)}] * 2
    lm.task_dict = {"v": {"test": docs}}
    texts = lm.generate_until(_instances("v", docs, visual=lambda doc: [doc["video"]]))
    assert len(texts) == 2 and texts[0] == texts[1]
    assert lm.summary()["vlmod_vision_tokens_ran/language.1"] == pytest.approx(0.5, abs=0.05)


def test_a_family_without_flops_counting_still_reports_its_routing(tmp_path: Path) -> None:
    from PIL import Image

    from vlmod.evaluation.lmms import VLMod

    tiny.save("qwen2_5_vl", tmp_path / "qwen")
    model = vlmod.load_pretrained(tmp_path / "qwen")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[1], routable=("image",)))
    model.save_pretrained(tmp_path / "qwen")
    lm = VLMod(pretrained=str(tmp_path / "qwen"), batch_size=2)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    docs = [{"question": "what is it ?"}] * 2
    lm.task_dict = {"q": {"test": docs}}
    texts = lm.generate_until(_instances("q", docs, visual=lambda doc: [image]))
    assert texts[0] == texts[1]
    figures = lm.summary()
    assert figures["vlmod_vision_tokens_ran/language.1"] == pytest.approx(0.5)
    assert not any("flops" in key for key in figures)


@pytest.mark.parametrize(("args", "message"), [
    ({"pretrained": "/no/such/checkpoint"}, "pretrained=/no/such/checkpoint does not exist"),
    ({"capacity": "abc"}, "capacity must be a number in (0, 1], got 'abc'"),
    ({"capacity": 2}, "capacity must be in (0, 1]"),
    ({"router": "bogus"}, "router must be one of learned, random"),
    ({"bogus_key": 1}, "unknown bogus_key; accepted: pretrained, capacity"),
    ({"dtype": "bogus"}, "dtype must be auto or one of"),
    ({"max_frames": 0}, "max_frames must be a positive integer"),
])
def test_bad_model_args_stop_before_loading_in_one_line(work: Path, args: dict, message: str, capsys, monkeypatch) -> None:
    """Before: each raised an exception that lmms-eval's cli_evaluate printed as a traceback, and the
    process exited 0 ("module 'torch' has no attribute 'bogus'" for dtype=bogus)."""
    from vlmod.evaluation.lmms import ModelArgsError, VLMod

    monkeypatch.setattr(vlmod, "load_pretrained", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    with pytest.raises(ModelArgsError) as caught:
        VLMod(**{"pretrained": str(work / "mod"), **args})
    assert caught.value.code == 2 and isinstance(caught.value, SystemExit)  # not an Exception: lmms-eval cannot swallow it
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"error: vlmod model_args: {message}" in err, err


def test_capacity_or_router_on_a_dense_checkpoint_and_no_pretrained_stop_in_one_line(
    work: Path, capsys, monkeypatch
) -> None:
    """Before: `vlmod.set_capacity` / `set_router` raised ValueError ("this model has no MoD layers")
    after the dense model loaded, and without pretrained= the constructor raised TypeError: both
    printed as tracebacks by lmms-eval, which then exited 0."""
    from vlmod.evaluation.lmms import ModelArgsError, VLMod

    monkeypatch.setattr(vlmod, "load_pretrained", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    dense = work / "dense"
    cases = [
        ({"pretrained": str(dense), "capacity": 0.25},
         f"capacity=0.25: pretrained={dense} has no MoD layers (a dense checkpoint); convert it first (vlmod convert) "
         "or drop capacity="),
        ({"pretrained": str(dense), "capacity": "0.5", "router": "random"},
         f"capacity=0.5, router=random: pretrained={dense} has no MoD layers (a dense checkpoint); convert it first "
         "(vlmod convert) or drop capacity= and router="),
        ({"batch_size": 2}, "pretrained=DIR is required (a vlmod or Hugging Face checkpoint folder, or a hub id)"),
    ]
    for args, message in cases:
        with pytest.raises(ModelArgsError) as caught:
            VLMod(**args)
        assert caught.value.code == 2
        assert capsys.readouterr().err == f"error: vlmod model_args: {message}\n"


def test_the_lmms_eval_command_exits_2_on_a_bad_model_arg(work: Path) -> None:
    cli = Path(sys.executable).with_name("lmms-eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf")}
    run = subprocess.run(
        [str(cli), "--model", "vlmod", "--model_args", f"pretrained={work / 'mod'},capacity=abc",
         "--tasks", "vlmod_test_qa", "--include_path", str(work / "tasks"), "--output_path", str(work / "bad")],
        capture_output=True, text=True, env=env, cwd=work, timeout=600,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "error: vlmod model_args: capacity must be a number in (0, 1], got 'abc'" in run.stderr
    assert "Traceback" not in run.stderr


def test_batch_size_in_model_args_is_refused_naming_the_flag(work: Path, capsys, monkeypatch) -> None:
    """Before: `--model_args pretrained=DIR,batch_size=4` collided with the `--batch_size` lmms-eval
    always passes (default 1): Python's "got multiple values for keyword argument 'batch_size'",
    printed by lmms-eval as a traceback, exit 0. Now one line naming `--batch_size` (and `device=`
    beside `--device` the same); `device=` alone and `--batch_size` alone still work."""
    from vlmod.evaluation.lmms import ModelArgsError, VLMod

    monkeypatch.setattr(vlmod, "load_pretrained", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    flags = {"batch_size": 1, "max_batch_size": None, "device": None}  # what lmms-eval's evaluator passes
    for args, extra, message in (
        (f"pretrained={work / 'mod'},batch_size=4", flags,
         "batch_size=4: give the batch size as lmms-eval's --batch_size (not in --model_args)"),
        (f"pretrained={work / 'mod'},device=cpu", {**flags, "device": "cpu"},
         "device=cpu: give the device as lmms-eval's --device (not in --model_args)"),
    ):
        with pytest.raises(ModelArgsError) as caught:
            VLMod.create_from_arg_string(args, extra)
        assert caught.value.code == 2
        assert capsys.readouterr().err == f"error: vlmod model_args: {message}\n"
    made: list[dict] = []
    monkeypatch.setattr(VLMod, "__init__", lambda self, **kw: made.append(kw))
    VLMod.create_from_arg_string(f"pretrained={work / 'mod'},device=cpu", flags)
    assert made == [{"pretrained": str(work / "mod"), "device": "cpu", "batch_size": 1}]
