"""Token selection on hand-made tensors: select_tokens, TokenLayout, Selection, router kinds, gates."""

import math

import pytest
import torch

from vlmod import TokenType
from vlmod.routing.router import Router, gate, selection_keys
from vlmod.routing.selection import Selection, TokenLayout, select_tokens

P, IMG, VID, INS, RES, PAD = (
    TokenType.PREFIX,
    TokenType.IMAGE,
    TokenType.VIDEO,
    TokenType.INSTRUCTION,
    TokenType.RESPONSE,
    TokenType.PADDING,
)
ROUTABLE = (TokenType.IMAGE, TokenType.VIDEO)


def _types(rows):
    return torch.tensor([[int(t) for t in row] for row in rows], dtype=torch.long)


# Rows with padding on either side, protected types in between, different routable counts
# (6, 7, 2, 0) and a row without any routable token.
MIXED = _types(
    [
        [P, IMG, IMG, IMG, IMG, IMG, IMG, INS, PAD, PAD, PAD, PAD],
        [INS, IMG, IMG, IMG, VID, VID, RES, INS, INS, IMG, VID, RES],
        [PAD, PAD, PAD, PAD, PAD, INS, IMG, INS, IMG, RES, RES, RES],
        [PAD, PAD, INS, INS, INS, RES, RES, PAD, PAD, PAD, PAD, PAD],
    ]
)


def _ceil_k(capacity, n):
    return math.ceil(round(capacity * n, 9)) if n else 0


def _processed(sel: Selection, layout: TokenLayout) -> torch.Tensor:
    if sel.index is None:
        return torch.ones(layout.shape, dtype=torch.bool)
    return sel.processed_mask()


def _check_selection(sel: Selection, layout: TokenLayout, keys: torch.Tensor, capacity: float):
    """Every property select_tokens promises, checked row by row."""
    batch, length = layout.shape
    processed = _processed(sel, layout)
    padding = layout.token_types == int(PAD)
    for b in range(batch):
        routable = layout.routable[b]
        k = _ceil_k(capacity, int(routable.sum()))
        assert int((processed[b] & routable).sum()) == k, f"row {b}: wrong number of routable tokens"
        assert processed[b][layout.protected[b]].all(), f"row {b}: a protected token was skipped"
        assert not processed[b][padding[b]].any(), f"row {b}: padding was selected"
        chosen = keys[b][routable & processed[b]]
        dropped = keys[b][routable & ~processed[b]]
        if len(chosen) and len(dropped):
            assert chosen.min() > dropped.max(), f"row {b}: not the top-k keys"
    if sel.index is None:
        return processed
    index, valid = sel.index, sel.valid
    assert index.dtype == torch.long and index.shape[0] == batch
    k_slots = index.shape[1]
    need = [int(processed[b].sum()) for b in range(batch)]
    assert k_slots == max(need), "K must be the largest per-row count (static shapes, no waste)"
    for b in range(batch):
        row = index[b]
        assert len(set(row.tolist())) == k_slots, f"row {b}: an index repeats"
        ok = valid[b] if valid is not None else torch.ones(k_slots, dtype=torch.bool)
        real = row[ok]
        assert torch.all(real[1:] > real[:-1]), f"row {b}: processed positions not ascending"
        assert sorted(real.tolist()) == processed[b].nonzero().flatten().tolist()
        # filler slots point at skipped positions and are marked invalid
        assert not processed[b][row[~ok]].any()
        assert int(ok.sum()) == need[b]
    return processed


def _distinct_keys(shape, generator=None):
    batch, length = shape
    return torch.stack([torch.randperm(length, generator=generator).float() for _ in range(batch)]) / length


# ---------------------------------------------------------------------------- general path


@pytest.mark.parametrize("capacity", [1.0, 0.75, 0.5, 0.3, 0.125, 0.01])
def test_general_path_properties(capacity):
    layout = TokenLayout.from_types(MIXED, ROUTABLE, capacities=[capacity])
    assert layout.num_prefix is None
    for _ in range(5):
        keys = _distinct_keys(layout.shape)
        sel = select_tokens(keys, layout, capacity)
        assert sel.valid is None or sel.valid.dtype == torch.bool
        _check_selection(sel, layout, keys, capacity)


