"""ViT encoders (timm, open_clip, Hugging Face CLIP/SigLIP towers) converted with vlmod.

The oracle is the unconverted upstream model: a fresh conversion at capacity 1.0 must compute
what it computes, and at lower capacity every MoD layer must run the upstream block on exactly
the selected tokens and leave the others untouched.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import open_clip
import pytest
import timm
import torch
import torchvision
from torch import Tensor, nn

import vlmod
from vlmod.routing.layer import MoDLayer

# ---------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    id: str
    build: Callable[[], nn.Module]  # the unconverted upstream model, deterministic
    image_size: int
    num_prefix: int
    num_layers: int
    forward: Callable[[nn.Module, Tensor], Tensor]  # (model, pixels) -> output
    blocks: Callable[[nn.Module], nn.ModuleList]
    call_block: Callable[[nn.Module, Tensor], Tensor]  # upstream block on [B, K, D]
    router_prefix: str  # where the shared router lives in the state dict
    block_prefix: str | None  # state-dict prefix of block i is f"{block_prefix}{i}."
    num_patches: int


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        for module in model.modules():  # make layer scale matter (1e-5 would hide a wrong block output)
            if type(module).__name__ == "LayerScale":
                with torch.no_grad():
                    module.gamma.uniform_(0.05, 0.5)
        return model

    return build


def _timm_family(fid, name, image_size, patch, num_prefix, num_layers, **kwargs) -> Family:
    return Family(
        id=fid,
        build=_timm(name, img_size=image_size, **kwargs),
        image_size=image_size,
        num_prefix=num_prefix,
        num_layers=num_layers,
        forward=lambda m, x: m(x),
        blocks=lambda m: m.blocks,
        call_block=lambda b, x: b(x),
        router_prefix="",
        block_prefix="blocks.",
        num_patches=(image_size // patch) ** 2,
    )


@functools.cache
def _open_clip(name: str, image_size: int | None) -> nn.Module:
    kwargs = {} if image_size is None else {"force_image_size": image_size}
    torch.manual_seed(0)
    return open_clip.create_model(name, pretrained=None, **kwargs)


def _open_clip_families(name: str, image_size: int | None, size: int, patch: int) -> list[Family]:
    common = dict(
        image_size=size,
        num_patches=(size // patch) ** 2,
        num_prefix=1,
        num_layers=12,
        call_block=lambda b, x: b(x),
    )
    return [
        Family(
            id=f"open_clip-{name}-CLIP",
            build=lambda: _open_clip(name, image_size),
            forward=lambda m, x: m.encode_image(x),
            blocks=lambda m: m.visual.transformer.resblocks,
            router_prefix="visual.",
            block_prefix="visual.transformer.resblocks.",
            **common,
        ),
        Family(
            id=f"open_clip-{name}-visual",
            build=lambda: _open_clip(name, image_size).visual,
            forward=lambda m, x: m(x),
            blocks=lambda m: m.transformer.resblocks,
            router_prefix="",
            block_prefix="transformer.resblocks.",
            **common,
        ),
    ]


def _hf_family(kind: str) -> Family:
    def build():
        from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

        config_cls, model_cls = {
            "clip": (CLIPVisionConfig, CLIPVisionModel),
            "siglip": (SiglipVisionConfig, SiglipVisionModel),
        }[kind]
        config = config_cls(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            attention_dropout=0.0,
        )
        return model_cls(config)

    return Family(
        id=f"hf-{kind}",
        build=build,
        image_size=32,
        num_prefix=1 if kind == "clip" else 0,
        num_layers=4,
        forward=lambda m, x: m(pixel_values=x).pooler_output,
        blocks=lambda m: getattr(m, "vision_model", m).encoder.layers,
        call_block=lambda b, x: _first(b(x, None)),
        router_prefix="",
        block_prefix=None,  # looked up in the model (the path differs across transformers versions)
        num_patches=16,
    )


def _first(out):
    return out[0] if isinstance(out, tuple) else out


FAMILIES = [
    _timm_family("timm-vit_tiny", "vit_tiny_patch16_224", 64, 16, 1, 12),
    _timm_family("timm-vit_base-d4", "vit_base_patch16_224", 64, 16, 1, 4, depth=4),
    _timm_family("timm-deit_tiny_distilled", "deit_tiny_distilled_patch16_224", 64, 16, 2, 12),
    _timm_family("timm-dinov2_reg4", "vit_small_patch14_reg4_dinov2", 70, 14, 5, 12),
    _timm_family("timm-layer_scale", "vit_tiny_patch16_224", 48, 16, 1, 6, depth=6, init_values=1e-5),
    *_open_clip_families("ViT-B-32", 160, 160, 32),
    *_open_clip_families("ViT-B-16", 64, 64, 16),
    _hf_family("clip"),
    _hf_family("siglip"),
]
FAMILY_IDS = [f.id for f in FAMILIES]
# Without the whole open_clip CLIPs (their .visual towers are in): for the checks that do not
# depend on where the tower sits, to keep the suite fast.
TOWERS = [f for f in FAMILIES if not f.id.endswith("-CLIP")]


@functools.cache
def _original(fid: str) -> nn.Module:
    fam = _family(fid)
    torch.manual_seed(0)
    return fam.build().eval()


def _family(fid: str) -> Family:
    return next(f for f in FAMILIES if f.id == fid)


@pytest.fixture(params=FAMILIES, ids=FAMILY_IDS)
def fam(request) -> Family:
    return request.param


@pytest.fixture(params=TOWERS, ids=[f.id for f in TOWERS])
def tower(request) -> Family:
    return request.param


def original(fam: Family) -> nn.Module:
    """The cached unconverted model; never convert it, convert `fresh(fam)` instead."""
    return _original(fam.id)


def fresh(fam: Family) -> nn.Module:
    return copy.deepcopy(original(fam))


def pixels(fam: Family, batch: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, fam.image_size, fam.image_size, generator=g)


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def k_of(capacity: float, n: int) -> int:
    return math.ceil(round(capacity * n, 9))


def _capture_block_io(model, fam, layers, run):
    """Run `run()` with forward hooks on blocks `layers`; {i: (input [B, L, D], output [B, L, D])}."""
    seen = {}
    handles = []
    blocks = fam.blocks(model)
    for i in layers:

        def hook(_m, args, out, i=i):
            seen[i] = (args[0].detach().clone(), _first(out).detach().clone())

        handles.append(blocks[i].register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _randomise_routers(model: nn.Module, std: float | None = None) -> None:
    """Non-zero routers, so that scores differ per token and the gate is not 1."""
    g = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if "mod_router" in name:
            with torch.no_grad():
                if name.endswith("weight"):
                    p.copy_(torch.randn(p.shape, generator=g) * (std or 1.0 / math.sqrt(p.shape[1])))
                else:
                    p.zero_()


# ---------------------------------------------------------------------------- identity at capacity 1.0


def test_capacity_one_is_the_upstream_model_eval(fam):
    model = original(fam).eval()
    converted = vlmod.apply_mod(fresh(fam).eval(), vlmod.MoDConfig(capacity=1.0, layers="all"))
    x = pixels(fam)
    last = fam.num_layers - 1
    with torch.no_grad():
        ref = {}
        ref_io = _capture_block_io(model, fam, [last], lambda: ref.setdefault("y", fam.forward(model, x)))
        got = {}
        got_io = _capture_block_io(
            converted, fam, [last], lambda: got.setdefault("y", fam.forward(converted, x))
        )
    assert all(isinstance(b, MoDLayer) for b in fam.blocks(converted))
    assert rel_err(got["y"], ref["y"]) <= 1e-5
    assert rel_err(got_io[last][1], ref_io[last][1]) <= 1e-5  # every token of the last block


def _identity_train(fam, gate):
    model = original(fam)
    converted = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=1.0, layers="all", gate=gate))
    x = pixels(fam)
    try:
        model.train()
        converted.train()
        torch.manual_seed(5)
        ref = fam.forward(model, x)
        torch.manual_seed(5)
        got = fam.forward(converted, x)
    finally:
        model.eval()
    assert rel_err(got.detach(), ref.detach()) <= 1e-5


def test_capacity_one_is_the_upstream_model_train(fam):
    _identity_train(fam, "tanh")


@pytest.mark.parametrize("gate", ["sigmoid", "none"])
@pytest.mark.parametrize("fid", ["timm-vit_tiny", "hf-clip"])
def test_capacity_one_identity_with_other_gates(fid, gate):
    _identity_train(_family(fid), gate)


def test_capacity_one_keeps_the_random_stream_of_dropout():
    """With dropout and drop path on, the converted model draws the same random numbers."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        depth=4,
        proj_drop_rate=0.2,
        attn_drop_rate=0.2,
        drop_path_rate=0.3,
    ).train()
    converted = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    x = torch.randn(4, 3, 32, 32)
    torch.manual_seed(7)
    ref = model(x)
    torch.manual_seed(7)
    got = converted(x)
    torch.manual_seed(8)
    other = model(x)
    assert not torch.allclose(other, ref)  # the dropout is live
    assert rel_err(got, ref) <= 1e-5


