"""The synthetic recipe runs end to end (at toy size) and reports every stage."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import vlmod
from vlmod.recipe import RecipeSettings, run_recipe

QUICK = RecipeSettings(
    num_train=32, num_val=8, image_size=32, patch_size=8, width=64, vision_width=32, dense_steps=3, mod_steps=2,
    rank_samples=4, batch_size=8, routers=("random",),
)


def test_recipe_writes_results_and_models(tmp_path: Path) -> None:
    result = run_recipe(tmp_path, QUICK, progress=False, log=lambda _: None)
    names = [r["model"] for r in result.rows]
    assert names == ["dense", "MoD, before fine-tuning", "MoD, fine-tuned", "same weights, random router"]
    assert len(result.layers) == QUICK.num_mod_layers and 0 not in result.layers
    mod = result.row("MoD, fine-tuned")
    assert mod["processed_fraction"] == 0.5 and mod["gflops_per_sample"] < result.row("dense")["gflops_per_sample"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["converted_layers"] == result.layers and set(saved["stage_seconds"]) >= {"train dense", "train MoD"}
    table = (tmp_path / "results.md").read_text()
    assert "| dense |" in table and "within 2" in table and "whole recipe" in table
    model = vlmod.load_pretrained(tmp_path / "mod" / "model")
    assert sorted(i for _, i in vlmod.mod_layers(model)) == result.layers

    spec = importlib.util.spec_from_file_location("build_demo_model", Path(__file__).parents[1] / "scripts" / "build_demo_model.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.install(tmp_path / "mod" / "model", tmp_path / "assets" / "model")
    assert vlmod.mod_layers(vlmod.load_pretrained(tmp_path / "assets" / "model")) == vlmod.mod_layers(model)


def test_reuse_dense_reruns_only_the_mod_stages(tmp_path: Path) -> None:
    import dataclasses

    import pytest

    from vlmod.errors import InputError

    first = run_recipe(tmp_path, QUICK, progress=False, log=lambda _: None)
    again = run_recipe(tmp_path, dataclasses.replace(QUICK, mod_steps=1), progress=False, log=lambda _: None,
                       reuse_dense=True)
    assert again.stages["train dense"] == first.stages["train dense"]
    assert again.row("dense")["accuracy"] == first.row("dense")["accuracy"]
    with pytest.raises(InputError, match="dense_steps"):
        run_recipe(tmp_path, dataclasses.replace(QUICK, dense_steps=4), progress=False, reuse_dense=True)


def test_synthetic_finetune_configs_match_the_recipe() -> None:
    """configs/finetune/synthetic-*.yaml are the recipe's training stages, written out."""
    from vlmod.argtypes import read_yaml_mapping
    from vlmod.train import TrainConfig, TrainError

    root = Path(__file__).parents[1] / "configs" / "finetune"
    s = RecipeSettings()
    dense = TrainConfig.from_dict(read_yaml_mapping(root / "synthetic-dense.yaml", TrainError))
    mod = TrainConfig.from_dict(read_yaml_mapping(root / "synthetic-mod.yaml", TrainError))
    assert (dense.lr, dense.max_steps, dense.weight_decay, dense.batch_size) == (s.dense_lr, s.dense_steps, s.weight_decay, s.batch_size)
    assert dense.trainable == "full" and dense.train_vision_tower
    assert (mod.lr, mod.router_lr, mod.max_steps, mod.batch_size) == (s.mod_lr, s.router_lr, s.mod_steps, s.batch_size)
    assert mod.trainable == "language" and not mod.train_vision_tower
