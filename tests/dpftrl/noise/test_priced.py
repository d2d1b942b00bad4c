"""priced_noise on every accountant, and check_noise_priced / noise_fn.check_accounted_by.

Every process kind opake returns must say which noise it priced (mechanism fingerprint,
participation context, noise multiplier), and the noise engine must refuse a process that
priced anything else: another sigma, another strategy recipe, another context.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import opake.accounting as acc
from opake.dpftrl.accounting import (
    AccountingMismatchError,
    PricedNoise,
    UnboundMechanismError,
    balls_in_bins,
    check_noise_priced,
    mf_gaussian,
    poisson,
)
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy, mf_gaussian_noise
from opake.dpftrl.participation import Participation
from opake.random import key

N_STEPS, NUM_BINS = 40, 10  # balls-in-bins: k = ceil(40 / 10) = 4 participations, 10 apart
SIGMA = 3.0


def _engine(strategy, sigma=SIGMA, n_steps=N_STEPS, min_sep=1, max_participations=None):
    noise_fn, _ = mf_gaussian_noise(torch.zeros(3), strategy, n_steps=n_steps, min_sep=min_sep,
                                    max_participations=max_participations, noise_multiplier=sigma, key=key(0))
    return noise_fn


def _bins(strategy, sigma=SIGMA, method="rigorous"):
    extra = dict(num_samples=1000, seed=0) if method == "monte_carlo" else {}
    return balls_in_bins(mf_gaussian(sigma, strategy), num_bins=NUM_BINS, n_steps=N_STEPS, method=method, **extra)


# (name, process builder taking (strategy, sigma), engine context, strategy for the process)
BLT = blt_strategy(max_buffers=2)
BAND = band_mf_strategy(4)
KINDS = {
    "mf_gaussian": (lambda s, sigma: mf_gaussian(sigma, s, N_STEPS, NUM_BINS, 2), dict(min_sep=NUM_BINS, max_participations=2), BLT),
    "balls_in_bins": (lambda s, sigma: _bins(s, sigma), dict(min_sep=NUM_BINS), BLT),
    "balls_in_bins_rdp": (lambda s, sigma: _bins(s, sigma, "rdp"), dict(min_sep=NUM_BINS), BLT),
    "balls_in_bins_monte_carlo": (lambda s, sigma: _bins(s, sigma, "monte_carlo"), dict(min_sep=NUM_BINS), BLT),
    "poisson_band_mf": (lambda s, sigma: poisson(mf_gaussian(sigma, s), 0.1, N_STEPS), dict(min_sep=4), BAND),
    "poisson_identity": (lambda s, sigma: poisson(mf_gaussian(sigma, s), 0.1, N_STEPS), dict(min_sep=1), identity_strategy()),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_process_states_the_noise_it_priced(kind):
    build, context, strategy = KINDS[kind]
    process = build(strategy, SIGMA)
    priced = process.priced_noise
    assert isinstance(priced, PricedNoise)
    assert priced.noise_multiplier == SIGMA
    assert priced.mechanism == strategy.resolve(N_STEPS, context["min_sep"], context.get("max_participations"))
    assert priced.participation.canonical == Participation(N_STEPS, **context).canonical
    with pytest.raises(dataclasses.FrozenInstanceError):
        priced.noise_multiplier = 1.0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_matching_engine_passes(kind):
    build, context, strategy = KINDS[kind]
    _engine(strategy, **context).check_accounted_by(build(strategy, SIGMA))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_engine_with_another_noise_multiplier_is_refused(kind):
    build, context, strategy = KINDS[kind]
    with pytest.raises(AccountingMismatchError, match=r"noise_multiplier: accountant 3\.0, noise 0\.5"):
        _engine(strategy, sigma=0.5, **context).check_accounted_by(build(strategy, SIGMA))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_engine_with_another_strategy_recipe_is_refused(kind):
    build, context, strategy = KINDS[kind]
    other = band_mf_strategy(2) if strategy != band_mf_strategy(2) else identity_strategy()
    with pytest.raises(AccountingMismatchError, match=r"mechanism: .*strategy: the accountant priced the recipe"):
        _engine(other, **context).check_accounted_by(build(strategy, SIGMA))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_engine_with_another_participation_context_is_refused(kind):
    build, context, strategy = KINDS[kind]
    for changed in [dict(context, n_steps=N_STEPS + 4), dict(context, min_sep=context["min_sep"] // 2 or 2),
                    dict(context, max_participations=1)]:
        with pytest.raises(AccountingMismatchError, match=r"participation: the accountant priced \(n_steps="):
            _engine(strategy, **changed).check_accounted_by(build(strategy, SIGMA))


def test_the_measured_case_an_underpowered_engine_against_balls_in_bins_is_refused():
    # an engine at sigma 0.5 used to pass against an accountant that priced sigma 5.0
    strategy = blt_strategy(max_buffers=2)
    process = balls_in_bins(mf_gaussian(5.0, strategy), num_bins=NUM_BINS, n_steps=N_STEPS)
    with pytest.raises(ValueError, match=r"accounting and noise disagree \(noise_multiplier: accountant 5\.0, noise 0\.5\)"):
        _engine(strategy, sigma=0.5, min_sep=NUM_BINS).check_accounted_by(process)


def test_all_differences_are_listed_together():
    process = mf_gaussian(2.0, BLT, N_STEPS, NUM_BINS, 2)
    with pytest.raises(AccountingMismatchError, match=r"mechanism: .*strategy: .*participation: .*noise_multiplier: "):
        _engine(identity_strategy(), sigma=1.0, min_sep=5).check_accounted_by(process)


def test_an_unbound_mf_gaussian_is_refused_with_what_to_do():
    with pytest.raises(UnboundMechanismError, match=r"unbound mf_gaussian priced no particular noise.*n_steps"):
        _engine(BLT).check_accounted_by(mf_gaussian(SIGMA, BLT))
    with pytest.raises(UnboundMechanismError, match="unbound"):
        mf_gaussian(SIGMA, BLT).priced_noise


@pytest.mark.parametrize("process", [acc.gaussian(SIGMA), object(), None])
def test_a_process_that_does_not_state_its_noise_is_refused(process):
    with pytest.raises(TypeError, match=r"does not state which noise it priced .*price the run with"):
        _engine(identity_strategy(), n_steps=1).check_accounted_by(process)


# ---------------------------------------------------------------------------------------------
# max_participations=None and its explicit equivalent min(k, ceil(n / b)) are one context


@pytest.mark.parametrize("strategy", [BLT, BAND, identity_strategy()], ids=["blt", "band_mf", "identity"])
@pytest.mark.parametrize("n, b", [(40, 10), (41, 10), (12, 1), (30, 30)])
def test_none_and_its_explicit_equivalent_resolve_to_one_mechanism(strategy, n, b):
    cap = -(-n // b)
    implicit = strategy.resolve(n, b, None)
    for k in [cap, cap + 1, 99]:
        explicit = strategy.resolve(n, b, k)
        assert explicit.fingerprint == implicit.fingerprint
        assert explicit == implicit
        assert explicit.sensitivity == implicit.sensitivity
        np.testing.assert_array_equal(explicit.theta, implicit.theta)
        np.testing.assert_array_equal(explicit.omega, implicit.omega)
        np.testing.assert_array_equal(explicit.toeplitz_coefficients(), implicit.toeplitz_coefficients())
    if cap > 1:  # a binding k is another context
        assert strategy.resolve(n, b, cap - 1).fingerprint != implicit.fingerprint


@pytest.mark.parametrize("engine_k, process_k", [(None, 4), (4, None), (99, None), (None, 99)])
def test_engine_and_accountant_agree_across_none_and_explicit(engine_k, process_k):
    process = mf_gaussian(SIGMA, BLT, N_STEPS, NUM_BINS, process_k)
    _engine(BLT, min_sep=NUM_BINS, max_participations=engine_k).check_accounted_by(process)


def test_balls_in_bins_passes_for_an_engine_given_none_or_the_explicit_count():
    process = _bins(BLT)
    assert process.participation.max_participations == 4
    for k in [None, 4]:
        _engine(BLT, min_sep=NUM_BINS, max_participations=k).check_accounted_by(process)


def test_canonical_participation():
    assert Participation(40, 10, 4).canonical == Participation(40, 10, None)
    assert Participation(40, 10, 99).canonical == Participation(40, 10)
    assert Participation(40, 10, 3).canonical == Participation(40, 10, 3)
    assert Participation(40, 10, None).canonical.max_participations is None


def test_check_noise_priced_is_usable_without_an_engine():
    mechanism = BLT.resolve(N_STEPS, NUM_BINS, 2)
    process = mf_gaussian(SIGMA, BLT, N_STEPS, NUM_BINS, 2)
    check_noise_priced(process, mechanism=mechanism, participation=Participation(N_STEPS, NUM_BINS, 2),
                       noise_multiplier=SIGMA)
    with pytest.raises(AccountingMismatchError, match=r"noise_multiplier: accountant 3\.0, noise 3\.5"):
        check_noise_priced(process, mechanism=mechanism, participation=mechanism.participation, noise_multiplier=3.5)