def test_genuine_vit_base_patch16_224_identity():
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    converted = vlmod.apply_mod(copy.deepcopy(model), vlmod.MoDConfig(capacity=1.0, layers="all"))
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = model(x)
        got = converted(x)
    assert ref.shape == (2, 1000)
    assert rel_err(got, ref) <= 1e-5


# ---------------------------------------------------------------------------- routing at capacity < 1


def test_routing_counts_skipped_tokens_and_block_oracle(fam):
    """At capacity c every MoD layer runs ceil(c * n_patches) patches + all prefix tokens per image,
    the selected tokens get exactly x + g(r) * (block(x_S) - x) with the upstream block run on the
    gathered tokens only, and the skipped tokens leave the layer bit-identical."""
    ref_model = original(fam)
    model = fresh(fam)
    x = pixels(fam)
    num_prefix = fam.num_prefix
    patches = fam.num_patches
    layers = list(range(fam.num_layers))
    for capacity in (0.5, 0.25, 0.125):
        vlmod.apply_mod(model, vlmod.MoDConfig(capacity=capacity, layers="all"))
        _randomise_routers(model)
        with torch.no_grad(), vlmod.trace_routing(model) as trace:
            io = _capture_block_io(model, fam, layers, lambda: fam.forward(model, x))
        assert sorted(trace.processed) == [("vision", i) for i in layers]
        k = k_of(capacity, patches)
        for i in layers:
            processed = trace.processed[("vision", i)]
            scores = trace.scores[("vision", i)]
            inp, out = io[i]
            assert processed.shape == inp.shape[:2] == (2, num_prefix + patches)
            assert processed.dtype == torch.bool
            assert processed[:, :num_prefix].all(), "prefix tokens must always run"
            assert processed[:, num_prefix:].sum(1).tolist() == [k, k]
            # skipped tokens: bit-identical
            skipped = ~processed
            assert torch.equal(out[skipped], inp[skipped])
            # processed tokens did run the block
            assert not torch.equal(out[processed], inp[processed])
            # the selected patches are the top-k router scores
            for b in range(2):
                p_scores = scores[b, num_prefix:]
                p_sel = processed[b, num_prefix:]
                assert p_scores[p_sel].min() > p_scores[~p_sel].max()
            # the oracle: the upstream block on the gathered tokens, gated
            x_sel = inp[processed].view(2, num_prefix + k, -1)
            r_sel = scores[processed].view(2, num_prefix + k)
            with torch.no_grad():
                y = fam.call_block(fam.blocks(ref_model)[i], x_sel)
            g = 1 + 0.2 * torch.tanh(r_sel)
            expected = x_sel + g.unsqueeze(-1) * (y - x_sel)
            got = out[processed].view(2, num_prefix + k, -1)
            assert rel_err(got, expected) <= 1e-5, (capacity, i)
        vlmod.remove_mod(model)


