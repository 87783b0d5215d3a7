"""The commands beyond convert on every family past LLaVA (Qwen2.5-VL, Qwen3-VL, InternVL, Gemma 3):
`vlmod rank`, `vlmod finetune --trainable router`, `vlmod eval`, `vlmod audit` and the demo's token
layout, each through the CLI (or the demo app) on saved tiny checkpoints. One row of FAMILIES per
family; each row's checkpoints and data are built once and shared by its tests."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.families import BUILD, FAMILIES
from PIL import Image

import vlmod
from vlmod.cli import main
from vlmod.models import tiny

# What each family's forward needs from its processor besides input_ids / attention_mask / pixels.
NEEDS = {
    "qwen2_5_vl": {"mm_token_type_ids", "image_grid_thw"},
    "qwen3_vl": {"mm_token_type_ids", "image_grid_thw"},
    "internvl": set(),
    "gemma3": {"token_type_ids"},
}
CAPACITY = 0.5


@dataclass
class Row:
    name: str
    dense: Path
    mod: Path
    data: Path
    root: Path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vlmod.data.synthetic import generate

    root = tmp_path_factory.mktemp("family_data")
    generate(root, 0, 4, image_size=32)
    return root / "val.json"


@pytest.fixture(scope="module", params=FAMILIES)
def row(request: pytest.FixtureRequest, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Row:
    """A dense tiny checkpoint and its conversion (every convertible language layer at capacity
    0.5, routers set to random values so they rank tokens by content)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model, processor = tiny.build(name, **BUILD.get(name, {}))
    model.save_pretrained(root / "dense")
    processor.save_pretrained(root / "dense")
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=CAPACITY, layers="all"))
    torch.manual_seed(0)
    with torch.no_grad():
        model.model.language_model.mod_router.weight.normal_(std=0.5)
    model.save_pretrained(root / "mod")
    processor.save_pretrained(root / "mod")
    return Row(name, root / "dense", root / "mod", data, root)


def test_rank_cli(row: Row, capsys: pytest.CaptureFixture) -> None:
    out = row.root / "ranks.json"
    argv = ["rank", "--model", str(row.dense), "--data", str(row.data), "--json", str(out), "--num-samples", "2",
            "--batch-size", "2", "--no-progress"]
    assert main(argv) == 0
    ranks = json.loads(out.read_text())
    assert ranks["family"] == row.name and ranks["num_samples"] == 2
    assert len(ranks["layers"]) == tiny.build.__kwdefaults__["layers"]
    assert ranks["suggested"] and not set(ranks["suggested"]) & set(ranks["dense_layers"])
    # The vision tower: InternViT and Gemma 3's SigLIP rank; Qwen's packed tower is one error line.
    vision = main([*argv[:6], str(row.root / "vision.json"), *argv[7:], "--part", "vision"])
    assert vision == (2 if row.name.startswith("qwen") else 0)
    if vision:
        assert "packed variable-resolution" in capsys.readouterr().err


def test_collated_batch_carries_what_the_family_needs(row: Row) -> None:
    from transformers import AutoConfig, AutoProcessor

    from vlmod.data import LlavaDataset

    processor = AutoProcessor.from_pretrained(row.mod)
    image_token_id = AutoConfig.from_pretrained(row.mod).image_token_id
    ds = LlavaDataset(row.data, processor)
    batch = ds.collate([ds[0], ds[1]])
    assert NEEDS[row.name] <= set(batch)
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in batch:  # one type per token, padded with text (0) like the ids
            assert batch[key].shape == batch["input_ids"].shape
            assert torch.equal(batch[key].bool(), batch["input_ids"] == image_token_id)
    for r in range(2):  # labels: the answer and the end of the turn, nothing else
        labels = batch["labels"][r]
        answer = ds.records[r].conversations[-1]["value"]
        assert processor.tokenizer.decode(labels[labels != -100]) == f"{answer} </s>"


def test_finetune_router_cli(row: Row) -> None:
    out = row.root / "finetune"
    argv = ["finetune", "--model", str(row.mod), "--data", str(row.data), "--output-dir", str(out), "--trainable",
            "router", "--max-steps", "2", "--batch-size", "2", "--lr", "0.05", "--no-progress"]
    assert main(argv) == 0
    before, after = vlmod.load_pretrained(row.mod), vlmod.load_pretrained(out / "model")
    assert vlmod.mod_layers(after) == vlmod.mod_layers(before)
    trained = after.state_dict()
    changed = {k for k, v in before.state_dict().items() if not torch.equal(v, trained[k])}
    assert changed and all("mod_router" in k for k in changed), changed


def test_eval_and_audit_cli(row: Row) -> None:
    report = row.root / "eval.json"
    argv = ["eval", "--model", str(row.mod), "--data", str(row.data), "--max-new-tokens", "2", "--num-samples", "2",
            "--json", str(report), "--no-progress"]
    assert main(argv) == 0
    (mod,) = json.loads(report.read_text())["reports"]
    assert len(mod["samples"]) == 2 and mod["flops_per_sample"] < mod["dense_flops_per_sample"]
    assert all(v == pytest.approx(CAPACITY, abs=0.05) for v in mod["processed_fraction"].values())
    audit = row.root / "audit.json"
    argv = ["audit", "--model", str(row.mod), "--data", str(row.data), "--routers", "learned,random", "--max-new-tokens",
            "2", "--num-samples", "1", "--json", str(audit), "--no-progress"]
    assert main(argv) == 0
    result = json.loads(audit.read_text())
    assert result["routers"] == ["learned", "random"] and not result["skipped"]
    assert set(result["routing"]) == {"learned", "random"}


def test_demo_lays_tokens_out_on_the_picture(row: Row) -> None:
    """The demo serves the checkpoint and maps each MoD layer's processed image tokens onto the
    family's token grid: Qwen's dynamic grid from image_grid_thw (2x2 merged patches), InternVL's
    tiles and thumbnail, Gemma 3's pooled square."""
    from starlette.testclient import TestClient

    from vlmod.demo.app import create_app

    client = TestClient(create_app(row.mod, max_new_tokens=2, num_frames=2, timing_runs=0))
    width, height = 64, 40
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    response = client.post("/api/analyze", data={"prompt": "what color is the circle ?"},
                           files={"file": ("a.png", buf.getvalue(), "image/png")})
    assert response.status_code == 200, response.text
    body = response.json()
    views, stats = body["media"][0]["views"], body["stats"]
    expected = {  # (rows, cols) of the first view: the whole picture
        "qwen2_5_vl": (3, 5), "qwen3_vl": (3, 5),  # 64 x 40 -> 40 x 24 px (at most 32^2 px), 8 px per token
        "internvl": (2, 4),  # 1 x 2 tiles of 2 x 2 tokens, then the thumbnail
        "gemma3": (4, 4),
    }[row.name]
    assert (views[0]["rows"], views[0]["cols"]) == expected
    mod_layers = body["layers"]["language"]["mod"]
    assert mod_layers == sorted(layer for _, layer in vlmod.mod_layers(vlmod.load_pretrained(row.mod)))
    n = stats["vision_tokens"]
    assert sum(v["rows"] * v["cols"] for v in views) == n
    k = math.ceil(CAPACITY * n)
    assert all(count == k for count in stats["processed_per_layer"].values())
    for view in views:
        assert len(view["masks"]) == len(mod_layers) and all(len(m) == view["rows"] * view["cols"] for m in view["masks"])
    for i in range(len(mod_layers)):
        assert sum(sum(view["masks"][i]) for view in views) == k
