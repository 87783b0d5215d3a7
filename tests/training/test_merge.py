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


def test_adapters_saved_as_adapters_load_as_the_merged_model_from_anywhere(tmp_path, monkeypatch):
    """Before: a LoRA run saved only the merged model (13.5 GB for a 7B, adapters lost). Now the
    adapters are also saved as adapters (peft's files, the routers and projector beside them, the
    base as an absolute path and the conversion the run trained): `vlmod.load_pretrained` of the
    folder, from another working directory, is the merged model bit for bit; a base converted
    otherwise is refused in one line."""
    import pytest

    import vlmod
    from vlmod.io.hf import CheckpointError
    from vlmod.training.merge import save_adapter
    from vlmod.training.setup import set_trainable

    model, processor = tiny.build("llava")
    model.save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    base = vlmod.load_pretrained("base")  # a relative path, as a user types it
    vlmod.apply_mod(base, vlmod.MoDConfig(capacity=0.5, layers=[1]), part="language")  # `mod:` of the run
    peft = add_lora(base, TrainConfig(model="base", data="d.json", output_dir="o", trainable="lora", lora_r=4))
    set_trainable(peft, "lora")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # what training would have moved: B, a router, the projector
        for name, p in peft.named_parameters():
            if "lora_B" in name or "mod_router" in name or "multi_modal_projector" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    save_adapter(peft, peft.state_dict(), tmp_path / "adapter")
    merged = copy.deepcopy(peft).merge_and_unload().state_dict()
    monkeypatch.chdir(tmp_path.parent)
    loaded = vlmod.load_pretrained(tmp_path / "adapter").state_dict()
    assert loaded.keys() == merged.keys() and all(torch.equal(loaded[k], merged[k]) for k in merged)
    other = vlmod.load_pretrained(tmp_path / "base")
    vlmod.apply_mod(other, vlmod.MoDConfig(capacity=0.25, layers=[2]), part="language")
    other.save_pretrained(tmp_path / "other")
    from vlmod.io.adapters import load_adapter

    with pytest.raises(CheckpointError, match="is converted .* unlike the model these adapters trained") as e:
        load_adapter(tmp_path / "adapter", base=tmp_path / "other")
    assert "\n" not in str(e.value)
