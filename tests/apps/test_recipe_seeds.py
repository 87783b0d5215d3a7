"""`vlmod recipe --seeds`: the table over seeds from each seed's results.json (no training here;
the --quick run over two seeds is in test_recipe.py, beside the quick run it reuses)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vlmod.cli import main
from vlmod.errors import InputError
from vlmod.io.owned import Ledger
from vlmod.recipes.reuse import RECIPE
from vlmod.recipes.seed_runs import plan_seed, run_seeds_again
from vlmod.recipes.seeds import combine, write_combined
from vlmod.recipes.settings import RecipeSettings

TYPES = ("color", "count")


def _row(method: str, target: float | None, correct: str, by_type: tuple[float, float]) -> dict:
    return {"method": method, "label": method, "target": target, "setting": "-",
            "accuracy": correct.count("1") / len(correct), "accuracy_by_type": dict(zip(TYPES, by_type, strict=True)),
            "samples": len(correct), "correct": correct}


def _run(folder: Path, seed: int, rows: list[dict], **settings: object) -> Path:
    """A finished run's results.json as the recipe writes it (settings and rows), no models."""
    folder.mkdir(parents=True)
    data = {"settings": RecipeSettings.for_task("image", quick=True, seed=seed, **settings).to_dict(), "results": rows}
    (folder / "results.json").write_text(json.dumps(data))
    return folder


def test_combine_gives_each_seed_the_mean_the_worst_and_the_dense_gaps(tmp_path: Path) -> None:
    """Before: there was no table over seeds; one seed's results.md was the evidence, and a lucky
    seed could carry a claim. Now the combined row holds each seed's accuracy, the mean and the worst
    seed, and the dense gap per seed on the questions both answered (a baseline answers the first
    ones only), its mean and worst; a method out of reach on one seed is averaged over the others."""
    n = 250  # enough questions for a verdict
    dense0, dense1 = "1" * 240 + "0" * 10, "1" * 200 + "0" * 50
    a = _run(tmp_path / "a", 0, [_row("dense", None, dense0, (0.98, 0.94)),
                                  _row("learned", 3.0, "1" * 230 + "0" * 20, (0.9, 0.94)),
                                  _row("random", 3.0, "1" * 40 + "0" * 60, (0.5, 0.3))])
    b = _run(tmp_path / "b", 1, [_row("dense", None, dense1, (0.8, 0.8)),
                                  _row("learned", 3.0, "1" * 210 + "0" * 40, (0.86, 0.82))])
    out = tmp_path / "both"
    out.mkdir()
    combined = write_combined(out, [a, b])
    rows = {(r["method"], r["target"]): r for r in json.loads((out / "results.json").read_text())["results"]}
    learned = rows["learned", 3.0]
    assert learned["accuracy"] == [230 / n, 210 / n]
    assert learned["mean"] == pytest.approx((230 + 210) / 2 / n) and learned["worst"] == 210 / n
    assert learned["worst_seed"] == 1
    assert learned["dense_gap_points"] == pytest.approx([-4.0, 4.0])
    assert learned["dense_gap_mean"] == pytest.approx(0.0) and learned["dense_gap_worst"] == pytest.approx(-4.0)
    assert learned["accuracy_by_type_mean"] == pytest.approx({"color": 0.88, "count": 0.88})
    random = rows["random", 3.0]  # seed 0 only; its 100 questions against dense's first 100 (all right)
    assert random["accuracy"] == [0.4, None] and random["mean"] == 0.4 and random["dense_gap_points"][0] == -60.0
    assert rows["dense", None]["dense_gap_mean"] is None and combined["verdict"]
    table = (out / "results.md").read_text()
    assert table.startswith("Accuracy (%) of the image recipe on 2 seeds (0, 1)")
    assert "| learned | /3 | 92.0 | 84.0 | 88.0 | 84.0 (1) | -4.0 / +4.0 | +0.0 | -4.0 |" in table
    assert "| random | /3 | 40.0 | - | 40.0 | 40.0 (0) | -60.0 / - | -60.0 | -60.0 |" in table
    assert "on some seeds only" in table and "`a/results.md`" not in table  # outside --out: its own path
    assert f"`{a}/results.md`" in table