def test_every_other_leaves_dense_layers_dense(tower):
    model = vlmod.apply_mod(fresh(tower), vlmod.MoDConfig(capacity=0.25))
    expected = list(range(1, tower.num_layers, 2))
    assert vlmod.mod_layers(model) == {("vision", i): 0.25 for i in expected}
    blocks = tower.blocks(model)
    for i, block in enumerate(blocks):
        assert isinstance(block, MoDLayer) == (i in expected)
        assert (
            type(block).__name__
            == ("MoD" if i in expected else "") + type(tower.blocks(original(tower))[i]).__name__
        )
    with torch.no_grad(), vlmod.trace_routing(model) as trace:
        tower.forward(model, pixels(tower))
    assert sorted(trace.processed) == [("vision", i) for i in expected]


# ---------------------------------------------------------------------------- state dict, remove_mod


def _block_prefix(fam: Family, model: nn.Module) -> str:
    if fam.block_prefix is not None:
        return fam.block_prefix
    blocks = fam.blocks(model)
    name = next(n for n, m in model.named_modules() if m is blocks)
    return name + "."


def test_state_dict_keys_shared_router(fam):
    ref_keys = list(original(fam).state_dict())
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5, layers="all"))
    keys = list(model.state_dict())
    extra = [k for k in keys if k not in ref_keys]
    assert [k for k in ref_keys if k not in keys] == []  # no upstream name changed
    assert sorted(extra) == [fam.router_prefix + "mod_router.bias", fam.router_prefix + "mod_router.weight"]
    # one module, stored once
    routers = [n for n, m in model.named_modules() if n.endswith("mod_router")]
    assert routers == [fam.router_prefix + "mod_router"]
    params = [n for n, _ in model.named_parameters() if "mod_router" in n]
    assert sorted(params) == sorted(extra)
    vlmod.remove_mod(model)
    assert list(model.state_dict()) == ref_keys
    assert not any("mod_router" in n for n, _ in model.named_modules())


