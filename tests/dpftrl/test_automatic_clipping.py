"""Automatic clipping (AUTO-S, Bu, Wang, Zha, Karypis, NeurIPS 2023, arXiv 2206.07136).

Oracles: the factors C / (||g|| + gamma) written out in numpy float64; per-example gradients from
a loop of batch-size-1 autograd backward passes, each scaled in float64 and summed (no opake code);
the removal of each example brute-forced for the bound. Negative controls: a rule that scales
0.1% too far is caught by the same bound check, flat clipping gives other sums, and a checkpoint
of one rule does not load into the other.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.clipping import (
    CLIPPING_MODES,
    AutomaticClipping,
    ClippingRuleError,
    FlatClipping,
    automatic_factors,
    clipped_grad,
    clipping_rule,
)
from opake.dpftrl.noise import blt_strategy, mf_gaussian_noise
from opake.dpftrl.sampling import BallsInBinsSampler
from opake.errors import OpakeError
from opake.random import key
from opake.torch import make_private, plan_privacy
from opake.torch.per_example import PerExampleClipper
from opake.types import clipped

GAMMA = 0.01


def _dot_loss(params, x):
    return (params * x).sum()  # the gradient of example x is x itself


# --- the factors against a dense reference ---------------------------------------------------------


@pytest.mark.parametrize("bound, stability", [(1.0, 0.01), (0.3, 0.01), (5.0, 1e-6), (1.0, 2.0)])
def test_factors_equal_the_written_out_formula(bound, stability):
    norms = np.concatenate([[0.0, 1e-300, 1e-12, stability, bound - stability, bound, 1e30, 1e300],
                            np.random.default_rng(1).lognormal(0.0, 3.0, 200)])
    factors, scaled_down = AutomaticClipping(bound, stability).factors(torch.tensor(norms, dtype=torch.float64))
    expected = np.array([bound / (norm + stability) for norm in norms.tolist()])
    np.testing.assert_allclose(factors.numpy(), expected, rtol=1e-15, atol=0)
    np.testing.assert_array_equal(scaled_down.numpy(), expected < 1)
    assert factors[0] == bound / stability                       # a zero gradient: finite, and it stays zero
    # Negative control: flat clipping's factors are another rule (1 below the bound).
    flat, _ = FlatClipping(bound).factors(torch.tensor(norms, dtype=torch.float64))
    assert not np.allclose(flat.numpy(), expected)


def test_three_four_five_by_hand():
    grad_fn, state = clipped_grad(_dot_loss, 1.0, clipping="automatic")
    grads, state = grad_fn(torch.zeros(2, dtype=torch.float64), torch.tensor([[3.0, 4.0]], dtype=torch.float64),
                           state=state)
    torch.testing.assert_close(grads.pytree, torch.tensor([3.0, 4.0], dtype=torch.float64) / 5.01, rtol=0, atol=1e-16)
    assert grads.l2_bound == 1.0 and state.clipped_examples == 1


# --- the bound: no unit moves the clipped sum by more than C -------------------------------------------


def _adversarial_batch(width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(width, dtype=torch.float64)]                                  # zero gradient
    for scale in (1e-300, 1e-160, 1e-9, 1e-3, 0.0099, 0.01, 0.5, 0.99, 1.0, 1.01, 7.0, 1e8, 1e150, 1e300):
        direction = torch.randn(width, generator=generator, dtype=torch.float64)
        rows.append(direction / direction.norm() * scale)
    rows.append(torch.full((width,), 1e300 / math.sqrt(width), dtype=torch.float64))  # norm near float64's top
    spike = torch.zeros(width, dtype=torch.float64)
    spike[0] = 1.7e308                                                                # one huge coordinate
    rows.append(spike)
    rows.extend(torch.randn(24, width, generator=generator, dtype=torch.float64) * 10.0 ** torch.randint(
        -6, 7, (24, 1), generator=generator).double())
    return torch.stack(rows)


def _worst_removal(rule, batch: torch.Tensor) -> tuple[float, float]:
    """Over every example: the largest move of the sum when it is removed, and its largest norm alone."""
    grad_fn, state = clipped_grad(_dot_loss, rule)
    params = torch.zeros(batch.shape[1], dtype=torch.float64)
    full, _ = grad_fn(params, batch, state=state)
    worst_move = worst_alone = 0.0
    for removed in range(batch.shape[0]):
        rest = torch.cat([batch[:removed], batch[removed + 1:]])
        without, _ = grad_fn(params, rest, state=state)
        alone, _ = grad_fn(params, batch[removed:removed + 1], state=state)
        # The difference in float64 of sums near 1e0..1e1: measured in units of the bound.
        worst_move = max(worst_move, float(torch.linalg.vector_norm(full.pytree - without.pytree)))
        worst_alone = max(worst_alone, float(torch.linalg.vector_norm(alone.pytree)))
    return worst_move, worst_alone


@pytest.mark.parametrize("bound, stability", [(1.0, 0.01), (0.05, 0.01), (40.0, 0.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_example_moves_the_sum_by_more_than_the_bound(bound, stability, seed):
    batch = _adversarial_batch(6, seed)
    rule = AutomaticClipping(bound, stability)
    move, alone = _worst_removal(rule, batch)
    assert alone <= bound * (1 + 1e-15)
    assert move <= bound * (1 + 1e-12)
    assert rule.sensitivity == bound
    # Brute force, elementwise: every scaled norm C ||g|| / (||g|| + gamma) in exact arithmetic is < C.
    norms = batch.norm(dim=1)
    finite = torch.isfinite(norms)
    scaled = norms[finite] * rule.factors(norms[finite])[0]
    assert bool((scaled <= bound * (1 + 1e-15)).all())
    # Negative control: the same check catches a rule that scales 0.1% too far.
    class _TooFar(AutomaticClipping):
        def factors(self, norms):
            factors, mask = super().factors(norms)
            return factors * 1.001, mask

    too_far_move, too_far_alone = _worst_removal(_TooFar(bound, stability), batch)
    assert too_far_alone > bound * (1 + 5e-4) and too_far_move > bound * (1 + 5e-4)


# --- clipped_grad's automatic mode against a loop of batch-size-1 autograd gradients ----------------------


def _loop_reference(model_fn, params, xs, ys, bound, stability, normalize_by):
    names = list(params)
    total = {name: torch.zeros_like(params[name], dtype=torch.float64) for name in names}
    for index in range(xs.shape[0]):
        leaves = {name: params[name].detach().clone().double().requires_grad_(True) for name in names}
        loss = model_fn(leaves, xs[index].double(), ys[index])
        grads = torch.autograd.grad(loss, [leaves[name] for name in names])
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        factor = bound / (norm + stability)
        for name, g in zip(names, grads):
            total[name] += g * factor
    return {name: value / normalize_by for name, value in total.items()}


def _mlp_loss(params, x, y):
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return F.cross_entropy((hidden @ params["w2"])[None], y[None])


@pytest.mark.parametrize("bound", [0.1, 1.0, 30.0])
def test_clipped_grad_automatic_equals_the_loop(bound):
    generator = torch.Generator().manual_seed(4)
    params = {"w1": torch.randn(5, 4, generator=generator, dtype=torch.float64),
              "b1": torch.randn(4, generator=generator, dtype=torch.float64),
              "w2": torch.randn(4, 3, generator=generator, dtype=torch.float64)}
    xs = torch.randn(9, 5, generator=generator, dtype=torch.float64) * 3
    xs[2] = 0.0
    ys = torch.randint(0, 3, (9,), generator=generator)
    grad_fn, state = clipped_grad(_mlp_loss, bound, batch_argnums=(1, 2), normalize_by=4.5, clipping="automatic")
    grads, state = grad_fn(params, xs, ys, state=state)
    expected = _loop_reference(_mlp_loss, params, xs, ys, bound, GAMMA, 4.5)
    for name in params:
        torch.testing.assert_close(grads.pytree[name], expected[name], rtol=1e-12, atol=1e-14)
    assert grads.l2_bound == bound and grads.normalization == 4.5
    # The rule value is the same spelling.
    by_value, _ = clipped_grad(_mlp_loss, AutomaticClipping(bound), batch_argnums=(1, 2), normalize_by=4.5)
    again, _ = by_value(params, xs, ys, state=state)
    for name in params:
        torch.testing.assert_close(again.pytree[name], grads.pytree[name], rtol=0, atol=0)
    # Negative control: flat clipping at the same bound gives other sums.
    flat_fn, _ = clipped_grad(_mlp_loss, bound, batch_argnums=(1, 2), normalize_by=4.5)
    flat, _ = flat_fn(params, xs, ys, state=state)
    assert any(not torch.allclose(flat.pytree[name], grads.pytree[name]) for name in params)


# --- the hook path: PerExampleClipper and make_private against the loop ---------------------------------


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _functional(model):
    def loss(params, x, y):
        return F.cross_entropy(torch.func.functional_call(model, params, (x[None],)), y[None])
    return loss


def test_the_clipper_hooks_equal_the_loop():
    model = _model()
    generator = torch.Generator().manual_seed(8)
    xs = torch.randn(12, 5, generator=generator, dtype=torch.float64) * 4
    xs[0] = 0.0
    ys = torch.randint(0, 3, (12,), generator=generator)
    rule = AutomaticClipping(0.7, stability=0.05)
    clipper = PerExampleClipper(model, max_grad_norm=rule)
    F.cross_entropy(model(xs), ys).backward()
    ours = clipper.clipped_sum()
    clipper.remove()
    params = {name: p.detach() for name, p in model.named_parameters()}
    expected = _loop_reference(_functional(model), params, xs, ys, 0.7, 0.05, 1.0)
    for name in params:
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-10, atol=1e-13)


def test_make_private_automatic_steps_equal_the_loop_with_the_same_noise():
    """make_private(clipping="automatic") = balls in bins -> the loop's AUTO-S sums / B -> the same
    engine's noise -> SGD, step by step (float64 model)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(40, 5, generator=generator, dtype=torch.float64) * 2
    x[3] = 0.0
    y = torch.randint(0, 3, (40,), generator=generator)
    dataset = torch.utils.data.TensorDataset(x, y)
    strategy, bound = blt_strategy(max_buffers=3), 0.5
    model, reference_model = _model(), _model()
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=8, epochs=2, noise_multiplier=1.3, target_delta=1e-5, max_grad_norm=bound,
                           clipping="automatic", strategy=strategy, key=key(11))
    assert private.plan.clipping == AutomaticClipping(bound) and private.plan.max_grad_norm == bound
    released = []
    release = private.run.release
    private.run.release = lambda gradients: released.append(gradients) or release(gradients)
    for xb, yb in private.run_data_loader():
        private.optimizer.zero_grad()
        if len(yb):
            F.cross_entropy(model(xb), yb).backward()
        private.optimizer.step()

    root = key(11)
    sampler = BallsInBinsSampler(40, 5, root.fold_in("opake.torch.sampler"))
    context = sampler.participation(10)
    params = {name: p.detach().clone() for name, p in reference_model.named_parameters()}
    noise_fn, noise_state = mf_gaussian_noise(params, strategy, n_steps=10, min_sep=context.min_sep,
                                              max_participations=context.max_participations,
                                              noise_multiplier=1.3, key=root.fold_in("opake.torch.noise"))
    loss = _functional(reference_model)
    for step in range(10):
        batch = sampler.batch(step)
        sums = _loop_reference(loss, params, x[batch], y[batch], bound, GAMMA, sampler.expected_batch_size)
        noisy, noise_state = noise_fn(clipped(sums, bound, sampler.expected_batch_size), noise_state)
        params = {name: params[name] - 0.1 * noisy.pytree[name] for name in params}
        # What the private step handed to the noise: the bound C over the expected batch size.
        assert released[step].l2_bound == bound and released[step].normalization == sampler.expected_batch_size
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], rtol=1e-9, atol=1e-11)