def test_a_seed_without_a_verdict_makes_the_table_check_the_pipeline_only(tmp_path: Path) -> None:
    """Before: no table over seeds. Now a seed whose dense model is too few questions or too near
    chance (the evidence rule of one run's results.md) puts the no-verdict line first, naming it."""
    a = _run(tmp_path / "a", 0, [_row("dense", None, "1" * 240 + "0" * 10, (0.96, 0.96))])
    b = _run(tmp_path / "b", 2, [_row("dense", None, "1000000", (0.1, 0.2))])
    table = (write_combined(tmp_path, [a, b]), (tmp_path / "results.md").read_text())[1]
    first = table.splitlines()[0]
    assert first.startswith("This run checks the pipeline only, so it gives no verdict (seed 2: 7 questions")
    assert "seed 0" not in first


def test_combine_refuses_runs_that_differ_beyond_the_seed_or_repeat_one(tmp_path: Path) -> None:
    """Before: no combination. Now runs of other settings, a repeated seed, or a run that has not
    finished are refused in one line each."""
    dense = [_row("dense", None, "1" * 240 + "0" * 10, (0.96, 0.96))]
    a = _run(tmp_path / "a", 0, dense)
    with pytest.raises(InputError, match="ran with other dense_steps than"):
        combine([a, _run(tmp_path / "b", 1, dense, dense_steps=7)])
    with pytest.raises(InputError, match="seed 0 comes more than once"):
        combine([a, _run(tmp_path / "c", 0, dense)])
    # A run older than a setting (its record lacks the key) ran at that setting's default: it combines.
    old = _run(tmp_path / "old", 2, dense)
    data = json.loads((old / "results.json").read_text())
    del data["settings"]["stack_lr"]
    (old / "results.json").write_text(json.dumps(data))
    assert [r["accuracy"] for r in combine([a, old])["results"]] == [[0.96, 0.96]]
    with pytest.raises(InputError, match="has not finished"):
        combine([a, tmp_path / "d"])
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "results.json").write_text('{"settings": {}, "results": []}')
    with pytest.raises(InputError, match="no dense row"):
        combine([tmp_path / "e"])


