"""`vlmod scale-check`: every stage a user runs, on a checkpoint of the real 7B shapes, each in a
process of its own so that its wall time and peak memory are its own.

The stages are the commands as a user types them (`vlmod convert`, `vlmod rank`, ...), started
with this Python; a stage's peak RSS is the kernel's record for that process (`wait4`), so the
numbers include everything the command holds, imports and processor included. The checkpoint
is built by `vlmod.models.scale` (random weights in bfloat16, no download). Outputs that later stages do
not read are deleted as soon as their stage has been measured, so the disk holds the checkpoint,
its converted copy and one fine-tuned model at most (about 3 x 14 GB for a 7B).

The run folder (`WORKDIR/SHAPE-LAYERS`) lists what scale-check made there in its marker
(`vlmod.io.owned`): a stage writes or deletes only what scale-check made, and a run whose outputs
(a fine-tune's folder, `converted/`, a report) would land on something it did not make is refused
before any stage starts. A checkpoint or data set that is already there is only read. One
scale-check writes a run folder at a time.

Before anything is built, a run that cannot fit the machine (the checkpoint's bytes, memory,
disk: `vlmod.recipes.scale_needs`) is refused in one line. A Ctrl-C or SIGTERM stops the running
stage and everything it started (`stop_stage`), and removes what a stage killed mid-save left,
before the command says it was interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vlmod.errors import InputError
from vlmod.io.files import sole_writer, write_json, write_text
from vlmod.io.owned import Ledger
from vlmod.io.signals import handling, sigterm_as_interrupt
from vlmod.recipes.scale_needs import MIN_LAYERS, check_machine

STAGES = ("build", "convert", "load", "rank", "eval", "lmms", "demo", "finetune-router", "finetune-lora",
          "finetune-full", "bench")
# Stages that must refuse, in one line, before they start: a full fine-tune of a 7B (16 bytes a
# trained parameter) fits no 24 GiB machine.
REFUSALS = ("finetune-full",)
GIB = 1024**3
COMMAND = "vlmod scale-check"  # the command a run folder's marker names
# What each stage writes in the run folder besides its log (`build` only without a checkpoint there).
OUTPUTS = {"build": ("checkpoint",), "convert": ("converted",), "rank": ("ranks.json",), "eval": ("eval.json",),
           "lmms": ("lmms", "lmms_tasks"), "finetune-router": ("ft-router",), "finetune-lora": ("ft-lora",),
           "finetune-full": ("ft-full",), "bench": ("bench.json",)}
REPORTS = ("logs", "scale_check.json", "scale_check.md")  # every run writes these


@dataclass
class StageResult:
    stage: str
    command: str
    seconds: float
    peak_rss: int
    checkpoint_bytes: int
    returncode: int
    baseline_rss: int = 0
    note: str = ""

    @property
    def ratio(self) -> float:
        """Peak RSS over the checkpoint's bytes."""
        return self.peak_rss / self.checkpoint_bytes if self.checkpoint_bytes else float("nan")

    @property
    def ratio_above_baseline(self) -> float:
        """What the stage held beyond a process that only imported the libraries, over the bytes."""
        return (self.peak_rss - self.baseline_rss) / self.checkpoint_bytes if self.checkpoint_bytes else float("nan")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def _vlmod(*args: str) -> list[str]:
    return [sys.executable, "-m", "vlmod", *args]


# Linux counts a child's peak RSS from the memory its parent had when it forked, so a stage is
# started by this small launcher (a bare Python of a few MB), which reports the stage's own peak.
# The launcher is the leader of the stage's own process group and ignores SIGINT and SIGTERM
# itself: a signal sent to the group reaches the stage and everything it started, and the launcher
# still writes the report once the stage has gone.
_LAUNCHER = """
import json, os, signal, sys
out, argv = sys.argv[1], sys.argv[2:]
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        os.execvp(argv[0], argv)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
scale = 1 if sys.platform == "darwin" else 1024
with open(out, "w") as f:
    json.dump({"peak_rss": usage.ru_maxrss * scale, "returncode": os.waitstatus_to_exitcode(status)}, f)
"""
# How long a stage has to end after each signal of `stop_stage` before the next, stronger one.
STOP_WAIT_S = 5.0


