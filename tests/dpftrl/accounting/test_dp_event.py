"""Interop with dp_accounting: every proven process exposes a ``dp_event`` that dp_accounting's
accountants can compose with other releases of the same data.

References are independent of the code under test: a composition of Gaussian mechanisms is the
Gaussian with 1 / sigma^2 = sum 1 / sigma_i^2 (mu-GDP composition), whose epsilon(delta) is the
closed form of Balle-Wang 2018, evaluated here with scipy (not with opake's accountant)."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from scipy import optimize, stats

import opake.accounting as acc
import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy

DELTA = 1e-5


def _exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """BW18 Thm 8, solved for epsilon with scipy (an oracle written apart from opake's)."""
    mu = 1.0 / sigma

    def excess(epsilon):
        return stats.norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon) * stats.norm.cdf(-mu / 2 - epsilon / mu) - delta

    return optimize.brentq(excess, 0.0, 500.0, xtol=1e-12)


def _pld_epsilon(*events) -> float:
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def _rdp_epsilon(*events) -> float:
    accountant = RdpAccountant()
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(DELTA)


STRATEGY = blt_strategy(max_buffers=3)


def _processes():
    inner = dpftrl_acc.mf_gaussian(3.0, STRATEGY)
    return {
        "mf_gaussian": dpftrl_acc.mf_gaussian(3.0, STRATEGY, 200, 20, 10),
        "balls_in_bins": dpftrl_acc.balls_in_bins(inner, num_bins=20, n_steps=200, method="rigorous"),
        "gaussian": acc.gaussian(1.7),
    }


@pytest.mark.parametrize("name", ["mf_gaussian", "balls_in_bins", "gaussian"])
def test_the_event_of_an_exact_process_is_exactly_that_process(name):
    process = _processes()[name]
    event = process.dp_event
    assert isinstance(event, dp_accounting.GaussianDpEvent)
    sigma = event.noise_multiplier
    if name != "gaussian":  # the run is one Gaussian with sigma / S
        assert sigma == pytest.approx(process.priced_noise.noise_multiplier / process.priced_noise.mechanism.sensitivity,
                                      rel=1e-15)
    exact = _exact_gaussian_epsilon(sigma, DELTA)
    assert process.epsilon_at(DELTA) == pytest.approx(exact, rel=1e-7)
    # dp_accounting's PLD of the event is a pessimistic discretization of the same curve.
    assert exact <= _pld_epsilon(event) <= exact * 1.01


def test_an_mf_run_composed_with_another_release_in_dp_accounting():
    run = _processes()["mf_gaussian"]
    other = dp_accounting.GaussianDpEvent(2.5)  # e.g. a private evaluation on the same data
    combined_sigma = 1.0 / math.sqrt(run.dp_event.noise_multiplier**-2 + 2.5**-2)
    exact = _exact_gaussian_epsilon(combined_sigma, DELTA)
    pld = _pld_epsilon(run.dp_event, other)
    rdp = _rdp_epsilon(run.dp_event, other)
    assert exact <= pld <= exact * 1.01
    assert exact <= rdp <= exact * 1.3  # RDP conversion is an upper bound, looser than the PLD
    assert pld > run.epsilon_at(DELTA)  # composing costs privacy


def test_the_amplified_rdp_process_exposes_the_unamplified_event_as_a_valid_upper_bound():
    inner = dpftrl_acc.mf_gaussian(3.0, STRATEGY)
    amplified = dpftrl_acc.balls_in_bins(inner, num_bins=20, n_steps=200, method="rdp")
    rigorous = dpftrl_acc.balls_in_bins(inner, num_bins=20, n_steps=200, method="rigorous")
    assert amplified.dp_event == rigorous.dp_event
    assert amplified.epsilon_at(DELTA) <= _pld_epsilon(amplified.dp_event) * (1 + 1e-9)


def test_poisson_event_matches_its_process():
    process = dpftrl_acc.poisson(dpftrl_acc.mf_gaussian(1.0, identity_strategy()), sample_rate=0.05, n_steps=100)
    assert process.epsilon_at(DELTA) == pytest.approx(_pld_epsilon(process.dp_event), rel=0.02)
    banded = dpftrl_acc.poisson(dpftrl_acc.mf_gaussian(1.5, band_mf_strategy(4)), sample_rate=0.1, n_steps=40)
    assert isinstance(banded.dp_event, dp_accounting.DpEvent)


def test_processes_without_a_proven_event_refuse_with_the_reason():
    inner = dpftrl_acc.mf_gaussian(3.0, STRATEGY)
    with pytest.raises(dpftrl_acc.UnboundMechanismError):
        inner.dp_event
    estimate = dpftrl_acc.balls_in_bins(inner, num_bins=20, n_steps=200, method="monte_carlo",
                                        num_samples=1000, seed=1)
    with pytest.raises(TypeError, match=r"estimate is not a proven bound.*rigorous.dp_event"):
        estimate.dp_event