def _error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "0,1", "--seed", "2"], "--seeds runs the frontier recipe once per seed: drop --seed"),
    (["--seeds", "0,1", "--isoflop"], "drop --isoflop"),
    (["--seeds", ""], "--seeds: is empty: give a comma list of seeds, e.g. --seeds 0,1,2"),
    (["--seeds", "0,1,0"], "gives seed 0 more than once in '0,1,0': give each seed once"),
    (["--seeds", "0,x"], "expected a comma list of integer seeds (e.g. 0,1,2), got '0,x': 'x' is not an integer"),
    (["--seeds", "0,,1"], "'' is not an integer"),
])
def test_seeds_refuses_a_bad_list_or_a_clash_in_one_line(argv: list, message: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """Before: --seeds did not exist (argparse refused the flag). Now a bad list or --seeds with
    --seed / --isoflop is one error line, exit 2, and nothing is created."""
    assert main(["recipe", "--quick", "--out", str(tmp_path / "run"), *argv]) == 2
    assert message in _error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_seeds_refuses_an_out_it_may_not_write_before_any_seed_runs(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: no --seeds. Now its --out follows a one-seed run's rules: a folder holding a user's
    files is refused, and so is a seed folder holding an earlier run without --reuse-dense or
    --overwrite, both before any seed trains."""
    import vlmod.recipes.recipe

    monkeypatch.setattr(vlmod.recipes.recipe, "generate", lambda *a, **k: pytest.fail("a seed started"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's notes")
    assert main(["recipe", "--quick", "--seeds", "0,1", "--out", str(mine)]) == 2
    assert "holds files a --seeds run did not make (notes.txt)" in _error_line(capsys)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    out = tmp_path / "seeds"
    (out / "seed-1" / "dense").mkdir(parents=True)
    Ledger(out / "seed-1", RECIPE).save()
    assert main(["recipe", "--quick", "--seeds", "0,1", "--out", str(out)]) == 2
    assert f"--out {out / 'seed-1'} holds an earlier recipe run" in _error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["seed-1"]  # seed 0 did not start


def test_a_resumed_run_keeps_finished_seeds_and_trains_the_rest(tmp_path: Path) -> None:
    """Before: no --seeds. Now, with --reuse-dense --reuse-trained, a seed finished with the same
    settings is kept as it is, one with nothing there trains afresh, one whose dense stage did not
    finish trains again, and one whose fine-tunes did not finish keeps its dense model."""
    s = RecipeSettings.for_task("image", quick=True)
    done = _run(tmp_path / "seed-0", 0, [_row("dense", None, "1" * 10, (1.0, 1.0))])
    Ledger(done, RECIPE).save()
    assert plan_seed(done, s, True, True, False).keep
    assert not plan_seed(done, RecipeSettings.for_task("image", quick=True, mod_steps=9), True, True, False).keep
    assert not plan_seed(done, s, True, "mod", False).keep  # its stacked stage trains again
    fresh = plan_seed(tmp_path / "seed-1", s, True, True, False)
    assert not (fresh.keep or fresh.reuse_dense or fresh.overwrite)
    stopped = tmp_path / "seed-2"
    (stopped / "dense").mkdir(parents=True)
    Ledger(stopped, RECIPE).save()
    assert plan_seed(stopped, s, True, True, False).overwrite
    (stopped / "dense" / "model").mkdir()
    (stopped / "dense" / "model" / "model.safetensors").write_bytes(b"weights")
    (stopped / "dense" / "recipe.json").write_text("{}")
    plan = plan_seed(stopped, s, True, True, False)
    assert plan.reuse_dense and not plan.reuse_trained and "fine-tunes had not all finished" in plan.note
    for run in ("mod", "stack"):
        (stopped / run / "model").mkdir(parents=True)
        (stopped / run / "model" / "model.safetensors").write_bytes(b"weights")
        (stopped / run / "train_log.json").write_text("{}")
        assert bool(plan_seed(stopped, s, True, True, False).reuse_trained) == (run == "stack")
        assert plan_seed(stopped, s, True, "mod", False).reuse_trained == ("mod",)  # the stacked stage trains again
    # No target past the MoD stage's points: the recipe trains no stacked stage, nor waits for one.
    shutil.rmtree(stopped / "stack")
    near = RecipeSettings.for_task("image", quick=True, targets=(1.5, 2.0), stack_train_from=None)
    assert plan_seed(stopped, near, True, True, False).reuse_trained
    assert not plan_seed(stopped, s, True, True, False).reuse_trained
    # Stopped by Ctrl-C: the rerun that keeps what the seeds finished.
    assert "run again with --reuse-dense --reuse-trained" in run_seeds_again(tmp_path, [0, 1])
    assert run_seeds_again(tmp_path / "new", [0, 1]) == "run again"


def test_a_negative_seed_is_refused_at_the_flag() -> None:
    """Before: `--seeds 0,-1` passed the flag and failed in seed -1's data stage with numpy's
    traceback ("expected non-negative integer"), after seed 0 had trained. Now the flag refuses it."""
    import argparse

    import pytest

    from vlmod.cli.recipe import seed_list

    assert seed_list("0,1,2") == [0, 1, 2]
    with pytest.raises(argparse.ArgumentTypeError, match="seeds are integers from 0, got -1 in '0,-1'"):
        seed_list("0,-1")
