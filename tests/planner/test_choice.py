"""opake.planner.choice: the mechanism with the least noise at a budget, among the proven ones.

The numbers the choice rests on, each against an independent reference: the workload errors
(torch.optim.SGD itself stepping on unit impulses of the noise), the lower bound that rules out
DP-SGD on balls in bins (below the random-allocation PLD's delta, and equal to a Monte Carlo of
its own test), and the chosen noise multiplier (the plan's accountant meets the budget with it,
within 0.2%, and a control 1% lower misses). The ranking: the least error wins, restrictions are
respected, what opake cannot price is refused.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from opake.dpftrl.accounting import balls_in_bins, mf_gaussian
from opake.dpftrl.accounting.allocation.lower_bound import delta_lower_bound, noise_multiplier_lower_bound
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.dpftrl.strategies.blt_workload import ParameterWorkload
from opake.torch import choose_mechanism, make_private
from opake.dpftrl.accounting.accountant import poisson_accountant, balls_in_bins_accountant
from opake.planner import Workload
from opake.random import key

DELTA = 1e-5


# --- the workload errors against torch's SGD --------------------------------------------------

def _sgd_reference(inverse, momentum, dampening, nesterov, rates):
    """e_t by running torch.optim.SGD on the noise C^{-1} e_j of each unit impulse e_j."""
    n = len(inverse)
    noise = np.zeros((n, n))
    for t in range(n):
        noise[t, :t + 1] = inverse[t::-1]
    response = np.zeros((n, n))
    for j in range(n):
        parameter = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        optimizer = torch.optim.SGD([parameter], lr=1.0, momentum=momentum, dampening=dampening, nesterov=nesterov)
        for t in range(n):
            optimizer.param_groups[0]["lr"] = float(rates[t])
            parameter.grad = torch.tensor([noise[t, j]], dtype=torch.float64)
            optimizer.step()
            response[t, j] = -parameter.item()
    return (response ** 2).sum(axis=1)


@pytest.mark.parametrize("momentum, dampening, nesterov, scheduled", [
    (0.0, 0.0, False, False), (0.9, 0.0, False, False), (0.9, 0.3, False, False), (0.9, 0.0, True, False),
    (0.5, 0.2, False, True), (0.9, 0.0, True, True), (0.0, 0.0, False, True),
])
def test_workload_errors_are_torch_sgds_parameter_noise(momentum, dampening, nesterov, scheduled):
    generator = np.random.default_rng(0)
    n = 30
    inverse = np.concatenate(([1.0], 0.3 * generator.normal(size=n - 1)))
    rates = generator.uniform(0.1, 1.0, n) if scheduled else np.ones(n)
    workload = Workload(ParameterWorkload(momentum, dampening, nesterov), tuple(rates) if scheduled else None)
    np.testing.assert_allclose(workload.errors(inverse), _sgd_reference(inverse, momentum, dampening, nesterov, rates),
                               rtol=1e-12)
    np.testing.assert_allclose(Workload().errors(inverse), _sgd_reference(inverse, 0.0, 0.0, False, np.ones(n)),
                               rtol=1e-12)   # prefix sums: plain SGD at learning rate 1


def test_workload_control_momentum_changes_the_errors():
    inverse = np.array([1.0, -0.5, 0.1, 0.0, 0.2])
    assert not np.allclose(Workload(ParameterWorkload(0.9)).errors(inverse), Workload().errors(inverse))


# --- the lower bound that rules out DP-SGD on balls in bins -------------------------------------

@pytest.mark.parametrize("bins, participations, sigma, epsilon", [
    (30, 20, 3.0, 3.0), (100, 5, 2.0, 2.0), (25, 9, 1.5, 4.0), (30, 1, 1.0, 1.0),
])
def test_the_lower_bound_is_below_the_allocation_pld(bins, participations, sigma, epsilon):
    upper = balls_in_bins(mf_gaussian(sigma, identity_strategy()), bins, bins * participations).delta_at(epsilon)
    lower = delta_lower_bound(sigma, bins, participations, epsilon)
    assert 0.0 < lower <= upper
    assert lower > 0.5 * upper if participations > 1 else True     # tight where the unit's bin dominates


def test_the_lower_bound_is_its_tests_probabilities_by_monte_carlo():
    bins, participations, sigma, epsilon, tau = 20, 4, 1.0, 1.0, 3.0
    a = math.sqrt(participations) / sigma
    generator = np.random.default_rng(1)
    draws = 400_000
    without = generator.standard_normal((draws, bins)).max(axis=1) > tau
    with_unit = generator.standard_normal((draws, bins))
    with_unit[:, 0] += a                    # the unit's bin (any bin: the others are exchangeable)
    p, q = without.mean(), (with_unit.max(axis=1) > tau).mean()
    from scipy.stats import norm
    assert p == pytest.approx(1 - norm.cdf(tau) ** bins, abs=4 * math.sqrt(p / draws))
    assert q == pytest.approx(1 - norm.cdf(tau) ** (bins - 1) * norm.cdf(tau - a), abs=4 * math.sqrt(q / draws))
    assert delta_lower_bound(sigma, bins, participations, epsilon) >= q - math.exp(epsilon) * p - 8 * math.sqrt(q / draws)


def test_below_the_noise_multiplier_bound_the_allocation_pld_misses_the_budget():
    low = noise_multiplier_lower_bound(30, 20, 3.0, DELTA)
    process = balls_in_bins(mf_gaussian(0.999 * low, identity_strategy()), 30, 600)
    assert process.epsilon_at(DELTA) > 3.0
    assert balls_in_bins(mf_gaussian(1.02 * low, identity_strategy()), 30, 600).epsilon_at(DELTA) <= 3.0  # tight


# --- the choice ---------------------------------------------------------------------------------

def _sgd(momentum=0.0):
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=momentum)


def test_the_least_error_wins_and_its_noise_meets_the_budget_on_the_plans_accountant():
    choice = choose_mechanism(num_examples=1200, batch_size=40, epochs=4, target_epsilon=3.0, target_delta=DELTA,
                              optimizer=_sgd(), progress=False)
    assert [c.name for c in choice.candidates][:1] == ["DP-SGD, Poisson"]
    assert {c.name.split(",")[0] for c in choice.candidates} == {"DP-SGD", "BandMF", "BLT"}
    assert choice.chosen.error == min(c.error for c in choice.candidates)
    assert all(c.calibrated or c.error > choice.chosen.error for c in choice.candidates)
    chosen = choice.chosen  # the accountant the plan builds, built here from the run's numbers
    accountant = (poisson_accountant(chosen.strategy, 40 * chosen.strategy.bands / 1200, 4 * 30)
                  if chosen.sampling == "poisson" else balls_in_bins_accountant(chosen.strategy, 30, 4 * 30))
    assert accountant == choice.accountant
    assert 0.998 * 3.0 <= accountant(choice.noise_multiplier).epsilon_at(DELTA) == choice.epsilon <= 3.0
    assert accountant(0.99 * choice.noise_multiplier).epsilon_at(DELTA) > 3.0       # control: 1% less misses


def test_make_private_with_the_chosen_noise_prices_it_at_the_choices_epsilon():
    choice = choose_mechanism(num_examples=600, batch_size=20, epochs=3, target_epsilon=4.0, target_delta=DELTA,
                              progress=False)
    model = nn.Linear(3, 2)
    dataset = torch.utils.data.TensorDataset(torch.randn(600, 3), torch.randint(0, 2, (600,)))
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=20, epochs=3, max_grad_norm=1.0, noise_multiplier=choice.noise_multiplier,
                           target_delta=DELTA, strategy=choice.strategy, sampling=choice.sampling, key=key(0))
    assert private.epsilon == choice.epsilon <= 4.0 and str(private.plan.accounting) == choice.accounting


def test_the_workload_follows_the_optimizer():
    plain = choose_mechanism(num_examples=1200, batch_size=40, epochs=2, target_epsilon=3.0, target_delta=DELTA,
                             optimizer=_sgd(), progress=False)
    momentum = choose_mechanism(num_examples=1200, batch_size=40, epochs=2, target_epsilon=3.0, target_delta=DELTA,
                                optimizer=_sgd(0.9), progress=False)
    assert plain.workload.sgd is None and momentum.workload.sgd == ParameterWorkload(0.9)
    blt = {c.name: c for c in momentum.candidates}["BLT"]
    assert blt.strategy.parameter_workload == ParameterWorkload(0.9)       # the BLT for this optimizer


@pytest.mark.parametrize("strategy, sampling, families", [
    (None, "balls_in_bins", {"BLT", "DP-SGD, balls in bins"}),
    (None, "poisson", {"DP-SGD, Poisson", "BandMF"}),
    (identity_strategy(), None, {"DP-SGD, Poisson", "DP-SGD, balls in bins"}),
    (band_mf_strategy(bands=3), None, {"BandMF"}),
    (blt_strategy(), None, {"BLT"}),
])
def test_strategy_and_sampling_restrict_the_candidates(strategy, sampling, families):
    choice = choose_mechanism(num_examples=1200, batch_size=40, epochs=2, target_epsilon=3.0, target_delta=DELTA,
                              strategy=strategy, sampling=sampling, progress=False)
    assert {"BandMF" if c.name.startswith("BandMF") else c.name for c in choice.candidates} == families
    assert choice.epsilon <= 3.0
    if strategy is not None:
        assert choice.strategy == strategy


def test_the_noise_state_cap_limits_the_bands():
    capped = choose_mechanism(num_examples=1200, batch_size=20, epochs=1, target_epsilon=2.0, target_delta=DELTA,
                              sampling="poisson", max_state_rows=1, progress=False)
    assert {c.strategy.bands for c in capped.candidates} == {1, 2}
    wider = choose_mechanism(num_examples=1200, batch_size=20, epochs=1, target_epsilon=2.0, target_delta=DELTA,
                             sampling="poisson", max_state_rows=3, progress=False)
    assert {c.strategy.bands for c in wider.candidates} == {1, 4}   # control: 4 bands beat 2 once allowed


def test_what_opake_cannot_price_is_refused():
    with pytest.raises(ValueError, match=r"Poisson amplification is proven for banded strategies only"):
        choose_mechanism(num_examples=1200, batch_size=40, epochs=2, target_epsilon=3.0, target_delta=DELTA,
                         strategy=blt_strategy(), sampling="poisson", progress=False)
    with pytest.raises(ValueError, match=r"sampling must be None"):
        choose_mechanism(num_examples=1200, batch_size=40, epochs=2, target_epsilon=3.0, target_delta=DELTA,
                         sampling="shuffle", progress=False)


def test_a_repeated_request_is_answered_from_the_cache_with_the_same_plan():
    """A second identical request (another learning rate of the same run) gets the first choice
    itself; a request that differs in any part (the optimizer's workload, the budget) is chosen again."""
    from opake.torch.planning import plan_privacy

    def request(lr=0.1, momentum=0.9, epsilon=3.0):
        optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=lr, momentum=momentum)
        return dict(num_examples=600, batch_size=32, epochs=2, target_epsilon=epsilon, target_delta=1e-5,
                    optimizer=optimizer)

    first = choose_mechanism(**request())
    assert choose_mechanism(**request(lr=0.01)) is first  # the workload is the momentum's, not the rate's
    assert choose_mechanism(**request(momentum=0.5)) is not first
    assert choose_mechanism(**request(epsilon=4.0)) is not first
    plans = [plan_privacy(max_grad_norm=1.0, key=key(0), **request()) for _ in range(2)]
    assert plans[0].choice is plans[1].choice
    assert (plans[0].noise_multiplier, plans[0].epsilon) == (plans[1].noise_multiplier, plans[1].epsilon)


