"""Evaluation: scoring, answer loss, routing and FLOPs figures, the command and its errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import save_converted

import vlmod
from vlmod.cli import main as cli_main
from vlmod.data import LlavaDataset
from vlmod.evaluation.evaluate import answer_losses, evaluate, format_comparison, is_correct
from vlmod.models import tiny


@pytest.fixture(scope="module")
def workdir(llava_workdir: Callable[..., Path]) -> Path:
    """dense/, mod/ (language layers 1 and 2 at capacity 0.5 over image tokens) and 8 val samples."""
    root = llava_workdir("eval", val=8)
    save_converted(root / "dense", root / "mod", vlmod.MoDConfig(capacity=0.5, layers=[1, 2], routable=("image",)))
    return root


def _answers(words_by_row: list[str]):
    """A `generate` that answers the rows of each batch with the given words, in order."""
    calls = iter(words_by_row)
    tok = tiny.tokenizer()

    def fake(model, inputs, max_new_tokens):
        rows = [tok.convert_tokens_to_ids(next(calls)) for _ in range(inputs["input_ids"].shape[0])]
        return torch.tensor(rows).unsqueeze(1)

    return fake


def test_accuracy_counts_exactly_the_right_answers(workdir: Path) -> None:
    model, processor = vlmod.load_pretrained(workdir / "dense"), tiny.build("llava", image_size=32)[1]
    ds = LlavaDataset(workdir / "data" / "val.json", processor)
    references = [r.conversations[-1]["value"] for r in ds.records]
    answers = [ref if i % 4 != 3 else "zero" for i, ref in enumerate(references)]
    report = evaluate(model, processor, ds, batch_size=3, progress=False, generate=_answers(answers))
    assert [s.correct for s in report.samples] == [i % 4 != 3 for i in range(8)]
    assert report.accuracy == pytest.approx(6 / 8)
    types = [r.raw["meta"]["type"] for r in ds.records]
    for qtype, acc in report.accuracy_by_type.items():
        rows = [i for i, t in enumerate(types) if t == qtype]
        assert acc == pytest.approx(sum(i % 4 != 3 for i in rows) / len(rows))
    assert report.processed_fraction == {} and report.flops_per_sample == report.dense_flops_per_sample


@pytest.mark.parametrize(
    ("prediction", "reference", "correct"),
    [
        ("The Circle.", "circle", True), ("circle", "a circle", True), ("square", "circle", False),
        ("B", "B", True), ("(b) because it is red", "B", True), ("B.", "(B)", True),
        ("A", "B", False), ("Blue", "B", False), ("option C", "C", True),
        ("a red circle", "A", False), ("a", "A", True), ("(a) red", "A", True), ("Answer: D", "D", True),
    ],
)
def test_is_correct(prediction: str, reference: str, correct: bool) -> None:
    assert is_correct(prediction, reference) is correct


def test_answer_loss_is_the_mean_nll_of_answer_tokens() -> None:
    logits = torch.zeros(1, 4, 5)
    logits[0, 1, 2] = 3.0  # predicts token 2 at position 2
    labels = torch.tensor([[-100, -100, 2, 4]])
    expected = (-torch.log_softmax(logits[0, 1], -1)[2] - torch.log_softmax(logits[0, 2], -1)[4]) / 2
    torch.testing.assert_close(answer_losses(logits, labels), expected.reshape(1))


def test_mod_model_reports_capacity_and_fewer_flops(workdir: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(workdir / "mod")
    mod = evaluate(vlmod.load_pretrained(workdir / "mod"), processor, workdir / "data" / "val.json",
                   batch_size=4, max_new_tokens=3, progress=False, name="mod", timing_runs=2)
    dense = evaluate(vlmod.load_pretrained(workdir / "dense"), processor, workdir / "data" / "val.json",
                     batch_size=4, max_new_tokens=3, progress=False, name="dense")
    assert set(mod.processed_fraction) == {"language.1", "language.2"}
    assert all(v == pytest.approx(0.5) for v in mod.processed_fraction.values())  # 16 image tokens, k = 8
    assert mod.flops_per_sample < mod.dense_flops_per_sample == pytest.approx(dense.flops_per_sample)
    assert mod.latency_s > 0 and len(mod.samples) == 8
    # Timed against the same weights run dense, interleaved, with the contention verdict.
    assert mod.latency["dense_seconds"] > 0 and mod.latency["new_tokens"] == 3 and mod.latency["repeats"] == 2
    assert isinstance(mod.latency["contended"], bool) and set(mod.latency["spread"]) == {"model", "dense"}
    assert dense.latency is None and dense.latency_s is None  # timing_runs=0: not timed
    table = format_comparison([mod, dense])
    assert "mod" in table and "dense" in table and "50.0%" in table and "same weights dense" in table


def test_eval_latency_interleaves_dense_and_mod_and_flags_contention(workdir: Path, monkeypatch) -> None:
    """Before: the two models were timed one after the other, each over its whole evaluation, with
    no contention check (MoD 264.7 ms against dense 14.2 ms while another job ran)."""
    from transformers import AutoProcessor

    import vlmod.evaluation.latency as latency
    from vlmod.bench.timing import Contention

    order: list[str] = []
    real = latency.time_interleaved

    def recorded(fns, **kwargs):
        wrapped = {name: (lambda name=name, fn=fn: (order.append(name), fn())) for name, fn in fns.items()}
        return real(wrapped, **kwargs)

    def busy(timings, **kwargs):
        repeats = list(range(len(next(iter(timings.values())).wall_s)))
        return Contention(repeats, True, 1.5, {n: 0.0 for n in timings}, "other processes held 1.50 cores")

    monkeypatch.setattr(latency, "time_interleaved", recorded)
    monkeypatch.setattr(latency, "contention", busy)
    processor = AutoProcessor.from_pretrained(workdir / "mod")
    report = evaluate(vlmod.load_pretrained(workdir / "mod"), processor, workdir / "data" / "val.json", limit=4,
                      batch_size=4, max_new_tokens=2, progress=False, name="mod", timing_runs=3)
    assert order == ["model", "dense", "model", "dense", "dense", "model", "model", "dense"]  # warm-up, then A B, B A, A B
    table = format_comparison([report])
    assert "(contended)" in table and "mod: latency contended (other processes held 1.50 cores)" in table


def test_cli_compare_writes_json(workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.json"
    code = cli_main([
        "eval", "--model", str(workdir / "mod"), "--compare", str(workdir / "dense"), "--data",
        str(workdir / "data" / "val.json"), "--limit", "4", "--max-new-tokens", "2", "--json", str(out), "--no-progress",
    ])
    assert code == 0
    table = capsys.readouterr().out
    assert "mod" in table and "dense" in table and "accuracy" in table
    reports = json.loads(out.read_text())["reports"]
    assert [r["name"] for r in reports] == ["mod", "dense"] and reports[0]["num_samples"] == 4


def test_two_model_folders_of_one_name_get_labels_that_tell_them_apart() -> None:
    from vlmod.evaluation.evaluate import folder_labels

    assert folder_labels(["runs/a/dense/model", "runs/b/mod/model"]) == ["dense/model", "mod/model"]
    assert folder_labels(["runs/x/model", "runs/y/model", "z"]) == ["x/model", "y/model", "z"]
    assert folder_labels(["mod", "dense"]) == ["mod", "dense"]
    assert folder_labels(["same", "same"]) == ["same", "same"]


def test_cli_capacity_moves_the_compute_point_and_compare_gives_the_paired_gap(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "report.json"
    args = ["--data", str(workdir / "data" / "val.json"), "--limit", "4", "--max-new-tokens", "2", "--no-progress"]
    assert cli_main(["eval", "--model", str(workdir / "mod"), "--capacity", "1.0", "--compare", str(workdir / "dense"),
                     "--name", "mod", "--compare-name", "dense", "--json", str(out), *args]) == 0
    printed = capsys.readouterr().out
    # A fresh conversion at capacity 1.0 computes what the dense model computes: no gap, no spread.
    assert "mod minus dense: +0.0 points, 95% interval +0.0 to +0.0 (paired, 4 questions)" in printed
    # Before: on 4 questions the interval stood alone, read as "the two models are equal". Now the
    # line says the set is too small for a verdict (vlmod.evaluation.evidence).
    assert "This run checks the pipeline only, so it gives no verdict (4 questions" in printed
    mod, dense = json.loads(out.read_text())["reports"]
    assert all(v == 1.0 for v in mod["processed_fraction"].values())
    assert [s["prediction"] for s in mod["samples"]] == [s["prediction"] for s in dense["samples"]]
    assert cli_main(["eval", "--model", str(workdir / "mod"), "--capacity", "0.25", *args]) == 0
    assert "25.0%" in capsys.readouterr().out  # routable tokens processed: 4 of 16 image tokens


def test_cli_capacity_on_a_dense_checkpoint_is_one_error_line(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["eval", "--model", str(workdir / "dense"), "--capacity", "0.5", "--data",
                     str(workdir / "data" / "val.json"), "--limit", "2", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --capacity:") and "no MoD layers" in err and err.count("\n") == 1


def test_cli_router_ranks_the_same_weights_with_another_router(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`--router attention` evaluates the saved weights and gate with the attention router's
    selection: what `vlmod.set_router` gives in Python, not what the saved (learned) router gives."""
    args = ["--data", str(workdir / "data" / "val.json"), "--limit", "4", "--max-new-tokens", "2", "--no-progress",
            "--timing-runs", "0"]
    losses = {}
    for router in ("learned", "attention"):
        out = tmp_path / f"{router}.json"
        assert cli_main(["eval", "--model", str(workdir / "mod"), "--router", router, "--capacity", "0.25",
                         "--json", str(out), *args]) == 0
        losses[router] = json.loads(out.read_text())["reports"][0]["answer_loss"]
    model, processor = vlmod.load_pretrained(workdir / "mod"), tiny.build("llava", image_size=32)[1]
    vlmod.set_capacity(vlmod.set_router(model, "attention"), 0.25)
    ds = LlavaDataset(json.loads((workdir / "data" / "val.json").read_text())[:4], processor, workdir / "data")
    expected = evaluate(model.eval(), processor, ds, batch_size=8, max_new_tokens=2, progress=False).answer_loss
    assert losses["attention"] == pytest.approx(expected, rel=1e-5) and losses["attention"] != losses["learned"]
    capsys.readouterr()
    code = cli_main(["eval", "--model", str(workdir / "dense"), "--router", "attention", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --router:") and "no MoD layers" in err and err.count("\n") == 1


def test_corrupt_image_is_skipped_and_counted(workdir: Path, tmp_path: Path) -> None:
    records = json.loads((workdir / "data" / "val.json").read_text())[:3]
    for r in records:
        r["image"] = str(workdir / "data" / r["image"])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    records[1]["image"] = str(tmp_path / "broken.png")
    (tmp_path / "val.json").write_text(json.dumps(records))
    processor = tiny.build("llava", image_size=32)[1]
    with pytest.warns(UserWarning, match="skipped 1 of 3"):
        report = evaluate(vlmod.load_pretrained(workdir / "dense"), processor, tmp_path / "val.json",
                          max_new_tokens=2, progress=False)
    assert report.skipped == 1 and len(report.samples) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--data", "/nonexistent/val.json"], "data file"),
    ],
)
def test_bad_input_is_one_error_line(workdir: Path, capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    base = {"--model": str(workdir / "mod"), "--data": str(workdir / "data" / "val.json")}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    assert cli_main(["eval", *[x for kv in base.items() for x in kv], "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err


def _records_with_broken_image(workdir: Path, tmp_path: Path, broken: int, n: int = 3) -> Path:
    records = json.loads((workdir / "data" / "val.json").read_text())[:n]
    for r in records:
        r["image"] = str(workdir / "data" / r["image"])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    records[broken]["image"] = str(tmp_path / "broken.png")
    path = tmp_path / "val.json"
    path.write_text(json.dumps(records))
    return path


def test_limit_reads_only_the_first_records(workdir: Path, tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    """A broken image past --limit is never opened: no warning, nothing skipped."""
    path = _records_with_broken_image(workdir, tmp_path, broken=2)
    processor = tiny.build("llava", image_size=32)[1]
    report = evaluate(vlmod.load_pretrained(workdir / "dense"), processor, path, limit=2, max_new_tokens=2,
                      progress=False)
    assert len(report.samples) == 2 and report.skipped == 0
    assert not [w for w in recwarn if "skipped" in str(w.message)]


def test_image_broken_after_loading_is_skipped_or_strict_error(workdir: Path, tmp_path: Path) -> None:
    from vlmod.evaluation.evaluate import EvalError

    path = _records_with_broken_image(workdir, tmp_path, broken=0)
    records = json.loads(path.read_text())
    good = tmp_path / "good.png"
    good.write_bytes((workdir / "data" / json.loads((workdir / "data" / "val.json").read_text())[0]["image"]).read_bytes())
    records[0]["image"] = str(good)
    path.write_text(json.dumps(records))
    processor = tiny.build("llava", image_size=32)[1]
    model = vlmod.load_pretrained(workdir / "dense")
    ds = LlavaDataset(path, processor)
    good.write_bytes(b"broken since")  # after the dataset checked it
    report = evaluate(model, processor, ds, max_new_tokens=2, progress=False)
    assert report.skipped == 1 and [s.id for s in report.samples] == [r["id"] for r in records[1:]]
    with pytest.raises(EvalError, match="cannot load"):
        evaluate(model, processor, ds, max_new_tokens=2, progress=False, strict=True)


def test_prompts_are_left_padded_whatever_the_tokenizer_says(workdir: Path) -> None:
    processor = tiny.build("llava", image_size=32)[1]
    processor.tokenizer.padding_side = "right"
    model = vlmod.load_pretrained(workdir / "dense")
    data = workdir / "data" / "val.json"
    batched = evaluate(model, processor, data, batch_size=8, max_new_tokens=3, progress=False)
    single = evaluate(model, processor, data, batch_size=1, max_new_tokens=3, progress=False)
    assert [s.prediction for s in batched.samples] == [s.prediction for s in single.samples]


def test_replaced_generate_still_counts_mod_flops(workdir: Path) -> None:
    """A decoding step that never runs the model must not make a MoD model look dense."""
    processor = tiny.build("llava", image_size=32)[1]
    model = vlmod.load_pretrained(workdir / "mod")
    data = workdir / "data" / "val.json"
    real = evaluate(model, processor, data, batch_size=4, max_new_tokens=2, progress=False)
    fake = evaluate(model, processor, data, batch_size=4, progress=False, generate=_answers(["zero"] * 8))
    assert fake.flops_per_sample == pytest.approx(real.flops_per_sample)
    assert fake.flops_per_sample < fake.dense_flops_per_sample


def test_bad_compare_fails_before_any_model_loads(workdir: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import vlmod.evaluation.evaluate as ev

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before every checkpoint was checked")

    monkeypatch.setattr(ev, "load_model", no_load)
    argv = ["eval", "--model", str(workdir / "mod"), "--compare", "/nonexistent/dense", "--data",
            str(workdir / "data" / "val.json"), "--no-progress"]
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error:") and "does not exist" in captured.err and captured.out == ""