def test_state_dict_keys_per_layer_routers(tower):
    ref_keys = list(original(tower).state_dict())
    layers = [0, tower.num_layers - 1]
    model = vlmod.apply_mod(fresh(tower), vlmod.MoDConfig(capacity=0.5, layers=layers, share_router=False))
    keys = list(model.state_dict())
    prefix = _block_prefix(tower, model)
    extra = sorted(k for k in keys if k not in ref_keys)
    assert [k for k in ref_keys if k not in keys] == []
    assert extra == sorted(f"{prefix}{i}.mod_router.{p}" for i in layers for p in ("weight", "bias"))
    # the routers are distinct modules
    r0, r1 = (tower.blocks(model)[i].mod_router for i in layers)
    assert r0 is not r1


def test_converted_state_dict_loads_into_the_plain_model(tower):
    model = vlmod.apply_mod(fresh(tower), vlmod.MoDConfig(capacity=0.5))
    plain = fresh(tower)
    result = plain.load_state_dict(model.state_dict(), strict=False)
    assert result.missing_keys == []
    assert sorted(result.unexpected_keys) == sorted(
        k for k in model.state_dict() if k not in original(tower).state_dict()
    )
    assert result.unexpected_keys  # the routers


def test_remove_mod_restores_classes_keys_and_outputs(fam):
    ref = original(fam)
    x = pixels(fam)
    with torch.no_grad():
        expected = fam.forward(ref, x)
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5, layers="all", share_router=False))
    _randomise_routers(model)
    with torch.no_grad():
        routed = fam.forward(model, x)
    assert not torch.allclose(routed, expected, atol=1e-4)
    assert vlmod.remove_mod(model) is model
    assert [type(b) for b in fam.blocks(model)] == [type(b) for b in fam.blocks(ref)]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert vlmod.mod_layers(model) == {}
    with torch.no_grad():
        assert torch.equal(fam.forward(model, x), expected)
    with pytest.raises(ValueError, match="no MoD layers"):
        with vlmod.trace_routing(model):
            pass
    # and it can be converted again
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=1.0, layers="all"))
    with torch.no_grad():
        assert rel_err(fam.forward(model, x), expected) <= 1e-5


