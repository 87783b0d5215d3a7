"""Loss spikes after warm-up: found, placed, and said in the recipe's cost table (issue 59, item 3)."""

from __future__ import annotations

import pytest

from vlmod.recipes.cost import format_costs
from vlmod.training.stability import describe_spikes, loss_spikes, warmup_steps


def _history(losses: list[float], every: int = 25) -> list[dict]:
    return [{"step": every * (i + 1), "loss": loss, "lr": 1e-3} for i, loss in enumerate(losses)]


FALLING = [4.1, 2.1, 1.3, 0.9, 0.7, 0.6, 0.55, 0.5, 0.48, 0.45, 0.44, 0.42, 0.4, 0.39, 0.38, 0.37]


def test_a_falling_loss_has_no_spike_and_a_jump_after_warm_up_is_one():
    assert loss_spikes(_history(FALLING), warmup=50) == []
    spiked = FALLING[:12] + [1.2, 0.41, 0.39]
    found = loss_spikes(_history(spiked), warmup=50)
    assert [s["step"] for s in found] == [325]
    # The running median: of the last 8 losses after warm-up, 0.7 ... 0.42.
    assert found[0]["median"] == pytest.approx(0.49) and found[0]["ratio"] == pytest.approx(1.2 / 0.49)
    # The same jump inside the warm-up is not judged, nor one before enough losses to judge by.
    assert loss_spikes(_history(spiked), warmup=325) == []
    assert loss_spikes(_history([0.5, 0.4, 1.2, 0.4]), warmup=0) == []


def test_near_zero_noise_is_not_a_spike():
    """The image stage's last logs: 0.0053 after a median of 0.0026 is 2x, and noise."""
    assert loss_spikes(_history([0.004, 0.002, 0.003, 0.003, 0.0026, 0.0025, 0.0053]), warmup=0) == []


def test_warm_up_is_the_longer_of_the_two_and_follows_the_run_length():
    assert warmup_steps({"warmup": 0.05, "capacity_warmup": 0.0, "max_steps": 2000}, 2000) == 100
    assert warmup_steps({"warmup": 0.05, "capacity_warmup": 0.2, "max_steps": 2000}, 2000) == 400
    assert warmup_steps({"warmup": 30, "capacity_warmup": 0.0, "max_steps": None}, 900) == 30
    assert warmup_steps({"warmup": 0.1, "max_steps": None}, 900) == 90  # an epoch-based run: its last step


def test_the_cost_table_says_which_stage_spiked():
    cost = {"steps": 375, "step_ms_median": 250.0, "step_ms_spread": [240.0, 260.0], "tokens_per_second": 1e4,
            "training_flops": 1e12, "training_flops_per_step": 1e9, "dense_flops": 2e12, "mod": True}
    spikes = loss_spikes(_history(FALLING[:12] + [1.2]), warmup=50)
    lines = format_costs({"train dense": {**cost, "mod": False, "loss_spikes": []},
                          "MoD fine-tune": {**cost, "loss_spikes": spikes}})
    assert lines[-1] == "- " + describe_spikes(spikes, "the MoD fine-tune stage")
    assert lines[-1].startswith("- warning: the MoD fine-tune stage: the loss rose to 1.2 at step 325, 2.4x the running "
                                "median 0.49 after warm-up")
    quiet = format_costs({"train dense": {**cost, "loss_spikes": []}})
    assert quiet[-1] == "No stage's logged loss rose above 2x its running median after warm-up."
    assert format_costs({"train dense": {**cost}})[-1].startswith("| train dense |")  # a log from before: no line
