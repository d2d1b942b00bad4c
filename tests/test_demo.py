"""The demo runs end to end on the real path (clipping -> sampler -> noise -> SGD) for every
method, over several seeds, and reports privacy values that meet its budget."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow   # the module's run: every method, two seeds (about 20-35 s)

pytest.importorskip("sklearn")
pytest.importorskip("tqdm")

from opake.demo import DemoSettings, conclusion, run_demo  # noqa: E402


@pytest.fixture(scope="module")
def small_run():
    settings = DemoSettings(epsilon=2.0, epochs=2, learning_rates=(0.3,), seeds=(0, 1))
    return settings, run_demo(settings, progress_bar=False)


def test_every_method_runs_and_the_private_ones_meet_the_budget(small_run):
    settings, (participation, results) = small_run
    assert participation.n_steps == 60 and participation.min_sep == 30
    assert participation.max_participations == 2
    bands = int(results[2].method.removeprefix("BandMF-"))   # opake.plan.cyclic_poisson_bands: a power of two
    assert bands & (bands - 1) == 0
    assert [r.method for r in results] == ["BLT", "BLT amplified", f"BandMF-{bands}", "DP-SGD", "DP-SGD, bins",
                                           "non-private"]
    assert [r.sampling for r in results] == [
        "balls in bins, unamplified (rigorous)", "balls in bins, amplified (aligned pair: not proven for adaptive "
        "gradients)", f"cyclic Poisson, {bands} groups (PLD)", "Poisson (PLD), as Opacus",
        "balls in bins (random-allocation PLD)", "balls-in-bins batches"]
    for r in results[:5]:
        assert 1.9 < r.epsilon <= 2.0 and r.noise_multiplier > 0
    assert results[5].epsilon is None and results[5].noise_multiplier is None
    # the amplified bound is capped by the unamplified one: never more noise
    assert results[1].noise_multiplier <= results[0].noise_multiplier
    for r in results:
        assert r.seeds == (0, 1) and len(r.test_accuracies) == 2 and r.learning_rate == 0.3
        assert all(0.0 <= a <= 1.0 for a in r.test_accuracies + r.validation_accuracies)
    # non-private training on digits learns something even in 60 steps
    assert min(results[5].test_accuracies) > 0.5


def test_seeds_change_the_runs(small_run):
    _, (_, results) = small_run
    for r in results[:5]:  # initialization, batches and noise differ between seeds 0 and 1
        assert (r.validation_accuracies[0], r.test_accuracies[0]) != (r.validation_accuracies[1], r.test_accuracies[1])


def test_the_conclusion_names_the_winner_and_compares_the_gap_with_the_spread(small_run):
    settings, (_, results) = small_run
    text = conclusion(results, settings)
    best = max(results[:5], key=lambda r: r.test_accuracy)
    assert f"the best private method against the runner-up: {best.method} ({best.sampling}) " \
           f"{best.test_accuracy:.3f} +- {best.test_std:.3f} vs " in text
    assert "BLT against the DP-SGD Opacus users run: BLT (balls in bins, unamplified (rigorous))" in text
    assert text.count("spread over seeds") + text.count("standard deviation over seeds") == 2
    assert "correlated noise gains at larger epsilon" in text and "Poisson DP-SGD at small epsilon over many epochs" in text
