"""The command line's names: hub ids wherever a model is taken (off the network one line within
seconds), one flag name per idea across every subcommand (the old spellings still work, hidden),
every --help shows its defaults, defaults that follow what is trained and the recipe, and a resume
that refuses a changed --lr / --max-steps / data instead of ignoring it."""

from __future__ import annotations

import argparse
import json
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from vlmod.cli import build_parser, main
from vlmod.cli.argtypes import HelpFormatter

HUB_ID = "llava-hf/llava-1.5-7b-hf"


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nobody listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# ----------------------------------------------------------------------------- hub ids


@pytest.fixture()
def hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode with the hub at a closed local port; transformers' loaders must not be reached
    (they would retry for about 30 seconds)."""
    import transformers

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained was called with the hub unreachable")

    for name in ("AutoConfig", "AutoProcessor"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refuse)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    data = root / "data.json"
    data.write_text("[]")
    finetune = root / "finetune.yaml"
    finetune.write_text(yaml.safe_dump({"model": HUB_ID, "data": str(data), "output_dir": str(root / "run")}))
    convert = root / "convert.yaml"
    convert.write_text(yaml.safe_dump({"model": HUB_ID, "out": str(root / "converted")}))
    local = root / "local-model"
    local.mkdir()
    return {"root": root, "data": data, "finetune": finetune, "convert": convert, "local": local}


def _commands(f: dict[str, Path]) -> list[tuple[list[str], str]]:
    """(argv, flag named in the message) for every subcommand that takes a model."""
    d, out = str(f["data"]), str(f["root"] / "out")
    return [
        (["convert", "--model", HUB_ID, "--out", out], "--model"),
        (["convert", "--config", str(f["convert"])], ""),
        (["rank", "--model", HUB_ID, "--data", d, "--json", str(f["root"] / "r.json")], "--model"),
        (["bench", "llava", "--model", HUB_ID], "--model"),
        (["bench", "video", "--model", HUB_ID], "--model"),
        (["finetune", "--model", HUB_ID, "--data", d, "--output-dir", out], "--model"),
        (["finetune", "--config", str(f["finetune"]), "--no-progress"], ""),
        (["eval", "--model", HUB_ID, "--data", d], "--model"),
        (["eval", "--model", str(f["local"]), "--compare", HUB_ID, "--data", d], "--compare"),
        (["audit", "--model", HUB_ID, "--data", d], "--model"),
        (["demo", "--model", HUB_ID], "--model"),
        (["demo", "--dense", HUB_ID], "--dense"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_a_hub_id_with_the_hub_unreachable_is_one_line_within_seconds(index, files, hub_unreachable, capsys):
    argv, flag = _commands(files)[index]
    start = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - start < 15
    line = _error_line(capsys)
    assert HUB_ID in line and "unreachable" in line, line
    assert "local checkpoint directory" in line and "HF_HUB_OFFLINE=1" in line
    if flag:
        assert f"{flag} {HUB_ID}" in line


@pytest.mark.parametrize("index", [0, 2, 5, 7, 9, 10])
def test_a_hub_id_offline_and_not_cached_says_what_to_do(index, files, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv, _ = _commands(files)[index]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "HF_HUB_OFFLINE is set" in line and "not in the local Hugging Face cache" in line
    assert "pass a local checkpoint directory" in line


def test_python_loaders_fail_fast_too(hub_unreachable):
    import vlmod
    from vlmod.io import hf
    from vlmod.io.hf import CheckpointError

    load_vlm = getattr(hf, "load_vlm", None) or hf.load_llava  # renamed as more families arrive

    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"unreachable.*HF_HUB_OFFLINE=1"):
        vlmod.load_pretrained(HUB_ID)
    with pytest.raises(ValueError, match=r"unreachable.*HF_HUB_OFFLINE=1"):
        load_vlm(HUB_ID, ValueError, "this supports")
    assert time.monotonic() - start < 10


def test_online_the_hub_id_reaches_from_pretrained_unchanged(monkeypatch):
    import transformers

    import vlmod.io.paths
    from vlmod.io.hf import load_config

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(vlmod.io.paths, "hub_reachable", lambda *a, **k: True)
    seen = []

    class Reached(Exception):
        pass

    def record(name, *args, **kwargs):
        seen.append(name)
        raise Reached

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", record)
    with pytest.raises(Reached):
        load_config(HUB_ID)
    assert seen == [HUB_ID]
    # and the command line's own check lets it through
    vlmod.io.paths.check_model_arg(HUB_ID, "--model")


def test_a_local_path_is_never_taken_for_a_hub_id(tmp_path, hub_unreachable, monkeypatch):
    from vlmod.io.paths import check_model_arg, looks_like_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not looks_like_hub_id("org/model") and looks_like_hub_id("org/other")
    check_model_arg("org/model", "--model")  # exists locally: the command's own checks apply
    check_model_arg("./missing/model", "--model")  # written as a path: not a hub id


# ----------------------------------------------------------------------------- one vocabulary

# (argv with the shared name, the same with the old spelling, dest, value)
ALIASES = [
    (["bench", "vit", "--model", "m", "--batch-size", "3"], "--batch-size", "--batch", "batch", 3),
    (["bench", "llava", "--batch-size", "3"], "--batch-size", "--batch", "batch", 3),
    (["bench", "video", "--batch-size", "3"], "--batch-size", "--batch", "batch", 3),
    (["convert", "--num-samples", "5"], "--num-samples", "--calib-samples", "calib_samples", 5),
    (["rank", "--model", "m", "--data", "d", "--json", "r.json"], "--json", "--out", "out", "r.json"),
    (["rank", "--model", "m", "--data", "d", "--plots", "p.png"], "--plots", "--plot", "plot", "p.png"),
    (["eval", "--model", "m", "--data", "d", "--num-samples", "4"], "--num-samples", "--limit", "limit", 4),
    (["audit", "--model", "m", "--data", "d", "--num-samples", "4"], "--num-samples", "--limit", "limit", 4),
]


@pytest.mark.parametrize(("argv", "name", "old", "dest", "value"), ALIASES)
def test_the_shared_name_and_the_old_spelling_parse_the_same(argv, name, old, dest, value):
    parser = build_parser()
    new = parser.parse_args(argv)
    legacy = parser.parse_args([old if a == name else a for a in argv])
    assert getattr(new, dest) == getattr(legacy, dest) == value


SHARED = {
    "--json": ["bench vit", "bench llava", "bench video", "bench train", "rank", "eval", "audit"],
    "--overwrite": ["convert", "finetune", "data synthetic", "recipe"],
    "--plots": ["rank", "audit"],
    "--batch-size": ["bench vit", "bench llava", "bench video", "rank", "eval", "audit", "finetune", "recipe"],
    "--num-samples": ["convert", "rank", "eval", "audit"],
}
OLD = {"--out": ["rank"], "--plot": ["rank"], "--batch": ["bench vit", "bench llava", "bench video"],
       "--calib-samples": ["convert"], "--limit": ["eval", "audit"]}


def _parsers(parser: argparse.ArgumentParser | None = None, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser, by its command line ('bench vit', 'data synthetic', ...)."""
    parser = parser or build_parser()
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix}{name}"] = sub
                found.update(_parsers(sub, f"{prefix}{name} "))
    return found


