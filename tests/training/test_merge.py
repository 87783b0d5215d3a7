"""Saving a LoRA fine-tune merges the adapters a group of projections at a time, each group
mapped back from a scratch file: the weights are peft's `merge_and_unload`, bit for bit, and none
of the merged projections is held in memory."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from vlmod.models import tiny
from vlmod.training.config import TrainConfig
from vlmod.training.merge import merge_lora_mapped
from vlmod.training.setup import add_lora


def _lora_model() -> torch.nn.Module:
    model, _ = tiny.build("llava")
    cfg = TrainConfig(model="m", data="d.json", output_dir="o", trainable="lora", lora_r=4)
    peft = add_lora(model.to(torch.bfloat16), cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at zero: give the adapters something to add
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return peft


def _mapped_files() -> list[tuple[int, int, str]]:
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end, fields[5]))
    return spans


def test_merged_weights_are_peft_s_own_and_mapped_from_files(tmp_path):
    peft = _lora_model()
    expected = copy.deepcopy(peft).merge_and_unload().state_dict()
    merged = merge_lora_mapped(peft, tmp_path / "scratch", group_bytes=20_000)
    got = merged.state_dict()
    assert set(got) == set(expected) and not any("lora" in name for name in got)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert len(list((tmp_path / "scratch").glob("merged-*.safetensors"))) > 1  # several groups
    spans = _mapped_files()
    projections = [n for n in got if "language_model" in n and n.endswith("proj.weight")]
    assert projections
    for name in projections:
        address = got[name].data_ptr()
        assert any(s <= address < e and "merged-" in path for s, e, path in spans), f"{name} is not mapped"