# ---------------------------------------------------------------------------- training


def test_router_gets_gradient(tower):
    model = vlmod.apply_mod(fresh(tower), vlmod.MoDConfig(capacity=0.5, gate="tanh")).train()
    out = tower.forward(model, pixels(tower))
    out.float().pow(2).mean().backward()
    router = dict(model.named_parameters())[tower.router_prefix + "mod_router.weight"]
    assert router.grad is not None
    assert torch.isfinite(router.grad).all()
    assert router.grad.abs().sum() > 0


def test_gate_none_gives_the_router_no_gradient():
    fam = _family("timm-vit_tiny")
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5, gate="none")).train()
    _randomise_routers(model)
    fam.forward(model, pixels(fam)).pow(2).mean().backward()
    assert model.mod_router.weight.grad is None or not model.mod_router.weight.grad.any()


def _train_step(fam, cfg, checkpointing, seed=0):
    torch.manual_seed(seed)
    model = vlmod.apply_mod(fresh(fam), cfg).train()
    _randomise_routers(model, std=0.05)
    model.set_grad_checkpointing(checkpointing)
    out = fam.forward(model, pixels(fam))
    out.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("fid", ["timm-vit_tiny", "open_clip-ViT-B-16-CLIP"])
def test_gradient_checkpointing_matches(fid):
    fam = _family(fid)
    cfg = vlmod.MoDConfig(capacity=0.5, layers="all")
    out_a, grads_a = _train_step(fam, cfg, checkpointing=False)
    out_b, grads_b = _train_step(fam, cfg, checkpointing=True)
    assert torch.allclose(out_a, out_b, atol=1e-6, rtol=1e-5)
    router = fam.router_prefix + "mod_router.weight"
    assert grads_a[router].abs().sum() > 0
    assert sorted(grads_a) == sorted(grads_b)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("seed", [None, 0])
def test_gradient_checkpointing_with_a_random_router(seed):
    """Recomputation in backward must select the same tokens as the forward did."""
    fam = _family("timm-vit_tiny")
    cfg = vlmod.MoDConfig(capacity=0.5, layers="all", router="random", seed=seed)
    out_a, grads_a = _train_step(fam, cfg, checkpointing=False)
    out_b, grads_b = _train_step(fam, cfg, checkpointing=True)
    assert torch.equal(out_a, out_b)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-4), name


def test_hf_gradient_checkpointing_matches():
    fam = _family("hf-clip")

    def step(checkpointing):
        model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5, layers="all")).train()
        _randomise_routers(model)
        if checkpointing:
            model.activation_checkpointing_enable()
        out = fam.forward(model, pixels(fam))
        out.pow(2).mean().backward()
        return out.detach(), model.mod_router.weight.grad.clone()

    out_a, grad_a = step(False)
    out_b, grad_b = step(True)
    assert torch.allclose(out_a, out_b, atol=1e-6)
    assert grad_a.abs().sum() > 0
    assert torch.allclose(grad_a, grad_b, atol=1e-7, rtol=1e-4)


def test_bce_aux_loss():
    fam = _family("timm-vit_tiny")
    plain = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5)).train()
    fam.forward(plain, pixels(fam))
    assert vlmod.router_aux_loss(plain) is None
    assert vlmod.router_aux_loss(fresh(fam)) is None

    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5, aux_loss="bce", gate="none")).train()
    _randomise_routers(model)
    fam.forward(model, pixels(fam))
    loss = vlmod.router_aux_loss(model)
    assert loss is not None and loss.dim() == 0
    assert torch.isfinite(loss) and loss.item() > 0
    assert loss.requires_grad
    loss.backward()
    assert model.mod_router.weight.grad.abs().sum() > 0
    # with a zero router every logit is 0: the loss is log 2
    zero = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5, aux_loss="bce")).train()
    fam.forward(zero, pixels(fam))
    assert vlmod.router_aux_loss(zero).item() == pytest.approx(math.log(2), rel=1e-5)


