"""MoDConfig validation and the capacity arithmetic of vlmod.routing.schedule."""

import json
import math

import pytest
import torch

from vlmod import MoDConfig, TokenType
from vlmod.routing.schedule import capacity_to_k, capacity_to_k_tensor, layer_capacities

# ---------------------------------------------------------------------------- capacity


@pytest.mark.parametrize("capacity", [0, 0.0, -0.5, 1.5, 1.0000001, float("nan"), float("inf")])
def test_capacity_out_of_range_is_rejected(capacity):
    with pytest.raises(ValueError, match="capacity"):
        MoDConfig(capacity=capacity)


@pytest.mark.parametrize("capacity", [True, False, "0.5", None, [0.5]])
def test_capacity_must_be_a_real_number(capacity):
    with pytest.raises(ValueError, match="capacity"):
        MoDConfig(capacity=capacity)


@pytest.mark.parametrize("capacity", [1, 1.0, 0.5, 1e-6])
def test_valid_capacity_is_stored_as_float(capacity):
    cfg = MoDConfig(capacity=capacity)
    assert isinstance(cfg.capacity, float)
    assert cfg.capacity == float(capacity)


def test_capacity_error_message_names_the_range():
    with pytest.raises(ValueError) as err:
        MoDConfig(capacity=1.5)
    assert "(0, 1]" in str(err.value)
    assert "1.5" in str(err.value)


# ---------------------------------------------------------------------------- layers


def test_default_layers_are_every_other():
    cfg = MoDConfig()
    assert cfg.layers == "every_other"
    assert cfg.resolve_layers(12) == [1, 3, 5, 7, 9, 11]
    assert cfg.resolve_layers(5) == [1, 3]


def test_layers_all():
    assert MoDConfig(layers="all").resolve_layers(4) == [0, 1, 2, 3]


def test_every_other_on_a_single_layer_part_is_an_error():
    with pytest.raises(ValueError, match="every_other"):
        MoDConfig(layers="every_other").resolve_layers(1)


@pytest.mark.parametrize("layers", ["some", "odd", "ALL", ""])
def test_unknown_layer_preset(layers):
    with pytest.raises(ValueError, match="layers"):
        MoDConfig(layers=layers)


def test_layer_list_is_sorted_and_copied():
    given = (5, 1, 3)
    cfg = MoDConfig(layers=given)
    assert cfg.layers == [1, 3, 5]
    assert cfg.resolve_layers(6) == [1, 3, 5]


def test_empty_layer_list():
    with pytest.raises(ValueError, match="empty"):
        MoDConfig(layers=[])


def test_duplicate_layer_indices():
    with pytest.raises(ValueError, match="repeat"):
        MoDConfig(layers=[1, 2, 1])


@pytest.mark.parametrize("layers", [[1, "2"], [1.0], [True, 2], [None]])
def test_non_integer_layer_indices(layers):
    with pytest.raises(ValueError, match="integers"):
        MoDConfig(layers=layers)


def test_negative_layer_indices_count_from_the_end():
    cfg = MoDConfig(layers=[-1, 0, -3])
    assert cfg.resolve_layers(12) == [0, 9, 11]
    assert cfg.resolve_layers(4) == [0, 1, 3]


@pytest.mark.parametrize("layers, num_layers", [([12], 12), ([-13], 12), ([0, 4], 4), ([100], 2)])
def test_layer_index_out_of_range(layers, num_layers):
    cfg = MoDConfig(layers=layers)
    with pytest.raises(ValueError, match="out of range") as err:
        cfg.resolve_layers(num_layers)
    assert str(num_layers) in str(err.value)


def test_negative_and_positive_index_naming_the_same_layer():
    cfg = MoDConfig(layers=[-1, 3])
    with pytest.raises(ValueError, match="same layer"):
        cfg.resolve_layers(4)
    assert cfg.resolve_layers(5) == [3, 4]


