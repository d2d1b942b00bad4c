"""Planning from a data set: the bands rule, the choice's rows, and ``opake plan --num-examples``.

The references are independent of the planner: dp_accounting's PLD accountant called directly
(Poisson DP-SGD and cyclic Poisson BandMF, Band23 Thm 4), the random-allocation PLD evaluated at
the bound the choice ruled DP-SGD on bins out with, and the prefix-sum error of a dense C^{-1}
(numpy solve).
"""

from __future__ import annotations

import functools
import json
import math
import re
import warnings

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant

import opake.cli
import opake.planner
from opake.accounting import calibrate, epsilon_budget
from opake.cli import main
from opake.dpftrl.accounting import balls_in_bins, mf_gaussian, poisson
from opake.dpftrl.noise import band_mf_strategy, identity_strategy
from opake.planner import cyclic_poisson_bands, plan_dataset
from opake.planner.constants import PLD_DISCRETIZATION

# 600 examples, 30 per step: 20 steps per epoch, 4 epochs, n_steps = 80, q = 0.05.
NUM_EXAMPLES, BATCH_SIZE, EPOCHS, EPSILON, DELTA = 600, 30, 4, 3.0, 1e-5
N_STEPS = EPOCHS * (NUM_EXAMPLES // BATCH_SIZE)
NAMES = ["DP-SGD Poisson", "BandMF", "BLT", "DP-SGD bins", "BLT amplified"]
PLAN_GRID = 1e-4  # poisson()'s default grid, on which make_private prices: the chosen row's


@functools.lru_cache(maxsize=None)
def _cached_plan(*args, **kwargs):
    return plan_dataset(*args, **kwargs)


@pytest.fixture(scope="module")
def plan():
    return _cached_plan(NUM_EXAMPLES, BATCH_SIZE, EPOCHS, EPSILON, DELTA, max_buffers=10, error="max")


@functools.lru_cache(maxsize=None)
def _chosen_bands():
    return cyclic_poisson_bands(NUM_EXAMPLES, BATCH_SIZE, EPOCHS, EPSILON, DELTA)


@pytest.fixture
def cli_shares_the_plan(monkeypatch):
    """The CLI tests plan the same run as the fixture; compute it once."""
    monkeypatch.setattr(opake.planner, "plan_dataset", _cached_plan)  # the CLI imports it when it plans


def _pld_epsilon(sample_rate, noise_multiplier, count, delta=DELTA, interval=1e-4):
    accountant = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                               value_discretization_interval=interval)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), count))
    return accountant.get_epsilon(delta)


def _dense_prefix_errors(coefs, n):
    """e_t = ||row t of A C^{-1}||^2, A the prefix-sum matrix, C banded Toeplitz (dense)."""
    c = np.zeros((n, n))
    for lag, value in enumerate(coefs):
        c += np.diag(np.full(n - lag, value), -lag)
    workload = np.tril(np.ones((n, n)))
    return np.sum(np.linalg.solve(c.T, workload.T).T ** 2, axis=1)


@functools.lru_cache(maxsize=None)
def _candidate_rmse(bands):
    """The bands rule for one candidate, recomputed from the public accounting API."""
    q = BATCH_SIZE * bands / NUM_EXAMPLES
    strategy = identity_strategy() if bands == 1 else band_mf_strategy(bands=bands)
    result = calibrate(
        epsilon_budget(EPSILON, DELTA),
        lambda sigma: poisson(mf_gaussian(sigma, strategy), q, N_STEPS, value_discretization_interval=1e-3),
        0.5, 20.0, rtol=1e-4,
    )
    coefs = [1.0] if bands == 1 else result.process.mechanism.coefs
    return result.param * math.sqrt(np.max(_dense_prefix_errors(coefs, N_STEPS)))


def test_cyclic_poisson_bands_picks_the_smallest_error_candidate():
    bands = _chosen_bands()
    assert bands in (1, 2, 4, 8)  # powers of 2 up to num_bins // 2 = 10
    neighbour = 2 if bands != 2 else 4
    assert _candidate_rmse(bands) < _candidate_rmse(neighbour)


def test_the_chosen_bands_have_the_smallest_error_of_every_candidate():
    # The search stops once the error rises; here it must agree with trying every candidate
    # (powers of 2 up to num_bins // 2 = 10), each recomputed from the public accounting API.
    errors = {bands: _candidate_rmse(bands) for bands in (1, 2, 4, 8)}
    assert errors[_chosen_bands()] == min(errors.values())