def test_cosine_schedule_processes_fewer_tokens_deeper():
    fam = _family("timm-vit_tiny")
    cfg = vlmod.MoDConfig(capacity=0.5, layers="all", capacity_schedule="cosine")
    model = vlmod.apply_mod(fresh(fam), cfg)
    caps = vlmod.mod_layers(model)
    expected = vlmod.routing.layer_capacities(0.5, list(range(12)), 12, "cosine")
    assert caps == {("vision", i): c for i, c in expected.items()}
    with torch.no_grad(), vlmod.trace_routing(model) as trace:
        fam.forward(model, pixels(fam))
    patches = fam.num_patches
    counts = [int(trace.processed[("vision", i)][0, 1:].sum()) for i in range(12)]
    assert counts == [k_of(expected[i], patches) for i in range(12)]
    assert all(b <= a for a, b in zip(counts, counts[1:], strict=False))
    assert counts[0] > counts[-1]


@pytest.mark.parametrize("router", ["random", "stride", "inverted"])
def test_router_kinds_process_the_same_counts(router):
    fam = _family("timm-vit_tiny")
    x = pixels(fam)
    patches = fam.num_patches
    traces = {}
    for kind in ("learned", router):
        model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.25, layers="all", router=kind, seed=3))
        _randomise_routers(model)
        with torch.no_grad(), vlmod.trace_routing(model) as trace:
            out = fam.forward(model, x)
        assert torch.isfinite(out).all()
        traces[kind] = trace
    k = k_of(0.25, patches)
    for i in range(12):
        learned = traces["learned"].processed[("vision", i)]
        other = traces[router].processed[("vision", i)]
        assert other[:, 1:].sum(1).tolist() == [k, k]
        assert other[:, 0].all()
        scores = traces[router].scores[("vision", i)]
        if i == 0:  # same input, same router: same scores
            assert torch.equal(scores, traces["learned"].scores[("vision", 0)])
        if router == "inverted":
            for b in range(2):
                s, p = scores[b, 1:], other[b, 1:]
                assert s[p].max() < s[~p].min()
            if i == 0:
                assert not (learned[:, 1:] & other[:, 1:]).any()
        if router == "stride":
            chosen = other[0, 1:].nonzero().flatten().tolist()
            assert chosen == [math.ceil(j * patches / k) for j in range(k)]
            assert torch.equal(other[0], other[1])


def test_seeded_random_router_is_deterministic():
    fam = _family("timm-vit_tiny")
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.25, layers="all", router="random", seed=0))
    x = pixels(fam)
    with torch.no_grad(), vlmod.trace_routing(model) as t1:
        a = fam.forward(model, x)
    with torch.no_grad(), vlmod.trace_routing(model) as t2:
        b = fam.forward(model, x)
    assert torch.equal(a, b)
    assert all(torch.equal(t1.processed[key], t2.processed[key]) for key in t1.processed)
    # different layers draw different patterns
    assert not all(torch.equal(t1.processed[("vision", 0)], t1.processed[key]) for key in t1.processed)


def test_deepcopy_of_a_converted_model_routes_on_its_own():
    """EMA helpers (timm ModelEmaV3) deep-copy the model: the copy must keep working on its own."""
    fam = _family("timm-vit_tiny")
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.25, layers="all", router="random", seed=0))
    x = pixels(fam)
    with torch.no_grad():
        expected = fam.forward(model, x)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        a = fam.forward(twin, x)
        b = fam.forward(twin, x)
    assert torch.equal(a, b)
    assert torch.equal(a, expected)
    with vlmod.trace_routing(twin) as trace, torch.no_grad():
        fam.forward(twin, x)
    assert len(trace.processed) == 12
    vlmod.remove_mod(twin)
    assert isinstance(model.blocks[0], MoDLayer)
    with torch.no_grad():
        assert torch.equal(fam.forward(model, x), expected)