# ---------------------------------------------------------------------------- routable


def test_default_routable():
    cfg = MoDConfig()
    assert cfg.routable == ("image", "video")
    assert cfg.routable_types == (TokenType.IMAGE, TokenType.VIDEO)


@pytest.mark.parametrize(
    "given, expected",
    [
        ("image", ("image",)),
        (("IMAGE", "Video"), ("image", "video")),
        ([TokenType.RESPONSE, "image"], ("response", "image")),
        ((4,), ("image",)),
    ],
)
def test_routable_parsing(given, expected):
    assert MoDConfig(routable=given).routable == expected


@pytest.mark.parametrize("given", ["padding", ("image", "padding"), (TokenType.PADDING,), (0,)])
def test_padding_is_never_routable(given):
    with pytest.raises(ValueError, match="padding"):
        MoDConfig(routable=given)


def test_unknown_token_type_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown token type") as err:
        MoDConfig(routable=("pixels",))
    assert "image" in str(err.value) and "instruction" in str(err.value)


# ---------------------------------------------------------------------------- enums


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"router": "topk"}, "router"),
        ({"router": "Learned"}, "router"),
        ({"gate": "relu"}, "gate"),
        ({"gate": None}, "gate"),
        ({"capacity_schedule": "linear"}, "capacity_schedule"),
        ({"capacity_schedule": "none"}, "capacity_schedule"),
        ({"aux_loss": "mse"}, "aux_loss"),
    ],
)
def test_unknown_choices_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MoDConfig(**kwargs)


@pytest.mark.parametrize("router", ["learned", "random", "stride", "inverted"])
@pytest.mark.parametrize("gate", ["tanh", "sigmoid", "none"])
def test_known_choices_are_accepted(router, gate):
    cfg = MoDConfig(router=router, gate=gate, capacity_schedule="cosine", aux_loss="bce")
    assert (cfg.router, cfg.gate, cfg.capacity_schedule, cfg.aux_loss) == (router, gate, "cosine", "bce")


# ---------------------------------------------------------------------------- serialisation


@pytest.mark.parametrize(
    "cfg",
    [
        MoDConfig(),
        MoDConfig(
            capacity=0.25,
            layers=[3, -1, 0],
            routable=("image", "response"),
            router="stride",
            share_router=False,
            gate="sigmoid",
            gate_alpha=0.5,
            capacity_schedule="cosine",
            aux_loss="bce",
            seed=7,
        ),
    ],
)
def test_to_dict_from_dict_round_trip(cfg):
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d  # plain JSON types only
    again = MoDConfig.from_dict(json.loads(json.dumps(d)))
    assert again == cfg
    assert again.to_dict() == d


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown MoDConfig fields"):
        MoDConfig.from_dict({"capacity": 0.5, "capactiy": 0.3})


def test_from_dict_validates():
    with pytest.raises(ValueError, match="capacity"):
        MoDConfig.from_dict({"capacity": 2.0})


# ---------------------------------------------------------------------------- capacity_to_k


@pytest.mark.parametrize(
    "capacity, n, k",
    [
        (0.1, 30, 3),
        (0.07, 100, 7),  # 0.07 * 100 = 7.000000000000001 in floats
        (0.14, 50, 7),  # 7.000000000000001
        (0.28, 25, 7),  # 7.000000000000001
        (0.55, 100, 55),  # 55.00000000000001
        (0.125, 196, 25),  # 24.5 -> 25
        (0.5, 196, 98),
        (0.25, 49, 13),
        (0.125, 16, 2),
        (1.0, 7, 7),
        (0.3, 10, 3),
        (0.7, 10, 7),
        (1e-6, 5, 1),  # at least one slot when something is routable
        (0.5, 0, 0),
        (1.0, 0, 0),
    ],
)
def test_capacity_to_k(capacity, n, k):
    assert capacity_to_k(capacity, n) == k
    assert capacity_to_k_tensor(capacity, torch.tensor([n, n])).tolist() == [k, k]


