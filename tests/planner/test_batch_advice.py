"""opake.planner.batch_advice: the chosen mechanism at other batch sizes and epochs.

Every setting's noise multiplier is checked on an accountant built here from the setting's own
numbers (it meets the budget, 1% less misses: the control), the requested setting reproduces the
choice's own error, and the advice is the setting with the least noise per example processed.
"""

from __future__ import annotations

import json

import pytest

from opake.cli import main
from opake.dpftrl.accounting import balls_in_bins, mf_gaussian, poisson
from opake.planner import choose_mechanism

DELTA = 1e-5


@pytest.fixture(scope="module")
def blt_choice():
    choice = choose_mechanism(num_examples=2000, batch_size=50, epochs=2, target_epsilon=8.0, target_delta=DELTA,
                              progress=False)
    assert choice.chosen.name == "BLT"
    return choice


def test_every_blt_setting_meets_the_budget_and_the_advice_is_the_least_noise_per_example(blt_choice):
    advice = blt_choice.batch_advice(2000)
    assert {(s.batch_size, s.epochs) for s in advice.settings} >= {(25, 2), (50, 1), (50, 2), (100, 4), (200, 2)}
    strategy = blt_choice.strategy
    for setting in advice.settings:
        bins = 2000 // setting.batch_size
        assert setting.n_steps == setting.epochs * bins
        bound = lambda sigma: balls_in_bins(mf_gaussian(sigma, strategy), bins, setting.n_steps,  # noqa: E731
                                            method="rigorous").epsilon_at(DELTA)
        assert bound(setting.noise_multiplier) <= 8.0 < bound(0.99 * setting.noise_multiplier)
        assert setting.noise_per_example == setting.error / (setting.batch_size * setting.n_steps)
    assert advice.current.batch_size == 50 and advice.current.epochs == 2
    assert advice.current.noise_multiplier == pytest.approx(blt_choice.noise_multiplier, rel=1e-12)
    assert advice.current.error == pytest.approx(blt_choice.chosen.error, rel=1e-12)
    assert advice.best.noise_per_example == min(s.noise_per_example for s in advice.settings)
    assert "<- least" in advice.table() and "<- requested" in advice.table()


def test_a_poisson_choice_keeps_its_band_count_and_is_priced_by_band23():
    choice = choose_mechanism(num_examples=1200, batch_size=40, epochs=6, target_epsilon=3.0, target_delta=DELTA,
                              progress=False, max_state_rows=3)
    assert choice.sampling == "poisson"
    bands = int(getattr(choice.strategy, "bands", 1))
    advice = choice.batch_advice(1200)
    for setting in advice.settings:
        rate = setting.batch_size * bands / 1200
        epsilon = poisson(mf_gaussian(setting.noise_multiplier, choice.strategy), rate, setting.n_steps,
                          value_discretization_interval=1e-2).epsilon_at(DELTA)
        assert epsilon <= 3.0 * (1 + 1e-9)


def test_the_command_prints_the_advice_when_asked(capsys):
    assert main(["plan", "--json", "--batch-advice", "--num-examples", "2000", "--batch-size", "50", "--epochs", "2",
                 "--epsilon", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    settings = report["batch_advice"]["settings"]
    best = min(settings, key=lambda s: s["noise_per_example"])
    assert report["batch_advice"]["best"] == {"batch_size": best["batch_size"], "epochs": best["epochs"]}