def test_images_not_routable_run_every_token():
    fam = _family("timm-vit_tiny")
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.25, layers="all", routable=("video",)))
    x = pixels(fam)
    with torch.no_grad(), vlmod.trace_routing(model) as trace:
        got = fam.forward(model, x)
        ref = fam.forward(original(fam), x)
    assert all(p.all() for p in trace.processed.values())
    assert rel_err(got, ref) <= 1e-5


def test_open_clip_text_tower_is_untouched():
    fam = _family("open_clip-ViT-B-32-CLIP")
    ref = original(fam)
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5, layers="all"))
    text = torch.randint(0, 1000, (2, 77))
    with torch.no_grad():
        assert torch.equal(model.encode_text(text), ref.encode_text(text))
    assert not any(isinstance(b, MoDLayer) for b in model.transformer.resblocks)


def test_open_clip_patch_dropout_in_training():
    """open_clip drops patches in training: k follows the tokens that reach the blocks."""
    from open_clip.transformer import PatchDropout

    fam = _family("open_clip-ViT-B-16-visual")
    model = fresh(fam)
    model.patch_dropout = PatchDropout(0.5)
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="all")).train()
    with vlmod.trace_routing(model) as trace:
        out = fam.forward(model, pixels(fam))
    out.pow(2).mean().backward()
    kept = fam.num_patches // 2
    for processed in trace.processed.values():
        assert processed.shape == (2, 1 + kept)
        assert processed[:, 0].all()
        assert processed[:, 1:].sum(1).tolist() == [k_of(0.5, kept)] * 2
    assert model.mod_router.weight.grad.abs().sum() > 0


def test_bfloat16_model():
    fam = _family("timm-vit_tiny")
    ref = fresh(fam).to(torch.bfloat16)
    model = vlmod.apply_mod(copy.deepcopy(ref), vlmod.MoDConfig(capacity=1.0, layers="all"))
    assert model.mod_router.weight.dtype == torch.bfloat16
    x = pixels(fam).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fam.forward(model, x), fam.forward(ref, x))
    routed = vlmod.apply_mod(copy.deepcopy(ref), vlmod.MoDConfig(capacity=0.25, layers="all"))
    _randomise_routers(routed)
    with torch.no_grad(), vlmod.trace_routing(routed) as trace:
        out = fam.forward(routed, x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    k = k_of(0.25, fam.num_patches)
    assert all(p[:, 1:].sum(1).tolist() == [k, k] for p in trace.processed.values())


def test_hf_output_hidden_states_identity_and_shapes():
    fam = _family("hf-clip")
    ref = original(fam)
    x = pixels(fam)
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=1.0, layers="all"))
    with torch.no_grad():
        a = ref(pixel_values=x, output_hidden_states=True)
        b = model(pixel_values=x, output_hidden_states=True)
    assert len(a.hidden_states) == len(b.hidden_states) == 5
    for h_ref, h in zip(a.hidden_states, b.hidden_states, strict=False):
        assert rel_err(h, h_ref) <= 1e-5
    routed = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.25))
    with torch.no_grad():
        c = routed(pixel_values=x, output_hidden_states=True)
    assert [tuple(h.shape) for h in c.hidden_states] == [(2, 17, 32)] * 5


# ---------------------------------------------------------------------------- errors


def test_converting_twice_is_an_error(tower):
    model = vlmod.apply_mod(fresh(tower), vlmod.MoDConfig(capacity=0.5))
    with pytest.raises(ValueError, match="already converted"):
        vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.25, layers="all"))
    # nothing changed by the failed call
    assert vlmod.mod_layers(model) == {("vision", i): 0.5 for i in range(1, tower.num_layers, 2)}