def test_general_path_exact_selection():
    types = _types([[INS, IMG, IMG, IMG, IMG, PAD], [PAD, IMG, INS, IMG, IMG, IMG]])
    keys = torch.tensor([[9.0, 0.1, 0.9, 0.5, 0.7, 99.0], [99.0, 0.3, -5.0, 0.2, 0.8, 0.1]])
    layout = TokenLayout.from_types(types, ROUTABLE)
    sel = select_tokens(keys, layout, 0.5)
    # row 0: INS + the two best of 4 images (pos 2, 4); row 1: INS + best 2 of 4 (pos 1, 4)
    assert sel.index.tolist() == [[0, 2, 4], [1, 2, 4]]
    assert sel.valid is None  # both rows process 3 tokens: no filler slots
    assert sel.processed_mask().tolist() == [
        [True, False, True, False, True, False],
        [False, True, True, False, True, False],
    ]


def test_general_path_marks_filler_slots_invalid():
    types = _types([[IMG, IMG, IMG, IMG, IMG, IMG, IMG, IMG], [INS, IMG, IMG, PAD, PAD, PAD, PAD, PAD]])
    keys = _distinct_keys(types.shape)
    layout = TokenLayout.from_types(types, ROUTABLE)
    sel = select_tokens(keys, layout, 0.5)
    # row 0 needs 4 slots, row 1 needs INS + 1 image = 2: two filler slots
    assert sel.index.shape == (2, 4)
    assert sel.valid[0].all()
    assert int(sel.valid[1].sum()) == 2
    filler = sel.index[1][~sel.valid[1]]
    assert all(int(types[1, i]) != int(INS) for i in filler)
    _check_selection(sel, layout, keys, 0.5)


def test_padding_is_never_selected_even_with_the_highest_scores():
    layout = TokenLayout.from_types(MIXED, ROUTABLE)
    keys = _distinct_keys(layout.shape)
    keys[MIXED == int(PAD)] = 1e9
    keys[layout.protected] = -1e9
    for capacity in (1.0, 0.5, 0.1):
        processed = _check_selection(select_tokens(keys, layout, capacity), layout, keys, capacity)
        assert not processed[MIXED == int(PAD)].any()
        assert processed[layout.protected].all()


def test_layout_masks():
    layout = TokenLayout.from_types(MIXED, ROUTABLE)
    is_pad = MIXED == int(PAD)
    is_routable = (MIXED == int(IMG)) | (MIXED == int(VID))
    assert torch.equal(layout.routable, is_routable)
    assert torch.equal(layout.protected, ~is_pad & ~is_routable)
    assert not (layout.routable & layout.protected).any()


def test_routable_types_change_who_competes():
    layout = TokenLayout.from_types(MIXED, (TokenType.IMAGE, TokenType.RESPONSE))
    assert torch.equal(layout.routable, (MIXED == int(IMG)) | (MIXED == int(RES)))
    assert layout.protected[MIXED == int(VID)].all()
    keys = _distinct_keys(layout.shape)
    _check_selection(select_tokens(keys, layout, 0.5), layout, keys, 0.5)


def test_budget_is_k_per_row_and_batch_max():
    layout = TokenLayout.from_types(MIXED, ROUTABLE, capacities=[0.5])
    k, total, uniform, full = layout.budget(0.5)
    assert k.tolist() == [3, 4, 1, 0]
    n_protected = [2, 5, 5, 5]
    assert total == max(a + b for a, b in zip(k.tolist(), n_protected, strict=True))
    assert not uniform and not full
    # a capacity that was not prepared is computed on demand
    k2, total2, _, _ = layout.budget(0.25)
    assert k2.tolist() == [2, 2, 1, 0]
    assert total2 == max(a + b for a, b in zip(k2.tolist(), n_protected, strict=True))


def test_general_path_with_low_precision_keys():
    layout = TokenLayout.from_types(MIXED, ROUTABLE)
    keys = _distinct_keys(layout.shape).to(torch.bfloat16)
    _check_selection(select_tokens(keys, layout, 0.5), layout, keys.float(), 0.5)


