"""What Opacus' own ``privacy_engine_test.py`` checks of its ``PrivacyEngine``, as our tests of the adapter.

Each test here is a public behaviour that file relies on (benchmarks/peers/opacus_own_tests.py
runs the file itself): ``poisson_sampling=False`` without ``epochs=`` (priced epoch by epoch, against
an independent float64 Monte Carlo of the random allocation); a clipping-only run on the loader's
own batches, with ``p.summed_grad`` and ``p.grad_sample``; ``clipping="per_layer"`` (each parameter
clipped to its bound, priced at ``sqrt(sum C_p^2)``: the same epsilon as flat clipping there, and
dp_accounting's PLD); ``batch_first=False`` with ``DPMultiheadAttention``; a noise-free checkpoint
loaded into a noised run (epsilon infinite after), the schedulers; Opacus' parameter-mismatch error.
"""

from __future__ import annotations

import io
import math
import warnings

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from torch import nn

from opake.dpftrl.clipping import ClippingRuleError, PerLayerClipping, clipped_grad
from opake.random import key
from opake.torch import PrivacyEngine
from opake.torch.opacus import (DPMultiheadAttention, ScheduleChangesPlanError, StepGradClip, StepNoise,
                                are_state_dict_equal)
from opake.torch.opacus.no_noise import LoaderBatches, NoiseFreeWeightsTraining
from opake.torch.opacus.unplanned import UNPLANNED_EPOCHS, UnplannedEpochsTraining


def _dataset(count=64, seed=0, features=5):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, features, generator=generator, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _engine(noise_multiplier=1.0, *, batch_size=8, count=64, seed=0, quiet=True, **options):
    model = _model(seed)
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        returned = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(_dataset(count), batch_size=batch_size),
            noise_multiplier=noise_multiplier, **{"max_grad_norm": 1.0, "key": key(seed), **options})
    return engine, returned


def _steps(model, optimizer, loader, steps):
    taken = 0
    for x, y in loader:
        if taken == steps:
            break
        optimizer.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        taken += 1
    return taken


# --- poisson_sampling=False without epochs=: priced epoch by epoch ------------------------------------

def _allocation_delta(epsilon, sigma, bins, samples=400_000, seed=0):
    """An independent float64 Monte Carlo of delta(epsilon) for one example in one random bin of
    ``bins`` Gaussian releases of noise multiplier ``sigma`` (add/remove, the larger direction):
    P = the mixture over the bin i of N(e_i / sigma, I), Q = N(0, I), L = log dP/dQ."""
    rng = np.random.default_rng(seed)
    shift = np.eye(bins)[rng.integers(bins, size=samples)] / sigma

    def loss(x):
        return np.log(np.mean(np.exp(x / sigma - 0.5 / sigma**2), axis=1))

    from_p = loss(rng.standard_normal((samples, bins)) + shift)
    from_q = -loss(rng.standard_normal((samples, bins)))
    return max(np.mean(np.maximum(0.0, 1.0 - np.exp(epsilon - from_p))),
               np.mean(np.maximum(0.0, 1.0 - np.exp(epsilon - from_q))))


def test_balls_in_bins_without_epochs_is_priced_epoch_by_epoch_against_an_independent_reference():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=1.0, poisson_sampling=False)
    private = engine.private
    assert isinstance(private, UnplannedEpochsTraining) and private.plan.sampling == "balls_in_bins"
    assert private.plan.n_steps == UNPLANNED_EPOCHS * 8 and engine.get_epsilon(1e-2) == 0.0
    _steps(model, optimizer, loader, 3)                       # a part of the first epoch: priced as the epoch
    first = engine.get_epsilon(1e-2)
    _steps(model, optimizer, loader, 8)                       # the rest of it
    assert engine.get_epsilon(1e-2) == first
    # Independent: one random bin of 8 Gaussian releases at sigma 1 (the delta at opake's epsilon is at
    # most the target, and not far below it: the bound is tight).
    assert 0.8e-2 < _allocation_delta(first, 1.0, 8) < 1.03e-2
    for _ in range(2):
        _steps(model, optimizer, loader, 8)
    third = engine.get_epsilon(1e-2)
    # Each example keeps its bin: three epochs are one random allocation at sigma / sqrt(3).
    assert 0.8e-2 < _allocation_delta(third, 1.0 / math.sqrt(3), 8) < 1.03e-2
    assert first < third < private.plan.epsilon
    # The same figure as the run planned for exactly three epochs.
    planned, _ = _engine(noise_multiplier=1.0, poisson_sampling=False, epochs=3)
    assert third == pytest.approx(planned.private.plan.accountant.epsilon_at(1e-2), rel=1e-12)