# --- the accountant and the noise scale read the bound C only -----------------------------------------


def test_the_plan_prices_and_noises_automatic_clipping_as_flat_clipping_at_the_same_bound():
    arguments = dict(num_examples=200, batch_size=10, epochs=2, key=key(2), target_epsilon=3.0, target_delta=1e-5,
                     strategy=blt_strategy(max_buffers=2), sampling="balls_in_bins")
    automatic = plan_privacy(max_grad_norm=2.0, clipping="automatic", **arguments)
    flat = plan_privacy(max_grad_norm=2.0, **arguments)
    assert isinstance(automatic.clipping, AutomaticClipping) and isinstance(flat.clipping, FlatClipping)
    assert automatic.max_grad_norm == flat.max_grad_norm == 2.0
    assert automatic.noise_multiplier == flat.noise_multiplier and automatic.epsilon == flat.epsilon
    context = automatic.participation
    unamplified = dpftrl_acc.mf_gaussian(automatic.noise_multiplier, arguments["strategy"], context.n_steps,
                                         context.min_sep, context.max_participations)
    assert automatic.epsilon == pytest.approx(unamplified.epsilon_at(1e-5), rel=1e-12)


def test_the_private_optimizer_scales_the_noise_to_the_bound():
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 5, dtype=torch.float64), torch.randint(0, 3, (20,)))
    model = _model()
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=5, epochs=1, noise_multiplier=2.0, target_delta=1e-5,
                           max_grad_norm=AutomaticClipping(0.25, stability=0.02),
                           strategy=blt_strategy(max_buffers=2), key=key(0))
    assert private.optimizer.max_grad_norm == 0.25
    variances = []
    release = private.run.release

    def recording(gradients):
        noisy = release(gradients)
        variances.append((noisy.noise_variance, gradients))
        return noisy

    private.run.release = recording
    xb, yb = next(iter(private.data_loader))
    private.optimizer.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    private.optimizer.step()
    variance, gradients = variances[0]
    row_norm = private.run.noise_fn.mechanism.noise_row_norms_squared()[0]
    assert variance == pytest.approx((2.0 * 0.25 / private.plan.expected_batch_size) ** 2 * row_norm, rel=1e-12)
    assert gradients.sensitivity == 0.25 / private.plan.expected_batch_size