# --- the learning rate's scale (issue 37: a rate tuned for one mechanism serves the chosen one) ------

def _dense_max_row_norm(mechanism, n):
    """max_t ||row t of C^{-1}||, C the dense lower-triangular Toeplitz matrix of the mechanism."""
    coefficients = np.asarray(mechanism.toeplitz_coefficients(n), dtype=np.float64)
    dense = np.zeros((n, n))
    for lag in range(n):
        dense += np.diag(np.full(n - lag, coefficients[lag]), -lag)
    inverse = np.linalg.inv(dense)
    return float(np.sqrt((inverse ** 2).sum(axis=1)).max())


def test_one_steps_noise_is_sigma_times_the_largest_row_of_the_dense_inverse():
    choice = choose_mechanism(num_examples=600, batch_size=20, epochs=3, target_epsilon=8.0, target_delta=DELTA,
                              progress=False)
    for candidate in choice.candidates:
        n = candidate.accountant.n_steps
        min_sep = candidate.strategy.bands if candidate.sampling == "poisson" else candidate.accountant.num_bins
        mechanism = candidate.strategy.resolve(n, min_sep, -(-n // min_sep))
        expected = candidate.noise_multiplier * _dense_max_row_norm(mechanism, n)
        assert candidate.step_noise == pytest.approx(expected, rel=1e-9), candidate.name
    dpsgd = next(c for c in choice.candidates if c.name == "DP-SGD, Poisson")
    assert dpsgd.step_noise == pytest.approx(dpsgd.noise_multiplier, rel=1e-12)  # the identity: sigma itself
    assert choice.adam_rate_scale == pytest.approx(choice.chosen.step_noise / dpsgd.step_noise, rel=1e-12)
    if choice.chosen is not dpsgd:
        assert "a rate tuned with DP-SGD goes x" in choice.table()


def test_adams_signal_step_follows_lr_over_the_noise_so_the_scaled_rate_carries_over():
    # What the scale rests on, checked on torch's Adam itself: with a gradient g under noise of
    # standard deviation s >> g, the parameter drifts by about lr * g / s a step. Scaling lr with s
    # keeps the drift; keeping lr divides it by the ratio of the noises (the control).
    def drift(noise_std, lr, steps=4000, signal=0.05):
        generator = torch.Generator().manual_seed(0)
        weight = torch.zeros(256, requires_grad=True)
        adam = torch.optim.Adam([weight], lr=lr)
        for _ in range(steps):
            weight.grad = signal + noise_std * torch.randn(256, generator=generator)
            adam.step()
        return float(-weight.detach().mean()) / steps

    small, large = drift(1.0, 1e-3), drift(6.0, 6e-3)
    assert large == pytest.approx(small, rel=0.15)
    assert drift(6.0, 1e-3) < 0.3 * small


@pytest.mark.parametrize(("momentum", "dampening", "nesterov"), [(0.0, 0.0, False), (0.9, 0.0, False),
                                                                 (0.9, 0.3, False), (0.8, 0.0, True)])
def test_the_recursive_momentum_filter_is_the_convolution_with_f(momentum, dampening, nesterov):
    from scipy.signal import fftconvolve

    from opake.planner.workload import _momentum_filter, _momentum_filtered

    sgd = ParameterWorkload(momentum=momentum, dampening=dampening, nesterov=nesterov)
    inverse = np.random.default_rng(0).standard_normal(3000)
    f, _ = _momentum_filter(sgd, 3000)
    np.testing.assert_allclose(_momentum_filtered(inverse, sgd), fftconvolve(f, inverse)[:3000], rtol=1e-9, atol=1e-9)