def test_correlated_noise_still_needs_epochs():
    from opake.dpftrl.noise import blt_strategy

    with pytest.raises(TypeError, match="DP-SGD only.*add epochs=EPOCHS"):
        _engine(strategy=blt_strategy(), poisson_sampling=False)


# --- the clipping-only run: the loader's own batches, summed_grad, grad_sample --------------------------

def test_a_noise_free_run_without_poisson_trains_on_the_loaders_own_batches_as_a_plain_run():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=0.0, poisson_sampling=False, max_grad_norm=1e9)
    assert isinstance(engine.private.run.batches, LoaderBatches)
    plain = _model()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for (x, y), (px, py) in zip(loader, torch.utils.data.DataLoader(_dataset(), batch_size=8)):
        assert torch.equal(x, px) and torch.equal(y, py)      # the DataLoader's batches, in its order
        for m, o, (a, b) in ((model, optimizer, (x, y)), (plain, plain_optimizer, (px, py))):
            o.zero_grad()
            nn.functional.cross_entropy(m(a), b).backward()
            o.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert engine.get_epsilon(1e-5) == math.inf and engine.accountant.history == [(0.0, None, 8)]


def test_summed_grad_and_grad_sample_are_the_clipped_sum_and_the_examples_own_gradients():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=0.0, poisson_sampling=False, max_grad_norm=0.3)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    plain = _model()                                          # the same weights, no hooks
    own = [torch.autograd.grad(nn.functional.cross_entropy(plain(x[i:i + 1]), y[i:i + 1]), list(plain.parameters()))
           for i in range(len(x))]                            # a loop of single examples
    for index, p in enumerate(model.parameters()):
        expected = torch.stack([grads[index] for grads in own])
        torch.testing.assert_close(p.grad_sample, expected, rtol=1e-10, atol=1e-12)
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in grads)) for grads in own])
    factors = torch.clamp(0.3 / norms, max=1.0)
    for index, p in enumerate(model.parameters()):
        clipped = sum(f * grads[index] for f, grads in zip(factors, own))
        torch.testing.assert_close(p.summed_grad, clipped, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p.grad, clipped / 8, rtol=1e-10, atol=1e-12)
    optimizer.zero_grad()
    assert all(p.summed_grad is None and p.grad_sample is None for p in model.parameters())


def test_a_noised_run_keeps_no_per_example_gradients():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=1.0)
    _steps(model, optimizer, loader, 1)
    assert not hasattr(model[0].weight, "grad_sample") or model[0].weight.grad_sample is None
    assert model[0].weight.summed_grad is not None


# --- per-layer clipping ---------------------------------------------------------------------------------

def test_per_layer_clipping_clips_each_parameter_to_its_own_bound():
    bounds = [0.05, 0.01, 0.2, 0.02]
    engine, (model, optimizer, loader) = _engine(noise_multiplier=0.0, poisson_sampling=False, clipping="per_layer",
                                                 max_grad_norm=bounds)
    x, y = next(iter(loader))
    optimizer.signal_skip_step()
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    plain = _model()                                          # the same weights, no hooks
    for p, q, bound in zip(model.parameters(), plain.parameters(), bounds):
        expected = 0
        for i in range(len(x)):
            g = torch.autograd.grad(nn.functional.cross_entropy(plain(x[i:i + 1]), y[i:i + 1]), q)[0]
            expected = expected + g * min(1.0, bound / float(g.norm()))
        torch.testing.assert_close(p.summed_grad, expected, rtol=1e-10, atol=1e-12)
    assert optimizer.max_grad_norm == pytest.approx(math.sqrt(sum(b * b for b in bounds)), rel=1e-15)


