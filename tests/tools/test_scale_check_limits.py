"""`vlmod scale-check` within bounds (issue 58): a Ctrl-C or `kill` stops the running stage and
everything it started, with nothing left half-written; a run that cannot fit the machine (its
checkpoint's bytes, memory, disk) is refused before anything is built; `--layers` below what
convert takes and an empty `--workdir` are refused in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.interrupt import terminate, wait_for_mark

from vlmod.cli import main
from vlmod.data.synthetic import generate
from vlmod.models import tiny

# `vlmod scale-check` in a process of its own, with the convert stage slowed: it saves into its
# temp folder, starts a child, writes both ids to $MARKS and sleeps. The baseline stage (importing
# the libraries) is skipped: it is not what these tests are about.
DRIVER = r'''
import os, sys
import vlmod.recipes.scale_check as sc
from vlmod.cli import main

SLOW = """
import os, subprocess, sys, time
import vlmod.tools.convert as convert
real = convert.align_folder
def align(folder):
    real(folder)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["MARKS"] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(os.environ["MARKS"] + ".tmp", os.environ["MARKS"])
    time.sleep(600)
convert.align_folder = align
from vlmod.cli import main
sys.exit(main(sys.argv[1:]))
"""
real_run = sc.run_measured

def run_measured(argv, log, env=None, while_running=None):
    if argv[-1].startswith("import torch"):
        log.write_text("")
        return 0.0, 0, 0, ""
    return real_run(argv, log, env, while_running)

sc.run_measured = run_measured
sc._vlmod = lambda *args: [sys.executable, "-c", SLOW, *args]
sys.exit(main(sys.argv[1:]))
'''


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped holds nothing: not alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_a_killed_scale_check_stops_its_stage_and_leaves_no_temp_folder(tmp_path) -> None:
    """Before: scale-check killed (SIGTERM) died at once and its stage ran on, orphaned (the build
    kept writing a 1.8 GB checkpoint; a convert killed later left `.converted.tmp-*`). Now SIGTERM
    stops it as Ctrl-C does: the stage runs in its own process group, which gets SIGINT (convert
    removes its temp folder as on Ctrl-C), then SIGTERM and SIGKILL a few seconds apart, and
    scale-check says "nothing was left half-written" only once the stage and its children are gone."""
    root = tmp_path / "llava-1.5-7b-2"
    tiny.save("llava", root / "checkpoint", image_size=32, patch_size=8)  # there: the build stage is skipped
    generate(root / "data", 2, 2, image_size=32)
    marks = tmp_path / "marks"
    env = {**os.environ, "MARKS": str(marks), "HF_HUB_OFFLINE": "1"}
    argv = ["scale-check", "--workdir", str(tmp_path), "--layers", "2", "--stages", "convert", "--no-progress"]
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids: list[int] = []
    try:
        wait_for_mark(driver, marks, "the convert stage did not reach its save")
        pids = [int(p) for p in marks.read_text().split()]
        assert list(root.glob(".converted.tmp-*"))  # convert is mid-save
        terminate(driver)
        assert not [pid for pid in pids if _alive(pid)]  # the stage and its child
        assert not list(root.glob(".converted.tmp-*")) and not (root / "converted").exists()
    finally:
        for pid in pids:  # what this test started, should the command have left it running
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_ctrl_c_stops_the_stage_and_what_it_started(tmp_path) -> None:
    """Before: Ctrl-C sent the stage's launcher SIGTERM, which it passed to the stage alone: the
    stage's own children ran on, and a vlmod command killed by SIGTERM skips its cleanup. Now the
    whole process group gets SIGINT first (a command stops as on Ctrl-C), then stronger signals."""
    from vlmod.recipes.scale_check import run_measured

    marks = tmp_path / "marks"
    stage = ("import os, subprocess, sys, time\n"
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
             "try:\n"
             f"    open({str(marks)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
             f"    os.replace({str(marks)!r} + '.tmp', {str(marks)!r})\n"
             "    time.sleep(600)\n"
             "except KeyboardInterrupt:\n"
             f"    open({str(tmp_path / 'cleaned')!r}, 'w').write('as on Ctrl-C')\n")

    def interrupt(proc: subprocess.Popen) -> str:
        while not marks.exists():
            assert proc.poll() is None
            time.sleep(0.05)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_measured([sys.executable, "-c", stage], tmp_path / "stage.log", while_running=interrupt)
    pids = [int(p) for p in marks.read_text().split()]
    try:
        assert not [pid for pid in pids if _alive(pid)]
        assert (tmp_path / "cleaned").read_text() == "as on Ctrl-C"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_run_that_cannot_fit_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys) -> None:
    """Before: `scale-check --layers 1000` made its data set and started building a checkpoint of
    about 406 GB, with no size, memory or disk check. Now the checkpoint's bytes come from its
    config (models of one and two layers on the meta device) and a run that does not fit is
    refused in one line that says what it needs and what the machine has; nothing is created."""
    import vlmod.recipes.scale_check as sc

    monkeypatch.setattr(sc, "run_measured", lambda *a, **k: pytest.fail("a stage ran"))
    monkeypatch.delenv("VLMOD_SKIP_MEMORY_CHECK", raising=False)
    assert main(["scale-check", "--workdir", str(tmp_path), "--layers", "1000", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not enough memory and disk: a llava-1.5-7b checkpoint of 1000 language layers is "
                          "405.9 GB (bfloat16); its stages need about 407.0 GB of memory and 1218.9 GB of disk, ") and err.count("\n") == 1, err
    assert "GB of memory free and" in err and "choose fewer --layers" in err
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_size_is_the_built_ones() -> None:
    """The size the check goes by is what a built checkpoint weighs: 32 layers are the 14.1 GB
    (13.2 GiB) of the table in docs/results.md, and each layer adds the same."""
    from vlmod.models.scale import checkpoint_bytes

    assert checkpoint_bytes("llava-1.5-7b", 32) == 14_126_854_144
    assert checkpoint_bytes("llava-1.5-7b", 3) - checkpoint_bytes("llava-1.5-7b", 2) == 404_766_720  # one layer


@pytest.mark.parametrize("argv, line", [
    (["--layers", "1"], "error: argument --layers: expected an integer >= 2, got 1 (see vlmod scale-check --help)"),
    (["--workdir", ""], "error: --workdir is empty: name the folder for the checkpoints, data and table "
                        "(default: scale-check)"),
], ids=["one-layer", "empty-workdir"])
def test_one_layer_and_an_empty_workdir_are_one_line(tmp_path, monkeypatch, capsys, argv, line) -> None:
    """Before: `--layers 1` was accepted and its convert stage refused (every other layer, the
    first dense, converts none of one), and `--workdir ""` ran in the current folder. Now both are
    refused in one line before anything is made; `--help` says why the least is 2."""
    import vlmod.recipes.scale_check as sc

    monkeypatch.setattr(sc, "run_measured", lambda *a, **k: pytest.fail("a stage ran"))
    monkeypatch.chdir(tmp_path)
    assert main(["scale-check", "--layers", "2", "--no-progress", *argv]) == 2
    assert capsys.readouterr().err == line + "\n"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        main(["scale-check", "--help"])
    assert "at least 2" in " ".join(capsys.readouterr().out.split())
