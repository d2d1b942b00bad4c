"""private.epsilon_spent: the guarantee of the steps taken so far.

Unamplified: checked exactly against a dense float64 reference (the leading t x t block of C,
its sensitivity by brute force over every participation pattern the sampler allows within t
steps, and dp_accounting's analytic Gaussian). Amplified and Poisson: never above the planned
epsilon, non-decreasing, equal to it at the end.
"""

import itertools
import math

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.dpftrl.strategies.prefix import PrefixStrategy
from opake.random import key
from opake.torch import make_private

DELTA = 1e-5


def _run(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    generator = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=generator, dtype=torch.float64),
                                             torch.randint(0, 3, (24,), generator=generator))
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           target_delta=DELTA, max_grad_norm=1.0, key=key(2), **options)
    spent = [private.epsilon_spent()]
    for _epoch in range(private.plan.epochs):
        for x, y in private.data_loader:
            private.optimizer.zero_grad()
            if len(y):
                F.cross_entropy(model(x), y).backward()
            private.optimizer.step()
            spent.append(private.epsilon_spent())
    return private, spent


def _dense_sensitivity(coefficients: np.ndarray, steps: int, min_sep: int, max_participations: int) -> float:
    """max ||C_t 1_S|| over every S in [0, t) with gaps >= min_sep and |S| <= max_participations."""
    c = np.zeros((steps, steps))
    for i in range(steps):
        c[i, : i + 1] = coefficients[: i + 1][::-1]
    best = 0.0
    for size in range(1, max_participations + 1):
        for pattern in itertools.combinations(range(steps), size):
            if all(b - a >= min_sep for a, b in zip(pattern, pattern[1:])):
                best = max(best, float(np.linalg.norm(c[:, list(pattern)].sum(axis=1))))
    return best


@pytest.mark.parametrize("strategy", [blt_strategy(max_buffers=2), identity_strategy()])
def test_unamplified_spent_epsilon_is_the_dense_leading_block_s(strategy):
    private, spent = _run(batch_size=6, epochs=3, noise_multiplier=2.0, strategy=strategy, amplification=False)
    plan = private.plan
    bins, n = plan.num_bins, plan.participation.n_steps                       # 4 bins, 12 steps
    coefficients = plan.accountant.priced_noise.mechanism.toeplitz_coefficients(n)
    assert spent[0] == 0.0 and spent[-1] == private.epsilon
    for steps in range(1, n + 1):
        horizon = max(steps, bins)            # the first t < b steps: the first cycle's bound
        sensitivity = _dense_sensitivity(coefficients, horizon, bins, math.ceil(horizon / bins))
        expected = dp_accounting.get_epsilon_gaussian(plan.noise_multiplier / sensitivity, DELTA)
        assert spent[steps] == pytest.approx(expected, rel=1e-7, abs=1e-9), steps
    assert all(a <= b for a, b in zip(spent, spent[1:]))


@pytest.mark.filterwarnings("ignore::opake.dpftrl.accounting.UnprovenAmplificationWarning")
def test_amplified_spent_epsilon_grows_to_the_planned_one():
    private, spent = _run(batch_size=6, epochs=3, target_epsilon=4.0, strategy=blt_strategy(max_buffers=2),
                          amplification=True)
    assert private.plan.accounting == "amplified"
    assert spent[0] == 0.0 and spent[-1] == private.epsilon
    assert all(0.0 <= value <= private.epsilon for value in spent)
    assert all(a <= b for a, b in zip(spent, spent[1:]))
    assert spent[len(spent) // 3] < 0.8 * private.epsilon      # one epoch of three costs clearly less


def test_dp_sgd_on_bins_spent_epsilon_is_the_random_allocation_pld_of_the_steps_so_far():
    private, spent = _run(batch_size=6, epochs=2, target_epsilon=4.0, strategy=identity_strategy())
    assert private.plan.accounting == "allocation_pld"
    assert spent[0] == 0.0 and spent[-1] == private.epsilon
    assert all(0.0 <= value <= private.epsilon for value in spent)
    assert all(a <= b for a, b in zip(spent, spent[1:]))


@pytest.mark.parametrize("strategy", [identity_strategy(), band_mf_strategy(bands=2)])
def test_poisson_spent_epsilon_grows_to_the_planned_one(strategy):
    private, spent = _run(batch_size=6, epochs=2, noise_multiplier=1.5, strategy=strategy, sampling="poisson")
    assert spent[0] == 0.0 and spent[-1] == private.epsilon
    assert all(0.0 <= value <= private.epsilon for value in spent)
    assert all(a <= b for a, b in zip(spent, spent[1:]))
    assert spent[1] < spent[-1]


def test_a_bound_that_dips_at_a_later_horizon_lowers_every_earlier_report(monkeypatch):
    # An amplified bound minimizes over orders and bounding routes, so its value at a longer
    # horizon can come out below a shorter one's. The first t releases are a post-processing of
    # any longer prefix: the report takes the later bounds too and never decreases.
    private, _ = _run(batch_size=6, epochs=3, noise_multiplier=1.0, strategy=identity_strategy())  # 4 bins, 12 steps
    dipping = {4: 2.0, 8: 1.5, 12: 3.0}                        # raw prefix bounds at the cycle ends
    monkeypatch.setattr(type(private), "_prefix_epsilon", lambda self, horizon, delta: dipping[horizon])
    reported = []
    for steps in range(1, 12):
        monkeypatch.setattr(type(private), "steps_taken", property(lambda self, steps=steps: steps))
        reported.append(private.epsilon_spent())
    # steps 1-8 may use the bound at 8; steps 9-11 only the whole run's (at 12)
    assert reported == [1.5] * 8 + [private.epsilon] * 3 and private.epsilon > 1.5
    assert all(a <= b for a, b in zip(reported, reported[1:]))
    assert dipping[4] > dipping[8]  # negative control: the raw per-horizon bounds decrease


def test_prefix_strategy_refuses_a_longer_horizon():
    mechanism = blt_strategy(max_buffers=2).resolve(10, 5, 2)
    with pytest.raises(ValueError, match=r"at most 10 steps"):
        PrefixStrategy(mechanism).resolve(11, 5, 3)
    same = PrefixStrategy(mechanism).resolve(10, 5, 2)
    assert same.sensitivity == pytest.approx(mechanism.sensitivity, rel=1e-12)