def test_converting_the_visual_tower_of_a_converted_clip_is_an_error():
    fam = _family("open_clip-ViT-B-32-CLIP")
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5))
    with pytest.raises(ValueError, match="already converted"):
        vlmod.apply_mod(model.visual, vlmod.MoDConfig(capacity=0.5))


@pytest.mark.parametrize("capacity", [0.0, 1.5, -1.0, float("nan")])
def test_capacity_out_of_range(capacity):
    with pytest.raises(ValueError, match="capacity"):
        vlmod.apply_mod(fresh(_family("timm-vit_tiny")), vlmod.MoDConfig(capacity=capacity))


@pytest.mark.parametrize("layers", [[12], [-13], [0, 40]])
def test_bad_layer_index_leaves_the_model_untouched(layers):
    fam = _family("timm-vit_tiny")
    model = fresh(fam)
    keys = list(model.state_dict())
    with pytest.raises(ValueError, match="out of range"):
        vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=layers))
    assert not any(isinstance(b, MoDLayer) for b in model.blocks)
    assert list(model.state_dict()) == keys
    assert vlmod.mod_layers(model) == {}
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers=[11]))  # still convertible


def test_config_must_be_a_modconfig():
    with pytest.raises(TypeError, match="MoDConfig"):
        vlmod.apply_mod(fresh(_family("timm-vit_tiny")), {"capacity": 0.5})


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(4, 4),
        lambda: torchvision.models.resnet18(weights=None),
        lambda: timm.create_model("resnet18", pretrained=False),
    ],
    ids=["nn.Linear", "torchvision-resnet18", "timm-resnet18"],
)
def test_unsupported_model_is_a_type_error(make):
    with pytest.raises(TypeError) as err:
        vlmod.apply_mod(make(), vlmod.MoDConfig())
    message = str(err.value)
    for family in ("timm", "open_clip", "CLIPVisionModel", "SiglipVisionModel"):
        assert family in message


@pytest.mark.parametrize("fid", ["timm-vit_tiny", "open_clip-ViT-B-16-visual", "hf-siglip"])
def test_language_part_of_a_vision_model(fid):
    fam = _family(fid)
    model = fresh(fam)
    with pytest.raises(ValueError, match="language"):
        vlmod.apply_mod(model, vlmod.MoDConfig(), part="language")
    assert vlmod.mod_layers(model) == {}
    vlmod.apply_mod(model, vlmod.MoDConfig(), part="vision")
    assert vlmod.mod_layers(model)


def test_trace_routing_needs_a_converted_model():
    with pytest.raises(ValueError, match="apply_mod"):
        with vlmod.trace_routing(nn.Linear(2, 2)):
            pass


def test_trace_is_detached_from_the_model_after_the_block():
    fam = _family("timm-vit_tiny")
    model = vlmod.apply_mod(fresh(fam), vlmod.MoDConfig(capacity=0.5))
    with torch.no_grad(), vlmod.trace_routing(model) as trace:
        fam.forward(model, pixels(fam))
    n = len(trace.steps)
    with torch.no_grad():
        fam.forward(model, pixels(fam))
    assert len(trace.steps) == n == 1
    assert trace.token_types.shape == (2, 17)
    assert trace.token_types[:, 0].tolist() == [int(vlmod.TokenType.PREFIX)] * 2
    assert (trace.token_types[:, 1:] == int(vlmod.TokenType.IMAGE)).all()


# ---------------------------------------------------------------------------- torch.compile


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2).eval()
    vlmod.apply_mod(model, vlmod.MoDConfig(capacity=0.5, layers="all"))
    _randomise_routers(model)
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(model)
    with torch.no_grad():
        eager = model(x)
        got = compiled(x)
        again = compiled(x + 0.1)
        eager_again = model(x + 0.1)
    assert torch.allclose(got, eager, atol=1e-5)
    assert torch.allclose(again, eager_again, atol=1e-5)
