"""noise_fn.check_accounted_by: the accountant must have priced exactly the noise that runs."""

from __future__ import annotations

import pytest
import torch

from opake.dpftrl.accounting import mf_gaussian
from opake.dpftrl.noise import blt_strategy, identity_strategy, mf_gaussian_noise
from opake.random import key

CONTEXT = dict(n_steps=60, min_sep=10, max_participations=3)


def _noise(strategy, sigma=2.0, **context):
    noise_fn, _ = mf_gaussian_noise(torch.zeros(4), strategy, noise_multiplier=sigma, key=key(0),
                                    **(context or CONTEXT))
    return noise_fn


def test_same_recipe_context_and_multiplier_agree():
    strategy = blt_strategy(max_buffers=2)
    _noise(strategy).check_accounted_by(mf_gaussian(2.0, strategy, **CONTEXT))


@pytest.mark.parametrize("process, what", [
    (mf_gaussian(2.0, blt_strategy(max_buffers=2), n_steps=60, min_sep=10, max_participations=4), "mechanism"),
    (mf_gaussian(2.0, identity_strategy(), **CONTEXT), "mechanism"),
    (mf_gaussian(1.5, blt_strategy(max_buffers=2), **CONTEXT), "noise_multiplier"),
])
def test_disagreements_are_refused(process, what):
    with pytest.raises(ValueError, match=f"accounting and noise disagree.*{what}"):
        _noise(blt_strategy(max_buffers=2)).check_accounted_by(process)


def test_a_schedule_that_changed_is_detected():
    scale = {"value": 1.0}
    strategy = blt_strategy(max_buffers=2, lr_schedule=lambda t: scale["value"] / (1 + t))
    process = mf_gaussian(2.0, strategy, **CONTEXT)
    scale["value"] = 3.0  # the schedule returns other values by the time the noise is built
    with pytest.raises(ValueError, match="mechanism"):
        _noise(strategy).check_accounted_by(process)


def test_unbound_accountant_is_refused():
    with pytest.raises(ValueError, match="unbound"):
        _noise(identity_strategy()).check_accounted_by(mf_gaussian(2.0, identity_strategy()))