def test_capacity_to_k_is_ceil_for_many_values():
    for n in range(0, 700, 5):
        for c in (0.05, 0.07, 0.1, 0.14, 0.2, 0.25, 0.28, 0.3, 0.5, 0.55, 0.6, 0.75, 0.9, 1.0):
            # round away the float noise of c * n, then ceil
            assert capacity_to_k(c, n) == math.ceil(round(c * n, 9)), (c, n)


# ---------------------------------------------------------------------------- layer_capacities


def test_no_schedule_is_constant():
    caps = layer_capacities(0.3, [1, 3, 5], 6, None)
    assert caps == {1: 0.3, 3: 0.3, 5: 0.3}


def test_unknown_schedule_raises():
    with pytest.raises(ValueError, match="schedule"):
        layer_capacities(0.3, [1, 3, 5], 6, "linear")


def _mean_weight(layers, num_layers):
    w = [(1 + math.cos(math.pi * (i + 1) / (num_layers + 1))) / 2 for i in layers]
    return sum(w) / len(w)


@pytest.mark.parametrize(
    "layers, num_layers",
    [(list(range(12)), 12), (list(range(1, 24, 2)), 24), ([0, 5, 6, 31], 32), ([2, 3], 4)],
)
@pytest.mark.parametrize("capacity", [0.05, 0.125, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.99])
def test_cosine_schedule(layers, num_layers, capacity):
    caps = layer_capacities(capacity, layers, num_layers, "cosine")
    assert sorted(caps) == sorted(layers)
    values = [caps[i] for i in sorted(layers)]
    # the mean over the converted layers is the configured capacity
    assert sum(values) / len(values) == pytest.approx(capacity, rel=1e-9, abs=1e-12)
    # deeper layers keep fewer tokens, strictly so when the layers differ
    for a, b in zip(values, values[1:], strict=False):
        assert b < a
    assert all(0.0 < v <= 1.0 for v in values)


def test_cosine_schedule_covers_both_branches():
    layers = list(range(12))
    mean_w = _mean_weight(layers, 12)
    above, below = mean_w + 0.2, mean_w - 0.2
    for capacity in (above, below):
        caps = layer_capacities(capacity, layers, 12, "cosine")
        assert sum(caps.values()) / 12 == pytest.approx(capacity, rel=1e-9)
    # above the mean weight the shallowest layer gets close to 1, below it the ratios follow w
    caps_below = layer_capacities(below, layers, 12, "cosine")
    w = [(1 + math.cos(math.pi * (i + 1) / 13)) / 2 for i in layers]
    for i in layers:
        assert caps_below[i] / caps_below[0] == pytest.approx(w[i] / w[0], rel=1e-9)
    caps_above = layer_capacities(above, layers, 12, "cosine")
    c_end = (above - mean_w) / (1 - mean_w)
    for i in layers:
        assert caps_above[i] == pytest.approx(c_end + (1 - c_end) * w[i], rel=1e-9)


def test_cosine_schedule_single_layer_is_constant():
    assert layer_capacities(0.4, [3], 8, "cosine") == {3: 0.4}


def test_cosine_schedule_full_capacity_stays_full():
    caps = layer_capacities(1.0, list(range(6)), 6, "cosine")
    assert all(v == pytest.approx(1.0) for v in caps.values())


def test_an_error_echoes_a_huge_value_briefly() -> None:
    """A bad value echoed in an error stays one short line however large it is (a config file's
    YAML aliases can stand for billions of items); small values read as repr gives them."""
    nested = [[list(range(1000))] * 1000] * 1000  # shared lists: a billion items, little memory
    with pytest.raises(ValueError) as err:
        MoDConfig(capacity=nested)
    assert len(str(err.value)) < 200
    with pytest.raises(ValueError, match=r"got 'half'"):
        MoDConfig(capacity="half")