def run_measured(argv: list[str], log: Path, env: dict[str, str] | None = None,
                 while_running: Callable[[subprocess.Popen], str] | None = None) -> tuple[float, int, int, str]:
    """Run `argv` to its end (or, with `while_running`, until that returns and stops it): wall
    seconds, its peak RSS in bytes, its return code, and the note `while_running` returned. An
    exception here (Ctrl-C, SIGTERM: `sigterm_as_interrupt`) stops the stage and all it started
    (`stop_stage`) before it goes on up: nothing of the stage outlives the command."""
    report = log.with_suffix(".peak.json")
    report.unlink(missing_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, str(report), *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        note = ""
        try:
            if while_running is not None:
                note = while_running(proc)
                stop_stage(proc, (signal.SIGTERM, signal.SIGKILL))
            proc.wait()
        except BaseException:
            stop_stage(proc)
            report.unlink(missing_ok=True)
            raise
    seconds = time.perf_counter() - start
    try:
        measured = json.loads(report.read_text())
    except (OSError, ValueError):  # the launcher was killed with its stage (`stop_stage`'s SIGKILL)
        measured = {"peak_rss": 0, "returncode": proc.returncode}
    report.unlink(missing_ok=True)
    return seconds, measured["peak_rss"], measured["returncode"], note


def stop_stage(proc: subprocess.Popen, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL),
               wait: float | None = None) -> None:
    """Stop the stage `proc` launched and every process it started (its process group): each of
    `signals` in turn, `wait` seconds (STOP_WAIT_S) apart, until the group is gone. SIGINT first:
    a vlmod command then stops as on Ctrl-C and removes its temp files (convert's `.NAME.tmp-*`).
    Further Ctrl-C / SIGTERM while it stops are ignored: stopping is bounded by the waits."""
    wait = STOP_WAIT_S if wait is None else wait
    with _signals_ignored():
        for sig in signals:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            except PermissionError:  # the group's leader is gone and its id taken by another's
                break
            if _group_gone(proc, wait):
                break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:  # the launcher outlived SIGKILL (uninterruptible I/O)
            pass