# ---------------------------------------------------------------------------- prefix fast path


@pytest.mark.parametrize("num_prefix, length", [(1, 17), (2, 18), (5, 30), (0, 16)])
@pytest.mark.parametrize("capacity", [0.5, 0.25, 0.125, 0.9])
def test_prefix_path_properties(num_prefix, length, capacity):
    layout = TokenLayout.prefix_then_image(3, length, num_prefix, True, torch.device("cpu"))
    assert layout.num_prefix == num_prefix
    keys = _distinct_keys(layout.shape)
    sel = select_tokens(keys, layout, capacity)
    k = _ceil_k(capacity, length - num_prefix)
    assert sel.valid is None
    assert sel.index.shape == (3, num_prefix + k)
    assert torch.equal(sel.index[:, :num_prefix], torch.arange(num_prefix).expand(3, num_prefix))
    _check_selection(sel, layout, keys, capacity)


@pytest.mark.parametrize("capacity", [0.5, 0.2])
def test_prefix_path_agrees_with_general_path(capacity):
    fast = TokenLayout.prefix_then_image(4, 20, 3, True, torch.device("cpu"))
    types = _types([[P] * 3 + [IMG] * 17] * 4)
    general = TokenLayout.from_types(types, ROUTABLE)
    assert torch.equal(fast.routable, general.routable)
    assert torch.equal(fast.protected, general.protected)
    keys = _distinct_keys(fast.shape)
    a = select_tokens(keys, fast, capacity)
    b = select_tokens(keys, general, capacity)
    assert torch.equal(a.processed_mask(), b.processed_mask())
    assert torch.equal(a.index, b.index)


def test_prefix_path_full_capacity_is_a_full_selection():
    layout = TokenLayout.prefix_then_image(2, 17, 1, True, torch.device("cpu"))
    sel = select_tokens(torch.randn(2, 17), layout, 1.0)
    assert sel.index is None and sel.valid is None and sel.length == 17
    x = torch.randn(2, 17, 4)
    assert sel.gather(x) is x
    y = torch.randn(2, 17, 4)
    assert sel.scatter(x, y) is y
    with pytest.raises(RuntimeError):
        sel.processed_mask()


def test_prefix_layout_without_routable_images_processes_everything():
    layout = TokenLayout.prefix_then_image(2, 17, 1, False, torch.device("cpu"))
    assert not layout.routable.any()
    assert layout.protected.all()
    sel = select_tokens(torch.randn(2, 17), layout, 0.25)
    assert sel.index is None


# ---------------------------------------------------------------------------- gather / scatter


@pytest.mark.parametrize("fast", [True, False])
def test_gather_scatter_round_trip(fast):
    if fast:
        layout = TokenLayout.prefix_then_image(3, 12, 2, True, torch.device("cpu"))
    else:
        layout = TokenLayout.from_types(MIXED[:3], ROUTABLE)
    keys = _distinct_keys(layout.shape)
    sel = select_tokens(keys, layout, 0.5)
    x = torch.randn(3, 12, 5)
    g = sel.gather(x)
    assert g.shape == (3, sel.index.shape[1], 5)
    for b in range(3):
        assert torch.equal(g[b], x[b, sel.index[b]])
    assert torch.equal(sel.scatter(x, g), x)
    # writing new values changes exactly the processed positions (filler slots write back their own value)
    valid = sel.valid if sel.valid is not None else torch.ones_like(sel.index, dtype=torch.bool)
    new = torch.where(valid.unsqueeze(-1), g + 1.0, g)
    out = sel.scatter(x, new)
    changed = (out != x).any(-1)
    assert torch.equal(changed, sel.processed_mask())
    assert torch.equal(out[changed], x[changed] + 1.0)
    # scatter returns a copy
    assert not torch.equal(out, x)


def test_gather_scatter_on_2d_and_4d_tensors():
    layout = TokenLayout.from_types(MIXED, ROUTABLE)
    sel = select_tokens(_distinct_keys(layout.shape), layout, 0.5)
    s = torch.randn(4, 12)
    assert torch.equal(sel.scatter(s, sel.gather(s)), s)
    t = torch.randn(4, 12, 2, 3)
    gt = sel.gather(t)
    assert gt.shape == (4, sel.index.shape[1], 2, 3)
    assert torch.equal(sel.scatter(t, gt), t)