def test_per_layer_clipping_is_priced_at_the_root_sum_of_squares_of_the_bounds():
    bounds = [0.6, 0.8, 0.0 + 1.2, 0.4]
    sensitivity = math.sqrt(sum(b * b for b in bounds))
    per_layer, (model, optimizer, loader) = _engine(noise_multiplier=1.5, clipping="per_layer", max_grad_norm=bounds,
                                                    epochs=2)
    flat, _ = _engine(noise_multiplier=1.5, max_grad_norm=sensitivity, epochs=2)
    assert per_layer.private.plan.max_grad_norm == pytest.approx(sensitivity, rel=1e-15)
    assert per_layer.private.epsilon == flat.private.epsilon
    independent = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    independent.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(8 / 64, dp_accounting.GaussianDpEvent(1.5)), 16))
    assert per_layer.private.epsilon == pytest.approx(independent.get_epsilon(per_layer.private.delta), rel=1e-9)
    # The noise is scaled to that sensitivity: released noise of zero gradients, per coordinate.
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    draws = []
    for x, _ in loader:
        optimizer.zero_grad()
        (0 * model(x).sum()).backward()                       # zero gradients: the step releases noise only
        optimizer.step()
        draws.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if len(draws) == 8:
            break
    spread = torch.cat(draws).std().item()
    assert spread == pytest.approx(1.5 * sensitivity / 8, rel=0.2)


def test_per_layer_clipping_needs_one_bound_per_trainable_parameter():
    with pytest.raises(ValueError, match="one bound per trainable parameter"):
        _engine(clipping="per_layer", max_grad_norm=[1.0, 1.0])
    with pytest.raises(ValueError, match="clipping='per_layer'"):
        _engine(max_grad_norm=[1.0] * 4)
    with pytest.raises(ClippingRuleError, match="per-example hooks"):
        rule = PerLayerClipping((("w", 1.0),))
        grad_fn, state = clipped_grad(lambda params, x: (params["w"] * x).sum(), clipping_norm=rule)
        grad_fn({"w": torch.ones(2)}, torch.ones(3, 2), state=state)


# --- batch_first=False with DPMultiheadAttention --------------------------------------------------------

class _SequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8)
        self.attn = DPMultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 1)

    def forward(self, x):                                     # x: (T, B) token indices
        h, _ = self.attn(*(self.emb(x),) * 3)
        return self.fc(h).squeeze(-1).transpose(0, 1)          # (B, T)


def test_dp_multihead_attention_computes_what_nn_multihead_attention_does():
    torch.manual_seed(1)
    reference = nn.MultiheadAttention(8, 2)
    ours = DPMultiheadAttention(8, 2)
    with torch.no_grad():
        for index, projection in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            projection.weight.copy_(reference.in_proj_weight[8 * index:8 * (index + 1)])
            projection.bias.copy_(reference.in_proj_bias[8 * index:8 * (index + 1)])
        ours.out_proj.load_state_dict(reference.out_proj.state_dict())
    q, k = torch.randn(5, 3, 8), torch.randn(7, 3, 8)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[:, -2:] = True
    expected, expected_weights = reference(q, k, k, key_padding_mask=mask)
    output, weights = ours(q, k, k, key_padding_mask=mask)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


def test_batch_first_false_clips_each_example_of_a_sequence_first_model():
    tokens = torch.randint(0, 20, (64, 6), generator=torch.Generator().manual_seed(0))
    dataset = torch.utils.data.TensorDataset(tokens, torch.randn(64, 6))
    collate = (lambda rows: (torch.stack([r[0] for r in rows]).transpose(0, 1), torch.stack([r[1] for r in rows])))
    model = _SequenceFirst()
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=collate),
            noise_multiplier=0.0, max_grad_norm=0.01, batch_first=False, poisson_sampling=False)
    x, y = next(iter(loader))
    assert x.shape == (6, 8)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    params = [p for p in model.parameters() if p.requires_grad]
    plain = _SequenceFirst()                                  # the same weights, no hooks
    own = [torch.autograd.grad(nn.functional.mse_loss(plain(x[:, i:i + 1]), y[i:i + 1]), list(plain.parameters()))
           for i in range(8)]
    for index, p in enumerate(params):
        torch.testing.assert_close(p.grad_sample, torch.stack([grads[index] for grads in own]),
                                   rtol=1e-4, atol=1e-6)
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in grads)) for grads in own])
    for index, p in enumerate(params):
        clipped = sum(min(1.0, 0.01 / float(n)) * grads[index] for n, grads in zip(norms, own))
        torch.testing.assert_close(p.summed_grad, clipped, rtol=1e-4, atol=1e-7)