@pytest.mark.filterwarnings("ignore::opake.dpftrl.accounting.UnprovenAmplificationWarning")  # the reference's own
def test_blt_amplified_agrees_with_the_slow_search_within_its_tolerance(plan):
    # plan_dataset calibrates the amplified bound from the unamplified sigma in a few evaluations
    # (calibrate_capped); calibrate over the whole range at rtol 1e-6 is the slow reference.
    rows = {r.name: r for r in plan.rows}
    strategy, bins = rows["BLT amplified"].strategy, NUM_EXAMPLES // BATCH_SIZE

    def amplified(sigma):
        return balls_in_bins(mf_gaussian(sigma, strategy), bins, N_STEPS, method="amplified")

    slow = calibrate(epsilon_budget(EPSILON, DELTA), amplified, 1e-3, rows["BLT"].noise_multiplier, rtol=1e-6)
    fast = rows["BLT amplified"].noise_multiplier
    assert amplified(fast).epsilon_at(DELTA) <= EPSILON
    assert slow.param / (1 + 1e-6) <= fast <= slow.param * (1 + 2e-3)


def test_a_plan_prints_no_warning():
    # the amplified row states itself that its bound is not proven for adaptive gradients, so
    # plan_dataset does not repeat balls_in_bins's warning; nothing else may warn either (numpy
    # RuntimeWarnings included). A run of its own, so that nothing is cached from the fixture.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_dataset(400, 20, 3, 5.0, 1e-6, max_buffers=4, progress=False)
    assert [str(w.message) for w in caught] == []
    assert "not proven for adaptively chosen gradients" in plan.rows[-1].accounting


def test_cyclic_poisson_bands_refuses_bad_input():
    with pytest.raises(ValueError, match="batch_size .* must be <= num_examples"):
        cyclic_poisson_bands(30, 60, 2, EPSILON, DELTA)
    with pytest.raises(ValueError, match="error must be one of"):
        cyclic_poisson_bands(NUM_EXAMPLES, BATCH_SIZE, EPOCHS, EPSILON, DELTA, error="median")


def test_every_calibrated_row_meets_the_budget_and_one_row_is_make_privates(plan):
    assert [r.name for r in plan.rows] == NAMES
    assert [r.chosen for r in plan.rows].count(True) == 1
    chosen = next(r for r in plan.rows if r.chosen)
    assert chosen.name == {"DP-SGD, Poisson": "DP-SGD Poisson", "BLT": "BLT"}.get(plan.choice.chosen.name, "BandMF")
    assert chosen.noise_multiplier == plan.choice.noise_multiplier and chosen.epsilon == plan.choice.epsilon
    proven = [r for r in plan.rows if r.name != "BLT amplified"]
    assert chosen.rmse_max == min(r.rmse_max for r in proven)  # prefix sums: the choice's error is rmse_max
    for row in plan.rows:
        if not row.calibrated:
            continue
        assert EPSILON * (1 - 1e-3) < row.epsilon <= EPSILON, row.name
        assert row.delta <= DELTA
        assert row.sampling and row.accounting and row.process is not None
        assert row.process.epsilon_at(DELTA) == pytest.approx(row.epsilon, rel=1e-12)


def test_blt_amplified_needs_no_more_noise_than_unamplified(plan):
    rows = {r.name: r for r in plan.rows}
    assert rows["BLT amplified"].noise_multiplier <= rows["BLT"].noise_multiplier
    assert rows["BLT amplified"].mechanism == rows["BLT"].mechanism
    assert rows["BLT amplified"].process.is_guarantee


def test_poisson_dpsgd_matches_dp_accounting(plan):
    row = {r.name: r for r in plan.rows}["DP-SGD Poisson"]
    sigma, q = row.noise_multiplier, BATCH_SIZE / NUM_EXAMPLES
    interval = row.process.value_discretization_interval
    assert interval == (PLAN_GRID if row.chosen else PLD_DISCRETIZATION)
    independent = _pld_epsilon(q, sigma, N_STEPS, interval=interval)
    assert independent == pytest.approx(row.epsilon, rel=1e-9)
    # meets the budget; stopped with epsilon within 0.1% of it or sigma within 0.01% of the smallest
    assert independent <= EPSILON
    assert (independent >= EPSILON * (1 - 1e-3)
            or _pld_epsilon(q, sigma / (1 + 1e-4), N_STEPS, interval=interval) > EPSILON)
    assert _pld_epsilon(q, sigma * (1 - 3e-3), N_STEPS, interval=interval) > EPSILON  # so sigma is near the smallest
    assert row.rmse_max == pytest.approx(sigma * math.sqrt(N_STEPS), rel=1e-12)
    assert row.rmse_mean == pytest.approx(sigma * math.sqrt((N_STEPS + 1) / 2), rel=1e-12)
    assert row.state_bytes_per_parameter == 0