def test_gather_keeps_gradients():
    layout = TokenLayout.prefix_then_image(2, 9, 1, True, torch.device("cpu"))
    sel = select_tokens(_distinct_keys(layout.shape), layout, 0.5)
    x = torch.randn(2, 9, 3, requires_grad=True)
    sel.gather(x).sum().backward()
    assert torch.equal(x.grad[..., 0] != 0, sel.processed_mask())


# ---------------------------------------------------------------------------- router kinds


def _layouts():
    return [
        TokenLayout.from_types(MIXED, ROUTABLE),
        TokenLayout.prefix_then_image(3, 21, 1, True, torch.device("cpu")),
    ]


@pytest.mark.parametrize("layout", _layouts(), ids=["general", "prefix"])
def test_learned_keys_are_the_scores(layout):
    scores = torch.randn(layout.shape)
    assert torch.equal(selection_keys("learned", scores, layout, 0.5, None), scores)


@pytest.mark.parametrize("layout", _layouts(), ids=["general", "prefix"])
@pytest.mark.parametrize("capacity", [0.5, 0.25])
def test_inverted_selects_the_lowest_scores(layout, capacity):
    scores = _distinct_keys(layout.shape)
    keys = selection_keys("inverted", scores, layout, capacity, None)
    sel = select_tokens(keys, layout, capacity)
    processed = _check_selection(sel, layout, keys, capacity)
    learned = _processed(select_tokens(scores, layout, capacity), layout)
    for b in range(layout.shape[0]):
        routable = layout.routable[b]
        chosen = scores[b][routable & processed[b]]
        dropped = scores[b][routable & ~processed[b]]
        if len(chosen) and len(dropped):
            assert chosen.max() < dropped.min()
        # the inverted and the learned choice overlap only where 2k > n forces it
        n = int(routable.sum())
        k = _ceil_k(capacity, n)
        assert int((processed[b] & learned[b] & routable).sum()) == max(0, 2 * k - n)


@pytest.mark.parametrize("layout", _layouts(), ids=["general", "prefix"])
@pytest.mark.parametrize("capacity", [0.5, 0.3, 0.25, 0.125, 1.0])
def test_stride_picks_k_evenly_spaced_tokens(layout, capacity):
    processed_runs = []
    for _ in range(2):  # independent of the scores
        scores = torch.randn(layout.shape)
        keys = selection_keys("stride", scores, layout, capacity, None)
        sel = select_tokens(keys, layout, capacity)
        processed = _processed(sel, layout)
        processed_runs.append(processed)
        for b in range(layout.shape[0]):
            routable_pos = layout.routable[b].nonzero().flatten()
            n = len(routable_pos)
            k = _ceil_k(capacity, n)
            chosen = [j for j, pos in enumerate(routable_pos.tolist()) if processed[b, pos]]
            assert len(chosen) == k
            assert chosen == [math.ceil(i * n / k) for i in range(k)]
            assert processed[b][layout.protected[b]].all()
    assert torch.equal(processed_runs[0], processed_runs[1])


def test_stride_spacing_example():
    layout = TokenLayout.prefix_then_image(1, 17, 1, True, torch.device("cpu"))
    keys = selection_keys("stride", torch.randn(1, 17), layout, 0.25, None)
    sel = select_tokens(keys, layout, 0.25)
    assert sel.index.tolist() == [[0, 1, 5, 9, 13]]


@pytest.mark.parametrize("layout", _layouts(), ids=["general", "prefix"])
def test_random_picks_k_tokens(layout):
    scores = torch.zeros(layout.shape)
    seen = torch.zeros(layout.shape, dtype=torch.bool)
    for _ in range(40):
        keys = selection_keys("random", scores, layout, 0.25, None)
        assert keys.shape == scores.shape
        processed = _check_selection(select_tokens(keys, layout, 0.25), layout, keys, 0.25)
        seen |= processed
    # over many draws every routable token gets its turn: the choice is not a fixed pattern
    assert seen[layout.routable].all()