def test_batch_first_false_refuses_layers_that_do_not_act_on_each_position_alone():
    model = nn.Sequential(nn.Conv1d(3, 3, 1), nn.Flatten(), nn.Linear(6, 2))
    engine = PrivacyEngine()
    dataset = torch.utils.data.TensorDataset(torch.randn(16, 3, 2), torch.randint(0, 2, (16,)))
    with pytest.raises(ValueError, match="batch_first=False.*Conv1d"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=torch.utils.data.DataLoader(dataset, batch_size=4), noise_multiplier=1.0,
                            max_grad_norm=1.0, batch_first=False)
    assert not model._forward_hooks and engine.private is None


# --- checkpoints: a noise-free run's into a noised one; the schedulers ---------------------------------

def test_a_noise_free_checkpoint_makes_the_noised_run_it_is_loaded_into_noise_free():
    saver, (m1, opt1, dl1) = _engine(noise_multiplier=0.0, poisson_sampling=False, seed=1)
    loader_engine, (m2, opt2, _) = _engine(noise_multiplier=2.0, poisson_sampling=False, seed=2)
    noise1, clip1 = StepNoise(optimizer=opt1, step_size=1, gamma=1.0), StepGradClip(optimizer=opt1, step_size=1)
    noise2 = StepNoise(optimizer=opt2, step_size=1, gamma=2.0)
    _steps(m1, opt1, dl1, 8)
    noise1.step()                                             # 0 stays 0: accepted
    with io.BytesIO() as buffer:
        saver.save_checkpoint(path=buffer, module=m1, optimizer=opt1, noise_scheduler=noise1,
                              grad_clip_scheduler=clip1, checkpoint_dict={"epoch": 3})
        buffer.seek(0)
        rest = loader_engine.load_checkpoint(path=buffer, module=m2, optimizer=opt2, noise_scheduler=noise2)
    assert rest == {"epoch": 3} and are_state_dict_equal(m1.state_dict(), m2.state_dict())
    assert noise2.state_dict() == noise1.state_dict() and opt2.noise_multiplier == 2.0
    assert isinstance(loader_engine.private, NoiseFreeWeightsTraining)
    assert loader_engine.get_epsilon(1e-5) == math.inf and loader_engine.private.epsilon == math.inf
    assert loader_engine.accountant.state_dict() == saver.accountant.state_dict() == {"history": [(0.0, None, 8)]}
    third, _ = _engine(noise_multiplier=2.0, poisson_sampling=False, seed=2)
    with io.BytesIO() as buffer:                               # its own checkpoint is a noise-free one in turn
        loader_engine.save_checkpoint(path=buffer, module=m2)
        buffer.seek(0)
        third.load_checkpoint(path=buffer, module=third.private.module, draws="replay")
        buffer.seek(0)
        with pytest.raises(ValueError, match="trained without noise"):
            loader_engine.load_checkpoint(path=buffer, module=m2, draws="replay")
    assert third.get_epsilon(1e-5) == math.inf


def test_schedulers_refuse_to_change_the_planned_values():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=1.0)
    noise = StepNoise(optimizer=optimizer, step_size=2, gamma=0.5)
    noise.step()                                              # step 1: not a multiple of 2, unchanged
    with pytest.raises(ScheduleChangesPlanError, match="from 1.0 to 0.5"):
        noise.step()
    assert optimizer.noise_multiplier == 1.0 and noise.last_epoch == 1
    clip = StepGradClip(optimizer=optimizer, step_size=1, gamma=1.0)
    clip.step()
    assert optimizer.max_grad_norm == 1.0


# --- Opacus' check of the optimizer's parameters, in its words ------------------------------------------