def test_every_subcommand_takes_the_shared_names_and_hides_the_old_ones():
    parsers = _parsers()
    for name, commands in SHARED.items():
        for command in commands:
            assert name in parsers[command]._option_string_actions, f"vlmod {command} lacks {name}"
    for old, commands in OLD.items():
        for command in commands:
            parser = parsers[command]
            assert old in parser._option_string_actions, f"vlmod {command} no longer takes {old}"
            shown = parser.format_help()
            assert not re.search(rf"{re.escape(old)}(?![-\w])", shown), f"vlmod {command} --help lists {old}"


def test_every_help_shows_its_defaults():
    for command, parser in _parsers().items():
        assert parser.formatter_class is HelpFormatter, command
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.required or action.help == argparse.SUPPRESS:
                continue
            text = formatter._get_help_string(action) or ""
            assert "default" in text, f"vlmod {command} {action.option_strings[0]}: {text!r}"
        help_text = parser.format_help()
        assert "(default: None)" not in help_text, command


def test_scripts_show_defaults_too(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_demo_model", ROOT / "scripts" / "build_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: runs/synthetic-" in out and "(default: video)" in out


def test_router_only_training_gets_the_router_learning_rate():
    from vlmod.training.config import LR, ROUTER_ONLY_LR, TrainConfig

    router_config = yaml.safe_load((ROOT / "configs" / "finetune" / "llava-1.5-7b-router.yaml").read_text())
    assert ROUTER_ONLY_LR == float(router_config["lr"])
    base = {"model": "m", "data": "d", "output_dir": "o"}
    assert TrainConfig(**base, trainable="router").lr == ROUTER_ONLY_LR
    assert TrainConfig(**base, trainable="language").lr == LR
    assert TrainConfig(**base, trainable="router", lr=5e-4).lr == 5e-4
    assert f"{ROUTER_ONLY_LR} with --trainable router" in " ".join(_parsers()["finetune"].format_help().split())


def test_synthetic_data_defaults_are_the_recipes():
    from vlmod.recipes.recipe import RecipeSettings

    image, video = RecipeSettings.for_task("image"), RecipeSettings.for_task("video")
    args = build_parser().parse_args(["data", "synthetic"])
    assert (args.train, args.val) == (image.num_train, image.num_val) == (16000, 2400)
    assert (args.image_size, args.distractors) == (image.image_size, image.distractors)
    assert (args.videos, args.frames) == (video.num_train, video.frames)


# ----------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def finished_run(llava_workdir: Callable[..., Path]) -> dict[str, Path]:
    root = llava_workdir("resume", train=8, val=0)
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(root / "dense"), "data": str(root / "data" / "train.json"), "output_dir": str(root / "run"),
        "batch_size": 4, "max_steps": 2, "save_steps": 1, "save_total_limit": None, "cache_data": True,
        "mod": {"capacity": 0.5, "layers": [1, 2], "routable": ["image"]},
    }))
    assert main(["finetune", "--config", str(config), "--no-progress"]) == 0
    return {"root": root, "config": config, "data": root / "data" / "train.json"}


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--lr", "5e-4"], "lr: 2e-05 -> 0.0005"), (["--max-steps", "5"], "max_steps: 2 -> 5")],
)
def test_resume_with_a_changed_setting_refuses_naming_it(finished_run, flags, named, capsys):
    argv = ["finetune", "--config", str(finished_run["config"]), "--resume", "latest", "--no-progress"]
    assert main([*argv, *flags]) == 2
    line = _error_line(capsys)
    assert "other settings" in line and named in line, line


def test_resume_with_changed_data_at_the_same_path_refuses(finished_run, tmp_path, capsys):
    data = finished_run["data"]
    before = data.read_bytes()
    try:
        records = json.loads(before)
        data.write_text(json.dumps(records[:-1]))
        argv = ["finetune", "--config", str(finished_run["config"]), "--resume", "latest", "--no-progress"]
        assert main(argv) == 2
        line = _error_line(capsys)
        assert "data_content" in line and "the data file changed" in line, line
    finally:
        data.write_bytes(before)