def _group_gone(proc: subprocess.Popen, wait: float) -> bool:
    """Whether the launcher has exited and no process is left in its group, polled for `wait` s
    (an orphan no one reaps stays as a zombie: it holds nothing, and counts as gone)."""
    deadline = time.monotonic() + wait
    while True:
        proc.poll()
        if proc.returncode is not None and not _group_members(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group `pgid`, from /proc; where there is no /proc, any
    process the kernel still finds in it."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _signals_ignored() -> contextlib.AbstractContextManager[None]:
    return handling(signal.SIG_IGN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _demo_request(port: int, image: Path, timeout: float = 3600.0) -> Callable[[subprocess.Popen], str]:
    """Wait for the demo's health check, send one image with a question, return what it took."""

    def run(proc: subprocess.Popen) -> str:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the demo exited ({proc.returncode}) before it served")
            try:
                with urllib.request.urlopen(f"{base}/api/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the demo did not start in time")
            time.sleep(2)
        started = time.perf_counter()
        boundary = "vlmodscalecheck"
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nwhat color is the shape ?\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{image.name}"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode() + image.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
        request = urllib.request.Request(f"{base}/api/analyze", data=body, method="POST",
                                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            answer = json.loads(r.read())
        if "error" in answer:
            raise RuntimeError(f"the demo refused the request: {answer['error']}")
        return f"one request {time.perf_counter() - started:.0f} s"

    return run


def _lmms_task(root: Path, data: Path) -> Path:
    """A local lmms-eval task over the synthetic validation set (short answers, exact match)."""
    tasks = root / "lmms_tasks"
    tasks.mkdir(exist_ok=True)
    records = json.loads(data.read_text())
    docs = []
    for r in records:
        turns = r["conversations"]
        docs.append({"image": str((data.parent / r["image"]).resolve()),
                     "question": turns[0]["value"].replace("<image>", "").strip(), "answer": turns[1]["value"]})
    (tasks / "docs.json").write_text(json.dumps(docs))
    (tasks / "utils.py").write_text(
        "from PIL import Image\n\n\ndef doc_to_visual(doc):\n    return [Image.open(doc['image']).convert('RGB')]\n"
    )
    (tasks / "scale.yaml").write_text(
        f"task: vlmod_scale_check\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'docs.json'}\n"
        "test_split: test\ndoc_to_visual: !function utils.doc_to_visual\ndoc_to_text: question\n"
        "doc_to_target: answer\noutput_type: generate_until\ngeneration_kwargs:\n  max_new_tokens: 4\n  until: ['.']\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tasks


def scale_check(
    shape: str, workdir: str | Path, *, layers: int = 32, stages: tuple[str, ...] = STAGES, keep: bool = False,
    progress: bool = True,
) -> list[StageResult]:
    """Run `stages` on a `shape` checkpoint built in `workdir` (reused when it is there); the rows of
    the table, also written to `workdir/scale_check.json` and `.md` after every stage."""
    from vlmod.models.scale import SHAPES

    if shape not in SHAPES:
        raise InputError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if not stages:  # `--stages ,` would run nothing and report a table it never wrote
        raise InputError(f"--stages names no stage; give one or more of {', '.join(STAGES)}")
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise InputError(f"unknown stage(s) {sorted(unknown)}; choose from {', '.join(STAGES)}")
    if not str(workdir).strip():  # Path("") is the current folder: not what an empty value means
        raise InputError("--workdir is empty: name the folder for the checkpoints, data and table "
                         "(default: scale-check)")
    if layers < MIN_LAYERS:
        raise InputError(f"--layers must be at least {MIN_LAYERS}, got {layers}: convert makes every other "
                         "layer MoD, the first one dense, so one layer leaves nothing to convert")
    root = Path(workdir).expanduser() / f"{shape}-{layers}"
    from vlmod.io.paths import check_output_dir

    check_output_dir(root, "--workdir")
    _check_owned(root, stages)  # before anything is created
    check_machine(shape, root, layers, stages, keep)  # the checkpoint's size, memory, disk: before building
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot write to {root.parent}: {err.strerror or err}") from None
    with sole_writer(root, InputError, "--workdir"), sigterm_as_interrupt():
        ledger = _check_owned(root, stages)  # again, locked: another run may have started in between
        root.mkdir(exist_ok=True)
        return _scale_check(shape, root, ledger, layers, stages, keep, progress)


def _check_owned(root: Path, stages: tuple[str, ...]) -> Ledger:
    """The marker of `root`; InputError when an output of `stages` would land on something
    scale-check did not make (a checkpoint or data set already there is read, not written)."""
    ledger = Ledger(root, COMMAND)
    names = list(REPORTS)
    if not (root / "data" / "val.json").is_file():
        names.append("data")
    for stage in stages:
        if stage == "build" and (root / "checkpoint" / "config.json").is_file():
            continue
        names += OUTPUTS.get(stage, ())
    foreign = ledger.foreign(names)
    if foreign:
        raise InputError(f"--workdir: {root} holds {', '.join(foreign)}, which scale-check did not make and its "
                         "stages would replace or delete; move them away or choose another --workdir")
    return ledger


def _scale_check(shape: str, root: Path, ledger: Ledger, layers: int, stages: tuple[str, ...], keep: bool,
                 progress: bool) -> list[StageResult]:
    from tqdm.auto import tqdm

    from vlmod.data.synthetic import generate

    ckpt, conv = root / "checkpoint", root / "converted"
    for name in REPORTS:
        ledger.claim(name)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    video = shape == "llava-next-video-7b"
    data = root / "data"
    if not (data / "val.json").is_file():
        ledger.claim("data")
        generate(data, 4, 8, image_size=336, video=video, num_videos=4, num_val_videos=8, num_frames=8)
    train_json = data / ("video_train.json" if video else "train.json")
    val_json = data / ("video_val.json" if video else "val.json")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows: list[StageResult] = []
    # What a command holds before it loads anything: Python, torch, transformers, vlmod imported.
    imports = "import torch, transformers, vlmod.cli, vlmod.io.hf, vlmod.training.train; from transformers import AutoProcessor"
    _, baseline, _, _ = run_measured([sys.executable, "-c", imports], logs / "baseline.log", env)
    plans: dict[str, tuple[list[str], Any]] = {
        "build": ([sys.executable, "-c", "import sys; from vlmod.models.scale import build_checkpoint; "
                   "build_checkpoint(sys.argv[1], sys.argv[2], layers=int(sys.argv[3]))", shape, str(ckpt), str(layers)],
                  None),
        "convert": (_vlmod("convert", "--model", str(ckpt), "--out", str(conv), "--overwrite"), None),
        "load": ([sys.executable, "-c", "import sys; from vlmod.io.hf import load_vlm; "
                  "m, _ = load_vlm(sys.argv[1], ValueError, 'scale-check loads'); print(m.dtype)", str(conv)], None),
        "rank": (_vlmod("rank", "--model", str(ckpt), "--data", str(val_json), "--num-samples", "2", "--batch-size", "1",
                        "--json", str(root / "ranks.json"), "--no-progress"), None),
        "eval": (_vlmod("eval", "--model", str(conv), "--data", str(val_json), "--num-samples", "8", "--batch-size", "4",
                        "--max-new-tokens", "4", "--timing-runs", "0", "--json", str(root / "eval.json"), "--no-progress"),
                 None),
        "demo": (_vlmod("demo", "--model", str(conv), "--port", str(port := _free_port()), "--timing-runs", "0",
                        "--max-new-tokens", "4"), _demo_request(port, _first_image(data / "val.json"))),
    }
    if "lmms" in stages:  # its task files are written only when it runs
        ledger.claim("lmms_tasks")
        plans["lmms"] = ([str(Path(sys.executable).with_name("lmms-eval")), "--model", "vlmod", "--model_args",
                          f"pretrained={conv},max_new_tokens=4", "--tasks", "vlmod_scale_check", "--include_path",
                          str(_lmms_task(root, data / "val.json")), "--limit", "4", "--batch_size", "1",
                          "--output_path", str(root / "lmms")], None)
    for mode, extra in (("router", []), ("lora", ["--gradient-checkpointing"]), ("full", ["--gradient-checkpointing"])):
        plans[f"finetune-{mode}"] = (_vlmod(
            "finetune", "--model", str(conv), "--data", str(train_json), "--output-dir", str(root / f"ft-{mode}"),
            "--trainable", mode, "--max-steps", "3", "--batch-size", "1", "--mixed-precision", "bf16",
            "--log-steps", "1", "--overwrite", "--no-progress", *extra), None)
    bench = "video" if video else "llava"
    plans["bench"] = (_vlmod("bench", bench, "--model", str(conv), "--warmup", "0", "--repeats", "1",
                             "--new-tokens", "4", "--json", str(root / "bench.json"), "--no-progress"), None)
    bar = tqdm(stages, desc=f"scale-check {shape}", unit="stage", disable=not progress)
    for stage in bar:
        bar.set_postfix_str(stage)
        if stage == "build" and (ckpt / "config.json").is_file():
            bar.write(f"{ckpt} exists: reusing it (delete it to build again)")
            continue
        argv, during = plans[stage]
        for name in OUTPUTS.get(stage, ()):
            ledger.claim(name)  # absent or made by scale-check (`_check_owned`): this stage may write it
        started = time.time()
        try:
            seconds, peak, rc, note = run_measured(argv, logs / f"{stage}.log", env, during)
        except BaseException:  # stopped (Ctrl-C, SIGTERM): what a stage killed mid-save left is removed
            _remove_leftovers(root, stage)
            raise
        if stage == "demo" and rc in (-15, 143):  # stopped by us after its request: that is success
            rc = 0
        if stage == "lmms" and rc == 0 and not _written_since(root / "lmms", "*_results.json", started):
            # lmms-eval logs an error inside an evaluation and still exits 0: only its results file says it ran.
            rc, note = 1, f"lmms-eval wrote no results: see {logs / 'lmms.log'}"
        if stage in REFUSALS:  # a refusal in one line is the expected result; a start is not
            refusal = _error_line(logs / f"{stage}.log")
            rc, note = (0, f"refused: {refusal}") if rc == 2 and refusal else (rc or 1, "did not refuse")
        size = folder_bytes(ckpt)
        rows.append(StageResult(stage, " ".join(argv[1:] if argv[0] == sys.executable else argv), seconds, peak,
                                size, rc, baseline, note or ("" if rc == 0 else f"failed: see {logs / f'{stage}.log'}")))
        bar.write(format_row(rows[-1]))
        _write(root, shape, layers, rows)
        if stage.startswith("finetune") and not keep:
            ledger.remove(f"ft-{stage.split('-')[1]}")  # made by scale-check (claimed above): nothing else is deleted
    return rows


def _remove_leftovers(root: Path, stage: str) -> None:
    """The temp folders `stage` writes before its rename into place (build: `checkpoint.tmp`,
    convert: `.converted.tmp-*`), left when it had to be killed: only those stages write them."""
    import shutil

    leftovers = {"build": [root / "checkpoint.tmp"], "convert": list(root.glob(".converted.tmp-*"))}
    for path in leftovers.get(stage, []):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def _written_since(folder: Path, pattern: str, since: float) -> bool:
    return any(p.stat().st_mtime >= since for p in folder.rglob(pattern)) if folder.is_dir() else False


def _error_line(log: Path) -> str | None:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error: ")]
    return lines[-1].removeprefix("error: ") if len(lines) == 1 else None


def _first_image(data: Path) -> Path:
    return data.parent / json.loads(data.read_text())[0]["image"]


def format_row(r: StageResult) -> str:
    return (f"| {r.stage} | {r.seconds:.0f} | {r.peak_rss / GIB:.1f} | {r.checkpoint_bytes / GIB:.1f} | {r.ratio:.2f} | "
            f"{r.ratio_above_baseline:.2f} | {'ok' if r.returncode == 0 else f'exit {r.returncode}'}"
            f"{'; ' + r.note if r.note else ''} |")


def format_table(rows: list[StageResult]) -> str:
    head = ("| stage | wall s | peak RSS GiB | checkpoint GiB | ratio | above baseline | result |\n"
            "|---|---|---|---|---|---|---|")
    return "\n".join([head, *(format_row(r) for r in rows)])


def _write(root: Path, shape: str, layers: int, rows: list[StageResult]) -> None:
    """The table of this run, with the rows of stages an earlier run measured and this one did not
    (a stage rerun on its own replaces its row only), in the order of STAGES."""
    meta = {"shape": shape, "layers": layers, "cpus": os.cpu_count(), "memory_bytes": _total_memory()}
    try:
        earlier = json.loads((root / "scale_check.json").read_text())["stages"]
    except (OSError, ValueError, KeyError, TypeError):
        earlier = []
    fields = set(StageResult.__dataclass_fields__)
    ran = {r.stage for r in rows}
    kept = [StageResult(**{k: v for k, v in row.items() if k in fields})
            for row in earlier if isinstance(row, dict) and row.get("stage") in set(STAGES) - ran]
    table = sorted(kept + rows, key=lambda r: STAGES.index(r.stage))
    write_json(root / "scale_check.json", {**meta, "stages": [
        asdict(r) | {"ratio": r.ratio, "ratio_above_baseline": r.ratio_above_baseline} for r in table]})
    write_text(root / "scale_check.md", f"{shape}, {layers} language layers, bfloat16\n\n{format_table(table)}\n")


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


__all__ = ["STAGES", "StageResult", "format_table", "scale_check"]