def test_an_optimizer_over_other_parameters_is_refused_in_opacus_words():
    model, other = _model(), _model()
    with pytest.raises(ValueError, match="Module parameters are different than optimizer Parameters"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                                     data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=8),
                                     noise_multiplier=1.0, max_grad_norm=1.0)


# --- adaptive clipping (Andrew et al. 2021, Opacus' AdaClip) --------------------------------------------

_ADACLIP = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=50.0, min_clipbound=0.05,
                unclipped_num_std=8 / 4)


@pytest.mark.parametrize("sigma, count_std", [(1.0, 0.6), (0.8, 3.2), (2.5, 1.3)])
def test_the_gradients_and_the_count_share_sigma_exactly(sigma, count_std):
    from opake.torch.opacus.adaptive import gradient_noise_multiplier

    sigma_g = gradient_noise_multiplier(sigma, count_std)
    assert sigma_g > sigma and sigma_g ** -2 + (2 * count_std) ** -2 == pytest.approx(sigma ** -2, rel=1e-13)
    # Independent: dp_accounting's PLD of the two Gaussian releases (sensitivities C and 1/2, i.e. noise
    # multipliers sigma_g and 2 sigma_b) composed equals the single Gaussian at sigma.
    def epsilon(*sigmas):
        accountant = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                   value_discretization_interval=1e-4)
        accountant.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(s) for s in sigmas]))
        return accountant.get_epsilon(1e-5)

    assert epsilon(sigma_g, 2 * count_std) == pytest.approx(epsilon(sigma), rel=2e-3)
    assert epsilon(sigma_g, count_std) > 1.02 * epsilon(sigma)      # control: the count's sensitivity 1/2 matters


def test_adaptive_clipping_is_priced_at_sigma_and_noises_the_gradients_at_sigma_g():
    from opake.torch.opacus.adaptive import gradient_noise_multiplier

    engine, (model, optimizer, loader) = _engine(noise_multiplier=1.2, clipping="adaptive", max_grad_norm=0.5,
                                                 epochs=2, **_ADACLIP)
    flat, _ = _engine(noise_multiplier=1.2, max_grad_norm=0.5, epochs=2)
    assert engine.private.epsilon == flat.private.epsilon
    independent = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    independent.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(8 / 64, dp_accounting.GaussianDpEvent(1.2)), 16))
    assert engine.private.epsilon == pytest.approx(independent.get_epsilon(engine.private.delta), rel=1e-9)
    sigma_g = gradient_noise_multiplier(1.2, _ADACLIP["unclipped_num_std"])
    assert optimizer.noise_multiplier == pytest.approx(sigma_g, rel=1e-15)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    draws, bounds = [], []
    for x, _ in loader:
        bounds.append(optimizer.max_grad_norm)
        optimizer.zero_grad()
        (0 * model(x).sum()).backward()                       # zero gradients: every example unclipped
        optimizer.step()
        draws.append(torch.cat([p.grad.flatten() / bounds[-1] for p in model.parameters()]))
    assert torch.cat(draws).std().item() == pytest.approx(sigma_g / 8, rel=0.2)
    assert bounds[0] == 0.5 and len(set(bounds)) == len(bounds)  # the bound moves every step


def test_the_count_noise_and_the_bound_update_are_opacus_rule():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=1.0, clipping="adaptive", max_grad_norm=1.0,
                                                 epochs=1, **_ADACLIP)
    adaptive = optimizer.adaptive
    draws = torch.tensor([adaptive.count_noise(step) for step in range(4000)], dtype=torch.float64)
    assert draws.std().item() == pytest.approx(_ADACLIP["unclipped_num_std"], rel=0.05)
    assert abs(draws.mean().item()) < 0.1 and adaptive.count_noise(3) == adaptive.count_noise(3)
    settings = adaptive.settings
    assert settings.next_bound(1.0, 0.7) == pytest.approx(math.exp(-0.2 * 0.2), rel=1e-15)
    assert settings.next_bound(0.05, 1.0) == 0.05 and settings.next_bound(50.0, 0.0) == 50.0


