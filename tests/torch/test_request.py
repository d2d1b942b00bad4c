"""The privacy request, ``PrivacySpec``: one frozen value that every front end builds.

It checks its fields once, with the words ``plan_privacy`` always used; it compares and hashes by
what the fields mean; ``plan_privacy``'s keyword form and ``make_private(privacy=spec)`` plan
exactly the run that ``plan_request`` plans from the value (same noise, epsilon and batches for
the same key); a request given both whole and as keywords is refused before anything is hooked.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake.dpftrl.clipping import AutomaticClipping, ClippingRuleError, FlatClipping
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.dpftrl.sampling import PrivacyUnits
from opake.errors import OpakeError
from opake.random import key
from opake.torch import PrivacyEngine, PrivacySpec, make_private, plan_privacy, plan_request, strategy_for_optimizer
from opake.errors import PlanError

# A request that plans without calibration (a given noise multiplier, a named strategy): milliseconds.
GIVEN = dict(batch_size=5, epochs=2, max_grad_norm=1.0, noise_multiplier=1.1, target_delta=1e-5,
             strategy=band_mf_strategy(bands=2), sampling="poisson")


def spec(**overrides) -> PrivacySpec:
    return PrivacySpec(**{**GIVEN, **overrides})


# -- checked once, in plan_privacy's words -------------------------------------------------------------------


@pytest.mark.parametrize("overrides, error, pattern", [
    (dict(batch_size=0), ValueError, r"batch_size must be >= 1, got 0"),
    (dict(epochs=1.5), TypeError, r"epochs must be an integer"),
    (dict(sampling="uniform"), PlanError, r"sampling must be one of \('balls_in_bins', 'poisson'\)"),
    (dict(amplification="yes"), TypeError, r"amplification must be None \(the proven default\), True or False"),
    (dict(amplification=False), PlanError, r"amplification=False applies to sampling='balls_in_bins'"),
    (dict(max_grad_norm=0.0), ValueError, r"max_grad_norm must be finite and > 0"),
    (dict(clipping="per_layer"), ClippingRuleError, r"clipping must be one of"),
    (dict(max_grad_norm=AutomaticClipping(1.0), clipping="flat"), ClippingRuleError, r"contradicts the clipping rule"),
    (dict(target_delta=None), TypeError, r"needs target_delta"),
    (dict(target_epsilon=3.0), TypeError, r"exactly one of target_epsilon"),
    (dict(noise_multiplier=None), TypeError, r"exactly one of target_epsilon"),
    (dict(noise_multiplier=-1.0), ValueError, r"noise_multiplier must be finite and > 0"),
    (dict(target_delta=1.5), ValueError, r"target_delta must be in the open interval \(0, 1\)"),
    (dict(strategy="blt:3"), PlanError, r"'blt:3' is not a strategy opake knows by name"),
    (dict(strategy="band_mf:0"), PlanError, r"not a strategy opake knows by name"),
    (dict(privacy_unit="user_id"), TypeError, r"privacy_unit takes one id per example"),
])
def test_a_bad_request_is_refused_when_it_is_built(overrides, error, pattern):
    with pytest.raises(error, match=pattern) as refused:
        spec(**overrides)
    assert isinstance(refused.value, OpakeError)


def test_the_budget_is_checked_with_the_delta():
    with pytest.raises(ValueError, match="delta"):
        spec(noise_multiplier=None, target_epsilon=3.0, target_delta=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        spec(noise_multiplier=None, target_epsilon=-1.0)


def test_plan_privacy_refuses_with_the_same_words():
    with pytest.raises(PlanError, match=r"sampling must be one of"):
        plan_privacy(num_examples=20, key=key(0), **{**GIVEN, "sampling": "uniform"})
    with pytest.raises(TypeError, match=r"key must be an opake.random.RngKey"):
        plan_request(spec(), num_examples=20, key=0)
    with pytest.raises(TypeError, match=r"request must be an opake.torch.PrivacySpec"):
        plan_request(GIVEN, num_examples=20, key=key(0))


# -- a value -----------------------------------------------------------------------------------------------


def test_a_request_compares_and_hashes_by_what_it_means():
    assert spec() == spec() and hash(spec()) == hash(spec())
    flat = spec(max_grad_norm=FlatClipping(1.0))
    assert flat == spec() and hash(flat) == hash(spec()) and flat.clipping_rule == FlatClipping(1.0)
    automatic = spec(clipping="automatic")
    assert automatic != spec() and automatic == spec(max_grad_norm=AutomaticClipping(1.0))
    assert spec(max_grad_norm=2.0) != spec()
    assert spec(strategy="dp_sgd").strategy == identity_strategy()
    assert spec(strategy="band_mf:2") == spec() and spec(strategy="band_mf:3") != spec()
    assert spec(strategy="blt").strategy == "blt"   # fitted to the optimizer by the planner
    ids = [3, 1, 3, 2, 1] * 4
    by_ids = spec(privacy_unit=ids)
    assert by_ids.privacy_unit == ids  # the form given, kept for the planner's words on a mismatch
    assert isinstance(by_ids.units, PrivacyUnits) and by_ids.units.num_units == 3
    assert by_ids == spec(privacy_unit=PrivacyUnits.from_ids(ids)) == spec(privacy_unit=torch.tensor(ids))
    assert hash(by_ids) == hash(spec(privacy_unit=np.array(ids)))
    assert by_ids != spec() and by_ids != spec(privacy_unit=[1, 3, 3, 2, 1] * 4)
    assert spec(privacy_unit=iter(ids)) == by_ids  # an iterator is read once
    assert len({spec(), flat, automatic, by_ids}) == 3


def test_a_request_is_frozen_and_rebuilt_from_its_settings():
    request = spec(clipping="automatic", privacy_unit=[0, 1] * 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.epochs = 3
    assert PrivacySpec(**request.settings()) == request
    longer = dataclasses.replace(request, epochs=3)
    assert longer.epochs == 3 and longer.clipping_rule == request.clipping_rule and longer != request


# -- the keyword forms plan the value's run ----------------------------------------------------------------


def _same_run(first, second, steps=6):
    for name in ("noise_multiplier", "epsilon", "delta", "participation", "strategy", "clipping", "accounting",
                 "steps_per_epoch", "privacy_unit", "sampling", "expected_batch_size", "loss"):
        assert getattr(first, name) == getattr(second, name), name
    assert first.request == second.request
    for step in range(steps):
        assert torch.equal(first.sampler.batch(step), second.sampler.batch(step))


@pytest.mark.parametrize("overrides", [
    {},
    dict(strategy=identity_strategy(), sampling="balls_in_bins", clipping="automatic"),
    dict(strategy=blt_strategy(max_buffers=2), sampling=None, privacy_unit=[i // 2 for i in range(40)]),
    dict(strategy=None, sampling=None, noise_multiplier=None, target_epsilon=4.0),  # the least-noise choice
])
def test_plan_privacy_keywords_plan_the_requests_run(overrides):
    settings = {**GIVEN, **overrides}
    from_keywords = plan_privacy(num_examples=40, key=key(5), **settings)
    from_value = plan_request(PrivacySpec(**settings), num_examples=40, key=key(5))
    _same_run(from_keywords, from_value)
    assert from_keywords.request == PrivacySpec(**settings)
    assert from_keywords.n_steps == settings["epochs"] * from_keywords.steps_per_epoch


def test_the_named_blt_is_the_optimizers_blt_even_with_a_budget():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = plan_request(spec(strategy="blt", sampling=None, noise_multiplier=None, target_epsilon=4.0),
                        num_examples=40, key=key(0), optimizer=optimizer)
    assert plan.choice is None  # named: no comparison
    assert plan.strategy == strategy_for_optimizer(optimizer, plan.n_steps)
    assert plan.epsilon <= 4.0


def _model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), dataset


def _train_one_epoch(private):
    for x, y in private.data_loader:
        private.optimizer.zero_grad()
        if len(y):
            F.cross_entropy(private.module(x), y).backward()
        private.optimizer.step()
    return {name: p.detach().clone() for name, p in private.module.named_parameters()}


def test_make_private_with_the_request_trains_as_with_its_keywords():
    settings = {**GIVEN, "privacy_unit": [i // 2 for i in range(40)]}
    model, optimizer, dataset = _model_and_data()
    by_keywords = make_private(module=model, optimizer=optimizer, dataset=dataset, key=key(9), **settings)
    trained_by_keywords = _train_one_epoch(by_keywords)
    model, optimizer, dataset = _model_and_data()
    by_value = make_private(module=model, optimizer=optimizer, dataset=dataset, key=key(9),
                            privacy=PrivacySpec(**settings))
    trained_by_value = _train_one_epoch(by_value)
    _same_run(by_keywords.plan, by_value.plan)
    assert by_value.plan.request == PrivacySpec(**settings) and by_value.plan.units.num_units == 20
    for name, value in trained_by_keywords.items():
        assert torch.equal(value, trained_by_value[name]), name


@pytest.mark.parametrize("conflict, pattern", [
    (dict(noise_multiplier=1.1), r"privacy=PrivacySpec\(...\) and the keyword\(s\) noise_multiplier"),
    (dict(batch_size=5, target_delta=1e-5), r"keyword\(s\) batch_size, target_delta"),
    (dict(privacy_unit=[0] * 40), r"keyword\(s\) privacy_unit"),
])
def test_a_request_given_whole_and_as_keywords_is_refused_before_anything_is_hooked(conflict, pattern):
    model, optimizer, dataset = _model_and_data()
    with pytest.raises(TypeError, match=pattern) as refused:
        make_private(module=model, optimizer=optimizer, dataset=dataset, key=key(0), privacy=spec(), **conflict)
    assert isinstance(refused.value, OpakeError)
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    with pytest.raises(TypeError, match="privacy must be an opake.torch.PrivacySpec, got dict"):
        make_private(module=model, optimizer=optimizer, dataset=dataset, key=key(0), privacy=dict(GIVEN))


def test_the_opacus_engine_builds_the_request_of_its_arguments():
    model, optimizer, dataset = _model_and_data()
    engine = PrivacyEngine()
    engine.make_private(module=model, optimizer=optimizer, noise_multiplier=1.1, max_grad_norm=1.0, epochs=2,
                        data_loader=torch.utils.data.DataLoader(dataset, batch_size=5), key=key(0))
    assert engine.private.plan.request == PrivacySpec(batch_size=5, epochs=2, max_grad_norm=1.0, noise_multiplier=1.1,
                                                      target_delta=1e-5, strategy=identity_strategy(),
                                                      sampling="poisson")


def test_a_horizon_in_steps_is_planned_exactly_and_calibrated_for_those_steps():
    """steps=27 with 20 steps an epoch: 27 planned steps (the second epoch cut after 7), the noise
    calibrated to the budget for them; the loader stops there. Control: 27 steps of the 2-epoch plan
    spend less than the target, with more noise."""
    import opake.random
    from opake.dpftrl.noise import blt_strategy
    from opake.torch import plan_privacy

    settings = dict(num_examples=400, batch_size=20, max_grad_norm=1.0, key=opake.random.key(0),
                    target_epsilon=4.0, target_delta=1e-5, strategy=blt_strategy())
    cut = plan_privacy(steps=27, **settings)
    whole = plan_privacy(epochs=2, **settings)
    assert (cut.n_steps, cut.epochs, cut.steps_per_epoch) == (27, 2, 20)
    assert cut.participation.max_participations == 2 and cut.participation.min_sep == 20
    assert 4.0 * (1 - 1e-3) <= cut.epsilon <= 4.0 and cut.noise_multiplier < whole.noise_multiplier
    with pytest.raises(TypeError, match="not both"):
        PrivacySpec(batch_size=20, epochs=2, steps=27, max_grad_norm=1.0, target_epsilon=4.0, target_delta=1e-5)
    with pytest.raises(ValueError, match="steps"):
        PrivacySpec(batch_size=20, steps=0, max_grad_norm=1.0, target_epsilon=4.0, target_delta=1e-5)
