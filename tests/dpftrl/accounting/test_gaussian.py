"""mf_gaussian: the whole run is one Gaussian with noise multiplier noise_multiplier / S.

References: dp_accounting's exact Gaussian (get_epsilon_gaussian), and a sensitivity found by
brute force over every participation pattern of a small dense C (tests/accounting_oracles.py, not
the library's closed form).
"""

import math

import dp_accounting
import pytest

from accounting_oracles import HAND_BLT, brute_force_sensitivity, dense_coefficients
import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.noise import identity_strategy
from opake.dpftrl.participation import Participation


@pytest.mark.parametrize("noise_multiplier", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("n_steps", [1, 7, 100])
def test_identity_single_participation_is_the_plain_gaussian(noise_multiplier, n_steps):
    proc = dpftrl_acc.mf_gaussian(noise_multiplier, identity_strategy(), n_steps=n_steps, max_participations=1)
    for delta in [1e-9, 1e-5]:
        assert proc.epsilon_at(delta) == pytest.approx(
            dp_accounting.get_epsilon_gaussian(noise_multiplier, delta), rel=1e-9
        )
    assert proc.sensitivity == 1.0


def test_identity_with_k_participations_is_gaussian_with_sigma_over_root_k():
    proc = dpftrl_acc.mf_gaussian(2.0, identity_strategy(), n_steps=40, min_sep=10)
    assert proc.participation.effective_participations == 4
    assert proc.epsilon_at(1e-6) == pytest.approx(dp_accounting.get_epsilon_gaussian(1.0, 1e-6), rel=1e-9)


@pytest.mark.parametrize("n_steps, min_sep, max_participations", [(8, 1, 1), (9, 3, None), (10, 2, 3), (12, 4, 2)])
def test_blt_uses_the_resolved_sensitivity(n_steps, min_sep, max_participations):
    proc = dpftrl_acc.mf_gaussian(1.5, HAND_BLT, n_steps=n_steps, min_sep=min_sep, max_participations=max_participations)
    c = dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, n_steps)
    k = Participation(n_steps, min_sep, max_participations).effective_participations
    sensitivity = brute_force_sensitivity(tuple(c), min_sep, k)
    assert proc.effective_noise_multiplier == pytest.approx(1.5 / sensitivity, rel=1e-15)
    for delta in [1e-10, 1e-5, 1e-3]:
        expected = dp_accounting.get_epsilon_gaussian(1.5 / sensitivity, delta)
        assert proc.epsilon_at(delta) == pytest.approx(expected, rel=1e-9)
        assert proc.delta_at(proc.epsilon_at(delta)) <= delta


def test_mechanism_is_the_strategy_resolution_with_the_same_fingerprint():
    strategy = identity_strategy()
    proc = dpftrl_acc.mf_gaussian(1.0, strategy, n_steps=50, min_sep=5, max_participations=3)
    assert proc.mechanism.fingerprint == strategy.resolve(50, 5, 3).fingerprint
    assert proc.participation == Participation(50, 5, 3)
    assert proc.is_guarantee is True
    assert "exact" in proc.description


def test_unbound_mechanism_explains_that_an_amplifier_must_price_it():
    unbound = dpftrl_acc.mf_gaussian(1.0, identity_strategy())
    assert not unbound.is_bound and unbound.participation is None
    for call in (lambda: unbound.epsilon_at(1e-5), lambda: unbound.delta_at(1.0), lambda: unbound.sensitivity):
        with pytest.raises(dpftrl_acc.UnboundMechanismError, match="no participation context.*balls_in_bins.*give n_steps"):
            call()
    assert issubclass(dpftrl_acc.UnboundMechanismError, ValueError)


def test_bind_gives_the_bound_mechanism():
    unbound = dpftrl_acc.mf_gaussian(1.2, HAND_BLT)
    bound = unbound.bind(10, 2, 3)
    direct = dpftrl_acc.mf_gaussian(1.2, HAND_BLT, n_steps=10, min_sep=2, max_participations=3)
    assert bound == direct
    assert bound.epsilon_at(1e-5) == direct.epsilon_at(1e-5)


@pytest.mark.parametrize("noise_multiplier", [0.0, -1.0, math.inf, math.nan])
def test_bad_noise_multiplier_is_refused(noise_multiplier):
    with pytest.raises(ValueError, match="noise_multiplier must be finite and > 0.*calibrate"):
        dpftrl_acc.mf_gaussian(noise_multiplier, identity_strategy(), n_steps=10)


def test_bad_strategy_and_context_are_refused():
    with pytest.raises(TypeError, match="strategy must be a strategy recipe.*blt_strategy"):
        dpftrl_acc.mf_gaussian(1.0, "blt", n_steps=10)
    with pytest.raises(ValueError, match="without n_steps; give n_steps too.*amplifier"):
        dpftrl_acc.mf_gaussian(1.0, identity_strategy(), min_sep=5)
    with pytest.raises(ValueError, match="without n_steps"):
        dpftrl_acc.mf_gaussian(1.0, identity_strategy(), max_participations=2)
    with pytest.raises(ValueError, match="min_sep must be <= n_steps"):
        dpftrl_acc.mf_gaussian(1.0, identity_strategy(), n_steps=10, min_sep=11)
    with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
        dpftrl_acc.mf_gaussian(1.0, identity_strategy(), n_steps=10).epsilon_at(0.0)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0"):
        dpftrl_acc.mf_gaussian(1.0, identity_strategy(), n_steps=10).delta_at(-1.0)


def test_calibrating_mf_gaussian_scales_by_the_sensitivity():
    import opake.accounting as acc

    strategy = identity_strategy()
    budget = acc.epsilon_budget(2.0, 1e-5)
    result = acc.calibrate(
        budget, lambda s: dpftrl_acc.mf_gaussian(s, strategy, n_steps=100, min_sep=25), 0.1, 100.0
    )
    # k' = 4 participations: S = 2, so the answer is twice the plain Gaussian's sigma
    assert result.param == pytest.approx(2 * dp_accounting.get_sigma_gaussian(2.0, 1e-5), rel=2e-6)
    assert result.epsilon <= 2.0