@pytest.mark.parametrize("changes, message", [
    (dict(unclipped_num_std=0.4), "2 \\* unclipped_num_std > noise_multiplier"),
    (dict(noise_multiplier=0.0), "DP-SGD with noise"),
    (dict(target_unclipped_quantile=None), "missing \\['target_unclipped_quantile'\\]"),
])
def test_adaptive_clipping_refusals(changes, message):
    options = {"noise_multiplier": 1.0, "clipping": "adaptive", **_ADACLIP, **changes}
    options = {name: value for name, value in options.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        _engine(**options)


def test_adaptive_clipping_needs_dp_sgd_and_a_noise_multiplier():
    from opake.dpftrl.noise import blt_strategy

    with pytest.raises(ValueError, match="DP-SGD with noise"):
        _engine(clipping="adaptive", strategy=blt_strategy(), epochs=1, **_ADACLIP)
    model = _model()
    with pytest.raises(ValueError, match="given noise multiplier"):
        PrivacyEngine().make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=8), target_epsilon=2.0, target_delta=1e-5,
            epochs=1, max_grad_norm=1.0, clipping="adaptive", **_ADACLIP)


# --- an example whose gradient is not finite contributes nothing (Opacus' factor 0) ----------------------

def test_an_example_with_a_non_finite_gradient_contributes_zero():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=0.0, poisson_sampling=False, max_grad_norm=0.5)
    batches = iter(loader)
    x, y = next(batches)                                      # a first step with finite gradients (the
    optimizer.zero_grad()                                     # check that every use is hooked runs on it)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    plain = _model()                                          # the weights the second step starts from
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters()):
            p.copy_(q)
    x, y = next(batches)
    x = x.clone()
    x[2, 0] = math.inf                                        # example 2's gradient is not finite
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    expected = [0 for _ in plain.parameters()]
    for i in [i for i in range(len(x)) if i != 2]:
        grads = torch.autograd.grad(nn.functional.cross_entropy(plain(x[i:i + 1]), y[i:i + 1]), list(plain.parameters()))
        factor = min(1.0, 0.5 / float(torch.sqrt(sum(g.square().sum() for g in grads))))
        expected = [e + factor * g for e, g in zip(expected, grads)]
    for p, e in zip(model.parameters(), expected):
        assert torch.isfinite(p.summed_grad).all()
        torch.testing.assert_close(p.summed_grad, e, rtol=1e-10, atol=1e-12)
    # opake.torch.make_private itself still refuses such a gradient (its default)
    from opake.dpftrl.clipping import NonFiniteGradientError
    from opake.torch import make_private

    with pytest.raises(NonFiniteGradientError):
        model2 = _model()
        run = make_private(module=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1), dataset=_dataset(),
                           batch_size=8, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=0.5,
                           key=key(0), strategy="dp_sgd")
        batch_x, batch_y = next(iter(run.data_loader))
        batch_x = batch_x.clone()
        batch_x[0, 0] = math.inf
        nn.functional.cross_entropy(model2(batch_x), batch_y).backward()
        run.optimizer.step()


# --- a discriminator-style step (Opacus' examples/dcgan.py): refused, with the recipe --------------------

def test_a_generated_batch_backpropagated_before_the_step_is_refused_with_the_recipe():
    from opake.torch import UnplannedBatchError

    engine, (model, optimizer, loader) = _engine(noise_multiplier=1.0, poisson_sampling=False, epochs=1)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()                          # the real (planned) batch
    fake = torch.randn(8, 5, dtype=torch.float64)
    nn.functional.cross_entropy(model(fake), torch.zeros(8, dtype=torch.long)).backward()  # a generated one
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnplannedBatchError, match="GAN discriminator.*Backpropagate the real batch alone"):
        optimizer.step()
    assert engine.private.steps_taken == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_first_step_with_a_non_finite_gradient_is_released_and_the_coverage_check_waits():
    engine, (model, optimizer, loader) = _engine(noise_multiplier=0.0, poisson_sampling=False, max_grad_norm=0.5)
    batches = iter(loader)
    x, y = next(batches)
    x = x.clone()
    x[0, 0] = math.nan
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()                                          # example 0 dropped; the others clipped and summed
    assert all(torch.isfinite(p).all() for p in model.parameters()) and not optimizer._coverage_checked
    x, y = next(batches)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert optimizer._coverage_checked                        # checked on the first comparable step