def test_random_keys_follow_the_generator():
    layout = TokenLayout.prefix_then_image(2, 33, 1, True, torch.device("cpu"))
    scores = torch.zeros(layout.shape)
    g1 = torch.Generator().manual_seed(3)
    g2 = torch.Generator().manual_seed(3)
    a = selection_keys("random", scores, layout, 0.5, g1)
    b = selection_keys("random", scores, layout, 0.5, g2)
    assert torch.equal(a, b)
    c = selection_keys("random", scores, layout, 0.5, g1)
    assert not torch.equal(a, c)


def test_unknown_router_kind():
    layout = _layouts()[1]
    with pytest.raises(ValueError, match="router"):
        selection_keys("attention-ish", torch.zeros(layout.shape), layout, 0.5, None)


# ---------------------------------------------------------------------------- gate and router module


@pytest.mark.parametrize("kind", ["tanh", "sigmoid"])
def test_gate_is_one_at_zero(kind):
    g = gate(torch.zeros(2, 5), kind, 0.2)
    assert torch.equal(g, torch.ones(2, 5))


def test_gate_values():
    r = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0])
    assert torch.allclose(gate(r, "tanh", 0.2), 1 + 0.2 * torch.tanh(r))
    assert torch.allclose(gate(r, "tanh", 0.5), 1 + 0.5 * torch.tanh(r))
    assert torch.allclose(gate(r, "sigmoid", 0.2), 2 * torch.sigmoid(r))
    assert gate(r, "none", 0.2) is None
    with pytest.raises(ValueError):
        gate(r, "relu", 0.2)


@pytest.mark.parametrize("kind, slope", [("tanh", 0.2), ("sigmoid", 0.5)])
def test_gate_has_a_gradient_at_zero(kind, slope):
    r = torch.zeros(3, requires_grad=True)
    gate(r, kind, 0.2).sum().backward()
    assert torch.allclose(r.grad, torch.full((3,), slope))


def test_router_is_zero_initialised_linear():
    router = Router(8)
    assert router.weight.shape == (1, 8) and router.bias.shape == (1,)
    assert not router.weight.any() and not router.bias.any()
    out = router(torch.randn(2, 5, 8))
    assert out.shape == (2, 5)
    assert not out.any()
    # scores come out in the router's dtype
    assert router(torch.randn(2, 5, 8, dtype=torch.bfloat16)).dtype == torch.float32
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(2, 5, 8)
    assert torch.allclose(router(x), x @ router.weight[0] + router.bias)


def test_router_reads_its_weights_through_the_parameter_getter():
    """Before: `Router.logits` (called by every MoD layer without a module call) read its weights
    with `self._parameters.get(...)`, which bypasses the `__getitem__` DeepSpeed ZeRO-3 replaces
    `_parameters` with to gather a partitioned parameter in the running layer's forward: the layer
    multiplied by an empty shard ("size mismatch ... vec (0)"). Now it indexes `_parameters`, and a
    parameter of that kind (`ds_id`) is never served from the float32 copy kept for inference."""

    class Gathering(dict):  # DeepSpeed's ZeROOrderedDict, in miniature: the getter fills the value
        def __getitem__(self, key):
            param = super().__getitem__(key)
            if param.numel() == 0:
                param.data = full[key]
            return param

    router = Router(8).to(torch.bfloat16)
    full = {"weight": torch.randn(1, 8).to(torch.bfloat16), "bias": torch.randn(1).to(torch.bfloat16)}
    params = Gathering(weight=router.weight, bias=router.bias)
    for p in params.values():
        p.data = torch.empty(0, dtype=torch.bfloat16)  # partitioned: this process's empty shard
        p.ds_id = 0
    router._parameters = params
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        want = x @ full["weight"].float()[0] + full["bias"].float()
        assert torch.allclose(router(x), want)
        full["weight"] = torch.randn(1, 8).to(torch.bfloat16)  # an optimizer step on the shards
        for p in params.values():
            p.data = torch.empty(0, dtype=torch.bfloat16)  # released after the forward
        assert torch.allclose(router(x), x @ full["weight"].float()[0] + full["bias"].float())