def test_a_checkpoint_of_one_clipping_rule_does_not_load_into_the_other():
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,)))

    def run(**options):
        model = nn.Sequential(nn.Linear(5, 3))
        return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                            batch_size=5, epochs=1, noise_multiplier=2.0, target_delta=1e-5, max_grad_norm=1.0,
                            strategy=blt_strategy(max_buffers=2), key=key(0), **options)

    automatic, flat = run(clipping="automatic"), run()
    assert automatic.state_dict()["plan"]["clipping"] == "automatic(stability=0.01)"
    assert flat.state_dict()["plan"]["clipping"] == "flat"
    with pytest.raises(ValueError, match="clipping rule"):
        flat.load_state_dict(automatic.state_dict(), draws="replay")
    with pytest.raises(ValueError, match="clipping rule"):
        automatic.load_state_dict(flat.state_dict(), draws="replay")
    run(clipping="automatic").load_state_dict(automatic.state_dict(), draws="replay")   # the same plan loads
    older = flat.state_dict()
    del older["plan"]["clipping"], older["digest"]                  # saved before automatic clipping existed
    with pytest.warns(UserWarning, match="no whole digest"):
        run().load_state_dict(older, draws="replay")


# --- bad settings are refused with the fix, before anything moves ---------------------------------------


@pytest.mark.parametrize("stability", [0.0, -0.01, float("nan"), float("inf")])
def test_a_bad_stability_is_refused_with_the_fix(stability):
    with pytest.raises(ClippingRuleError, match=r"stability .* must be finite and > 0.*stability=0\.01"):
        AutomaticClipping(1.0, stability=stability)