def test_bandmf_row_is_band23_thm4_at_the_bands_with_the_least_error(plan):
    row = {r.name: r for r in plan.rows}["BandMF"]
    bands = row.process.num_groups
    tried = [int(b) for b in re.search(r"bands tried: ([\d, ]+)", plan.choice.candidates[1].note).group(1).split(", ")]
    assert min(tried) == 2 and bands == min(tried, key=_candidate_rmse)  # the rule, recomputed independently
    coefs = [1.0] if bands == 1 else row.mechanism.coefs
    assert len(coefs) == bands and row.process.num_groups == bands
    q = BATCH_SIZE * bands / NUM_EXAMPLES
    assert row.process.sample_rate == pytest.approx(q, rel=1e-15)
    column_norm = math.sqrt(sum(float(c) ** 2 for c in coefs))
    independent = _pld_epsilon(q, row.noise_multiplier / column_norm, -(-N_STEPS // bands),
                               interval=row.process.value_discretization_interval)
    assert independent == pytest.approx(row.epsilon, rel=1e-9)
    errors = _dense_prefix_errors(coefs, N_STEPS)
    assert row.rmse_max == pytest.approx(row.noise_multiplier * math.sqrt(errors.max()), rel=1e-9)
    assert row.rmse_mean == pytest.approx(row.noise_multiplier * math.sqrt(errors.mean()), rel=1e-9)
    assert row.state_bytes_per_parameter == 4 * (bands - 1)


def test_with_room_for_one_band_there_is_no_bandmf_row():
    # 90 examples, 30 per step: 3 steps per epoch, so bands = 1 is the only candidate (<= 3 // 2)
    one = plan_dataset(90, 30, 4, EPSILON, DELTA, max_buffers=2, progress=False)
    rows = {r.name: r for r in one.rows}
    assert "BandMF" not in rows and {"DP-SGD Poisson", "BLT", "DP-SGD bins"} <= set(rows)
    sgd = rows["DP-SGD Poisson"]
    interval = sgd.process.value_discretization_interval
    independent = _pld_epsilon(30 / 90, sgd.noise_multiplier, 12, interval=interval)
    assert independent == pytest.approx(sgd.epsilon, rel=1e-9)
    assert EPSILON * (1 - 1e-3) <= independent <= EPSILON or _pld_epsilon(
        30 / 90, sgd.noise_multiplier / (1 + 1e-4), 12, interval=interval) > EPSILON


def test_dpsgd_on_bins_is_priced_by_the_allocation_pld_or_ruled_out_by_a_true_lower_bound(plan):
    row = {r.name: r for r in plan.rows}["DP-SGD bins"]
    bins = NUM_EXAMPLES // BATCH_SIZE
    allocation = lambda sigma: balls_in_bins(mf_gaussian(sigma, identity_strategy()), bins, N_STEPS,  # noqa: E731
                                             method="allocation_pld")
    if row.calibrated:
        assert allocation(row.noise_multiplier).epsilon_at(DELTA) <= EPSILON
    else:  # a lower bound: just below it the allocation PLD misses the budget, so the row could not win
        assert allocation(0.995 * row.noise_multiplier).epsilon_at(DELTA) > EPSILON
        assert row.rmse_max > min(r.rmse_max for r in plan.rows if r.chosen)
    assert "random-allocation PLD" in row.accounting


def test_cli_text_states_the_ratio_and_what_is_not_counted(plan, cli_shares_the_plan, capsys):
    assert main(["plan", "--num-examples", str(NUM_EXAMPLES), "--batch-size", str(BATCH_SIZE),
                 "--epochs", str(EPOCHS), "--epsilon", str(EPSILON)]) == 0
    out = capsys.readouterr().out
    chosen = next(r for r in plan.rows if r.chosen)
    assert f"make_private without a strategy takes {plan.choice.chosen.name}" in out
    assert re.search(rf"  {re.escape(chosen.name)} .*<- make_private\n", out)
    assert out.count("<- make_private") == 1 and "not proven for adaptively chosen gradients" in out
    assert "Poisson batch sizes is not counted" in out
    for name in NAMES:
        assert f"  {name} " in out


def test_cli_json_lists_every_row(plan, cli_shares_the_plan, capsys):
    assert main(["plan", "--json", "--num-examples", str(NUM_EXAMPLES), "--batch-size", str(BATCH_SIZE),
                 "--epochs", str(EPOCHS), "--epsilon", str(EPSILON)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in report["strategies"]] == NAMES
    assert report["dataset"]["n_steps"] == N_STEPS
    for entry, row in zip(report["strategies"], plan.rows):
        assert entry["noise_multiplier"] == row.noise_multiplier and entry["chosen"] == row.chosen
        assert entry["epsilon"] == (row.epsilon if row.calibrated else None)
        assert entry["sampling"] == row.sampling and entry["accounting"] == row.accounting


@pytest.mark.parametrize(("args", "message"), [
    (["--num-examples", "600", "--batch-size", "30", "--epochs", "4", "--n-steps", "80"],
     "--n-steps cannot be combined with --num-examples"),
    (["--num-examples", "600", "--batch-size", "30", "--min-sep", "20"], "cannot be combined"),
    (["--num-examples", "600", "--batch-size", "30"], "missing: --epochs"),
    (["--num-examples", "30", "--batch-size", "60", "--epochs", "2"], r"batch_size \(60\) must be <= num_examples"),
    (["--num-examples", "600", "--batch-size", "30", "--epochs", "0"], "epochs must be >= 1"),
])
def test_cli_bad_dataset_input_is_a_clear_error(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opake: error:")
    assert re.search(message, err), err