def test_a_stability_that_is_not_a_number_is_refused():
    with pytest.raises(TypeError, match="stability must be a real number"):
        AutomaticClipping(1.0, stability="0.01")


@pytest.mark.parametrize("mode", ["auto", "AUTOMATIC", "none", 1])
def test_an_unknown_mode_is_refused_naming_the_modes(mode):
    with pytest.raises(ClippingRuleError, match=r"clipping must be one of \('flat', 'automatic'\)"):
        clipping_rule(1.0, mode=mode)
    with pytest.raises(ClippingRuleError, match="clipping must be one of"):
        clipped_grad(_dot_loss, 1.0, clipping=mode)


def test_a_mode_that_contradicts_the_rule_value_is_refused():
    with pytest.raises(ClippingRuleError, match=r"clipping='flat' contradicts .*AutomaticClipping"):
        clipping_rule(AutomaticClipping(1.0), mode="flat")
    assert clipping_rule(AutomaticClipping(1.0), mode="automatic") == AutomaticClipping(1.0)
    assert clipping_rule(1.5, mode="flat") == FlatClipping(1.5)
    assert CLIPPING_MODES == ("flat", "automatic")


@pytest.mark.parametrize("options", [dict(clipping="auto"),
                                     dict(max_grad_norm=AutomaticClipping(1.0), clipping="flat")])
def test_make_private_refuses_before_the_module_is_touched(options):
    model = nn.Sequential(nn.Linear(5, 3))
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,)))
    arguments = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                     batch_size=5, epochs=1, noise_multiplier=2.0, target_delta=1e-5, max_grad_norm=1.0,
                     strategy=blt_strategy(max_buffers=2), key=key(0))
    arguments.update(options)
    with pytest.raises(OpakeError) as raised:
        make_private(**arguments)
    assert isinstance(raised.value, ValueError)
    assert not model._forward_hooks and not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    make_private(**{**arguments, "max_grad_norm": 1.0, "clipping": "automatic"})   # the fix works


def test_automatic_factors_are_the_rules():
    norms = torch.tensor([0.0, 0.5, 3.0], dtype=torch.float64)
    factors, mask = automatic_factors(norms, 2.0, 0.1)
    torch.testing.assert_close(factors, 2.0 / (norms + 0.1), rtol=0, atol=0)
    assert mask.tolist() == [False, False, True]
