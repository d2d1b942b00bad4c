"""opake.torch.make_private: the issue's loop as written, equality with the functional layer
(sampler -> clipped_grad -> mf_gaussian_noise with the same keys), the plan's guarantee, the
horizon, checkpoints, frozen parameters, model fixes and the errors raised before training."""

from __future__ import annotations

import io
import math

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.clipping import clipped_grad
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy, mf_gaussian_noise
from opake.dpftrl.sampling import BallsInBinsSampler
from opake.random import key
from opake.torch import PlanExhaustedError, fix_model, make_private, validate_model
from opake.torch.validation import ModelValidationError


def _images(count=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 1, 8, 8, generator=generator)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


class SmallCNN(nn.Module):
    """A CNN as people write it: convolution, BatchNorm, dropout, linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.norm(self.conv(x)))).flatten(1))


def test_the_issue_loop_runs_as_written_with_standard_objects():
    torch.manual_seed(0)
    train_ds = _images()
    model = fix_model(SmallCNN())                       # BatchNorm -> GroupNorm, a fixed copy
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=12)
    private = make_private(module=model, optimizer=optimizer, dataset=train_ds, batch_size=16, epochs=2,
                           target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0, key=key(1))
    model, optimizer, loader = private.module, private.optimizer, private.data_loader
    model.train()                                       # dropout on: per-example randomness is fine
    for epoch in range(2):
        assert len(loader) == 6                         # one epoch of 96 // 16 = 6 bins per pass
        for x, y in loader:
            optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
            scheduler.step()
    assert private.steps_taken == 12
    assert 2.9 < private.epsilon <= 3.0 and private.delta == 1e-5
    assert private.plan.participation.min_sep == 6 and private.plan.participation.max_participations == 2
    with pytest.raises(PlanExhaustedError, match=r"after all 12 planned steps.*epochs"):
        optimizer.step()
    with pytest.raises(PlanExhaustedError, match=r"all 2 planned epochs \(12 steps\) have been served.*more epochs"):
        next(iter(loader))
    buffer = io.BytesIO()
    torch.save(private.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["format"] == "opake.torch.PrivateTraining"
    unwrapped = fix_model(SmallCNN())
    unwrapped.load_state_dict(model.state_dict())       # the module is not wrapped


def _loss_sum_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def test_steps_equal_the_functional_layer_with_the_same_keys():
    """make_private = BallsInBinsSampler -> clipped_grad -> mf_gaussian_noise -> SGD (same keys)."""
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(40, 5, generator=generator), torch.randint(0, 3, (40,), generator=generator)
    dataset = torch.utils.data.TensorDataset(x, y)
    strategy = blt_strategy(max_buffers=3)
    model = _loss_sum_model()
    reference_model = _loss_sum_model()
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=8, epochs=2, noise_multiplier=1.3, target_delta=1e-5, max_grad_norm=0.5,
                           strategy=strategy, key=key(11))
    for xb, yb in private.run_data_loader():
        private.optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        private.optimizer.step()

    # The same run through the functional layer.
    root = key(11)
    sampler = BallsInBinsSampler(40, 5, root.fold_in("opake.torch.sampler"))
    context = sampler.participation(10)
    params = {name: p.detach().clone() for name, p in reference_model.named_parameters()}

    def example_loss(params, xi, yi):
        return F.cross_entropy(functional_call(reference_model, params, (xi[None],)), yi[None])

    grad_fn, clip_state = clipped_grad(example_loss, clipping_norm=0.5, normalize_by=sampler.expected_batch_size,
                                       batch_argnums=(1, 2))
    noise_fn, noise_state = mf_gaussian_noise(params, strategy, n_steps=10, min_sep=context.min_sep,
                                              max_participations=context.max_participations,
                                              noise_multiplier=1.3, key=root.fold_in("opake.torch.noise"))
    for step in range(10):
        batch = sampler.batch(step)
        grads, clip_state = grad_fn(params, x[batch], y[batch], state=clip_state)
        noisy, noise_state = noise_fn(grads, noise_state)
        params = {name: params[name] - 0.1 * noisy.pytree[name] for name in params}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], rtol=1e-5, atol=1e-6)
    # The plan's epsilon is, by default, the bound proven for adaptive gradients: for a BLT, whose
    # bins interact, the unamplified bound for the sampler's participation (docs/adaptivity.md).
    unamplified = dpftrl_acc.mf_gaussian(1.3, strategy, context.n_steps, context.min_sep, context.max_participations)
    assert private.plan.accounting == "rigorous" and private.plan.sampling == "balls_in_bins"
    assert private.epsilon == pytest.approx(unamplified.epsilon_at(1e-5), rel=1e-12)


class _TiedModel(nn.Module):
    """Embedding, a hidden Linear and a head tied to the embedding (one Parameter, two layers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(7, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def _tied_run(skip: bool):
    tokens = torch.randint(0, 7, (24, 5), generator=torch.Generator().manual_seed(2))
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    model = _TiedModel()
    computed = set()  # the parameters autograd computed a gradient for (hooks registered before the guard's)
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: computed.add(name))
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=4, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=0.3,
                           strategy=blt_strategy(max_buffers=2), key=key(9))
    grads_after_backward = []
    for step, (x, y) in enumerate(private.run_data_loader()):
        if step == 1 and not skip:  # the comparison run keeps autograd's weight gradients throughout
            private.optimizer.clipper.skip_autograd_weight_gradients(False)
        private.optimizer.zero_grad()
        out = model(x)
        computed.clear()
        F.cross_entropy(out.reshape(-1, 7), y.reshape(-1)).backward()
        assert all(p.grad is None for p in model.parameters())  # taken out of .grad by the guard
        grads_after_backward.append({name: name in computed for name, _ in model.named_parameters()})
        assert all(p.requires_grad for p in model.parameters())  # lent and returned within each call
        private.optimizer.step()
        if not skip:
            private.optimizer.clipper.skip_autograd_weight_gradients(False)
    return model, grads_after_backward


def test_after_the_first_step_autograd_computes_no_unclipped_weight_gradient():
    model, seen = _tied_run(skip=True)
    reference, _ = _tied_run(skip=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # the same clipped, noised steps
    assert all(seen[0].values())  # step 1: autograd's sums are checked against the hooks'
    # later steps: only the first layer (its input needs no gradient) keeps its weight in the graph
    assert seen[1] == {"embed.weight": True, "hidden.weight": False, "hidden.bias": False}


def test_a_layer_that_raises_returns_the_parameters_it_lent():
    model = _loss_sum_model()
    private = _make(model=model)
    x, y = next(iter(private.data_loader))
    private.optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); private.optimizer.step()
    hidden = model[2]
    with pytest.raises(RuntimeError):
        model(torch.randn(5, 5).requires_grad_()[:, :4])  # the first layer refuses 4 features
    with pytest.raises(RuntimeError):
        hidden(torch.randn(5, 5, requires_grad=True))     # this layer lends its weights, then fails
    assert all(p.requires_grad for p in model.parameters())


def test_a_resumed_run_replays_to_the_same_parameters(tmp_path):
    dataset = _images(48)

    def run(stop_after=None, resume_from=None):
        model = fix_model(SmallCNN()).eval()  # eval: no dropout, so both runs are deterministic
        torch.manual_seed(7)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.1)
        private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                               dataset=dataset, batch_size=8, epochs=2, noise_multiplier=1.0,
                               target_delta=1e-5, max_grad_norm=1.0, key=key(4))
        if resume_from is not None:
            private.load_state_dict(torch.load(resume_from, weights_only=True), draws="replay")
        for index, (xb, yb) in enumerate(private.run_data_loader()):
            if stop_after is not None and index == stop_after:
                torch.save(private.state_dict(), tmp_path / "run.pt")
                return None
            private.optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            private.optimizer.step()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    whole = run()
    run(stop_after=5)
    resumed = run(resume_from=tmp_path / "run.pt")
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0)
    model = fix_model(SmallCNN())
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), dataset=dataset,
                           batch_size=8, epochs=2, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                           key=key(4))
    with pytest.raises(TypeError, match=r"draws='replay' or fresh_key"):
        private.load_state_dict(torch.load(tmp_path / "run.pt", weights_only=True))


def test_frozen_parameters_get_no_noise_and_no_state():
    model = _loss_sum_model()
    model[0].weight.requires_grad_(False)
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,)))
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=5, epochs=1, noise_multiplier=2.0, target_delta=1e-5, max_grad_norm=1.0,
                           key=key(0))
    assert set(private.optimizer.parameters) == {"0.bias", "2.weight", "2.bias"}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert private.optimizer.noise_state.buffers.shape[1] == trainable
    frozen_before = model[0].weight.detach().clone()
    for xb, yb in private.run_data_loader():
        private.optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        private.optimizer.step()
    assert model[0].weight.grad is None and torch.equal(model[0].weight, frozen_before)


def test_fix_model_replaces_batch_norm_in_a_copy():
    model = SmallCNN()
    assert validate_model(model) and "norm (BatchNorm2d)" in validate_model(model)[0]
    fixed = fix_model(model)
    assert isinstance(model.norm, nn.BatchNorm2d)          # the caller's model is untouched
    assert isinstance(fixed.norm, nn.GroupNorm) and fixed.norm.num_channels == 4
    assert validate_model(fixed) == []


def _make(model=None, **overrides):
    model = _loss_sum_model() if model is None else model
    arguments = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     dataset=torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,))),
                     batch_size=5, epochs=1, target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0, key=key(0))
    arguments.update(overrides)
    return make_private(**arguments)


@pytest.mark.parametrize("overrides, error, pattern", [
    (dict(batch_size=21), ValueError, r"20 examples, fewer than batch_size=21"),
    (dict(sampling="uniform"), ValueError, r"sampling must be one of \('balls_in_bins', 'poisson'\)"),
    (dict(amplification="yes"), TypeError, r"amplification must be None \(the proven default\), True or False"),
    (dict(sampling="poisson", strategy=identity_strategy(), amplification=False), ValueError,
     r"amplification=False applies to sampling='balls_in_bins'"),
    (dict(sampling="poisson", strategy=band_mf_strategy(bands=5)), ValueError,
     r"sample rate batch_size \* groups / len\(dataset\) = 25/20 > 1; use at most 4 bands"),
    (dict(target_epsilon=1e-9), ValueError, r"target_epsilon=1e-09 .* cannot be met"),
    (dict(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)), ValueError, "not parameters of the module"),
    (dict(target_delta=None), TypeError, "needs target_delta"),
    (dict(noise_multiplier=1.0), TypeError, "exactly one of target_epsilon"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
    (dict(epochs=0), ValueError, "epochs must be >= 1, got 0"),
    (dict(epochs=1.5), TypeError, "epochs must be an integer"),
])
def test_bad_plans_are_refused_before_training(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        _make(**overrides)


def test_a_batch_norm_model_is_refused_with_the_fix():
    with pytest.raises(ModelValidationError, match=r"norm \(BatchNorm2d\).*opake.torch.fix_model"):
        _make(model=SmallCNN(), dataset=_images(20))


def test_the_default_strategy_follows_the_optimizer():
    from opake.torch import strategy_for_optimizer

    model = _loss_sum_model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    assert strategy_for_optimizer(plain, 20) == blt_strategy()                      # prefix sums
    assert strategy_for_optimizer(torch.optim.AdamW(model.parameters()), 20) == blt_strategy()
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    assert strategy_for_optimizer(momentum, 20) == blt_strategy(workload="parameters", momentum=0.9,
                                                                 dampening=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(momentum, step_size=5, gamma=0.5)
    derived = strategy_for_optimizer(momentum, 12, scheduler)
    assert derived.workload == "parameters" and derived.nesterov is False
    expected = [0.1] * 5 + [0.05] * 5 + [0.025] * 2
    assert list(blt_strategy(workload="parameters", momentum=0.9, dampening=0.1, lr_schedule=expected).lr_schedule) \
        == pytest.approx(list(derived.lr_schedule))
    assert momentum.param_groups[0]["lr"] == 0.1 and scheduler.last_epoch == 0   # the caller's objects untouched


class _TiedLanguageModel(nn.Module):
    """Token embedding reused as the output projection, either through a Linear sharing the
    Parameter (hooked) or directly as ``h @ weight.T`` (escapes the per-example hooks)."""

    def __init__(self, direct: bool):
        super().__init__()
        self.direct = direct
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.embed(tokens)))
        return h @ self.embed.weight.T if self.direct else self.out(h)


@pytest.mark.parametrize("direct", [False, True])
def test_a_parameter_used_outside_its_layer_is_caught_on_the_first_step(direct):
    from opake.torch.per_example import UnhookedUseError

    torch.manual_seed(0)
    model = _TiedLanguageModel(direct)
    dataset = torch.utils.data.TensorDataset(torch.randint(0, 11, (32, 5)), torch.randint(0, 11, (32, 5)))
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=8, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                           key=key(2))
    x, y = next(iter(private.data_loader))
    private.optimizer.zero_grad()
    F.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1)).backward()
    if direct:
        with pytest.raises(UnhookedUseError, match=r"'embed.weight' got gradient from outside the layer"):
            private.optimizer.step()
        assert private.steps_taken == 0      # nothing was released
    else:
        private.optimizer.step()
        assert private.steps_taken == 1


def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules())


def _train(private, model):
    for xb, yb in private.run_data_loader():
        private.optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        private.optimizer.step()


@pytest.mark.parametrize("strategy, groups", [(identity_strategy(), 1), (band_mf_strategy(bands=2), 2)])
def test_poisson_sampling_trains_and_its_epsilon_is_the_pld_of_band23_thm4(strategy, groups):
    """DP-SGD (identity) and BandMF under cyclic Poisson sampling: the plan's epsilon is the PLD of
    PoissonSampled(q, Gaussian(sigma / ||c||)) composed ceil(n / g) times, rebuilt here from
    dp_accounting directly."""
    generator = torch.Generator().manual_seed(2)
    dataset = torch.utils.data.TensorDataset(torch.randn(60, 5, generator=generator),
                                             torch.randint(0, 3, (60,), generator=generator))
    model = _loss_sum_model()
    before = [p.detach().clone() for p in model.parameters()]
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=6, epochs=2, target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0,
                           strategy=strategy, sampling="poisson", key=key(3))
    plan = private.plan
    q = 6 * groups / 60
    assert (plan.sampling, plan.accounting, plan.num_groups, plan.num_bins) == ("poisson", "pld", groups, None)
    assert plan.sample_rate == pytest.approx(q) and plan.expected_batch_size == pytest.approx(6.0)
    assert plan.participation.n_steps == 20 and plan.participation.min_sep == groups
    _train(private, model)
    assert private.steps_taken == 20
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))

    coefficients = strategy.resolve(20, groups, math.ceil(20 / groups)).toeplitz_coefficients(groups)
    column_norm = math.sqrt(float((coefficients ** 2).sum()))
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                                 value_discretization_interval=1e-4)
    gaussian = dp_accounting.GaussianDpEvent(private.noise_multiplier / column_norm)
    event = dp_accounting.PoissonSampledDpEvent(q, gaussian)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, math.ceil(20 / groups)))
    assert private.epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert 2.9 < private.epsilon <= 3.0


def test_poisson_sampling_with_a_blt_is_refused_before_the_module_is_touched():
    model = _loss_sum_model()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    for budget in (dict(), dict(target_epsilon=None, noise_multiplier=2.0)):  # named, or the BLT default
        with pytest.raises(dpftrl_acc.UnsupportedAmplificationError,
                           match=r"sampling='poisson' needs a banded strategy.*band_mf_strategy.*identity_strategy"
                                 r".*sampling='balls_in_bins'"):
            _make(model=model, sampling="poisson", strategy=None if budget else blt_strategy(max_buffers=3),
                  **budget)
    assert _hooks(model) == 0
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_poisson_sampling_without_a_strategy_chooses_among_the_banded_mechanisms():
    private = _make(sampling="poisson")
    assert private.plan.sampling == "poisson" and private.plan.accounting == "pld"
    assert private.plan.strategy.bands is not None and private.plan.choice is not None
    assert private.plan.choice.chosen.sampling == "poisson" and private.epsilon <= 3.0


def test_amplification_never_needs_more_noise_than_the_unamplified_bound():
    with pytest.warns(dpftrl_acc.UnprovenAmplificationWarning, match=r"not proven to dominate adaptively"):
        amplified = _make(batch_size=4, epochs=1, amplification=True)   # 5 bins, one epoch: amplification helps
    unamplified = _make(batch_size=4, epochs=1, amplification=False)
    default = _make(batch_size=4, epochs=1, strategy=blt_strategy())     # a BLT: the proven, unamplified bound
    assert (amplified.plan.accounting, unamplified.plan.accounting) == ("amplified", "rigorous")
    assert default.plan.accounting == "rigorous" and default.noise_multiplier == unamplified.noise_multiplier
    assert amplified.noise_multiplier < unamplified.noise_multiplier
    assert amplified.epsilon <= 3.0 and unamplified.epsilon <= 3.0
    assert "amplified" in amplified.plan.accountant.description
    assert "without amplification" in unamplified.plan.accountant.description


def test_the_unproven_amplification_warning_is_shown_once_per_plan():
    # The calibration evaluates the amplified bound several times; each evaluation warns, the
    # plan shows it once. A filter that makes it an error still raises.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _make(batch_size=4, epochs=2, target_epsilon=2.5, amplification=True)
    assert [w.category for w in caught] == [dpftrl_acc.UnprovenAmplificationWarning]
    with warnings.catch_warnings():
        warnings.simplefilter("error", dpftrl_acc.UnprovenAmplificationWarning)
        with pytest.raises(dpftrl_acc.UnprovenAmplificationWarning):
            _make(batch_size=4, epochs=2, target_epsilon=2.4, amplification=True)


def test_an_identical_plan_reuses_the_calibrated_noise(monkeypatch):
    from opake.torch import planning

    first = _make(batch_size=4, epochs=1, strategy=blt_strategy(max_buffers=3))
    calls = []
    monkeypatch.setattr(planning.acc, "calibrate", lambda *a, **k: calls.append(a) or 1 / 0)
    second = _make(batch_size=4, epochs=1, strategy=blt_strategy(max_buffers=3))  # an equal recipe
    assert calls == [] and second.noise_multiplier == first.noise_multiplier
    assert second.epsilon == first.epsilon <= 3.0
    with pytest.raises(ZeroDivisionError):  # another budget is calibrated anew
        _make(batch_size=4, epochs=1, strategy=blt_strategy(max_buffers=3), target_epsilon=2.0)


def test_amplification_refuses_a_strategy_with_negative_coefficients():
    from accounting_oracles import HandBLTRecipe

    model = _loss_sum_model()
    signed = HandBLTRecipe(theta=(0.5,), omega=(-0.3,))              # c_1 = -0.3
    with pytest.raises(ValueError, match=r"non-negative entries, and this strategy's has a negative one. "
                                         r"Pass amplification=False"):
        _make(model=model, strategy=signed, amplification=True)
    assert _hooks(model) == 0


def _fixed_noise_run(dataset, **options):
    """make_private on a small model with noise_multiplier=2 and key 0 (checkpoint tests)."""
    model = _loss_sum_model()
    return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                        batch_size=5, epochs=1, noise_multiplier=2.0, target_delta=1e-5, max_grad_norm=1.0,
                        key=key(0), **options)


def test_a_checkpoint_of_one_sampling_does_not_load_into_another():
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,)))

    def run(**options):
        return _fixed_noise_run(dataset, strategy=identity_strategy(), **options)

    poisson, bins = run(sampling="poisson"), run()
    unamplified = run(amplification=False)
    assert poisson.state_dict()["plan"]["sampling"] == "poisson"
    assert poisson.state_dict()["plan"]["sample_rate"] == pytest.approx(0.25)
    for source, target in ((poisson, bins), (bins, poisson), (bins, unamplified)):
        with pytest.raises(ValueError, match=r"another plan or key \(different sampling"):
            target.load_state_dict(source.state_dict(), draws="replay")
    run().load_state_dict(bins.state_dict(), draws="replay")      # the same plan loads


def test_a_checkpoint_saved_before_sampling_existed_loads_into_the_unamplified_run():
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,)))

    def run(**options):
        return _fixed_noise_run(dataset, **options)

    saved = run(amplification=False).state_dict()
    saved["plan"] = {name: saved["plan"][name] for name in ("n_steps", "num_bins", "noise_multiplier", "max_grad_norm")}
    del saved["digest"]  # written before the whole-checkpoint digest existed, too
    with pytest.warns(UserWarning, match="no whole digest"):
        run(amplification=False).load_state_dict(saved, draws="replay")
    with pytest.warns(UserWarning, match="no whole digest"):
        run().load_state_dict(saved, draws="replay")              # the default for a BLT: unamplified too
    with pytest.warns(dpftrl_acc.UnprovenAmplificationWarning):
        amplified = run(amplification=True)
    with pytest.raises(ValueError, match="another plan"):
        amplified.load_state_dict(saved, draws="replay")


def test_dp_sgd_on_balls_in_bins_is_priced_by_the_random_allocation_pld_by_default():
    from opake.dpftrl.accounting.allocation.pld import BallsInBinsPLD

    private = _make(batch_size=4, epochs=2, strategy=identity_strategy())
    assert private.plan.accounting == "allocation_pld"
    assert isinstance(private.plan.accountant, BallsInBinsPLD)
    unamplified = _make(batch_size=4, epochs=2, strategy=identity_strategy(), amplification=False)
    assert private.noise_multiplier < unamplified.noise_multiplier and private.epsilon <= 3.0


def test_the_optimizer_given_to_make_private_refuses_to_step_on_its_own():
    # A loop that kept calling the optimizer it passed would train on autograd's unclipped,
    # un-noised .grad while the planned epsilon is reported: its step() raises and changes nothing.
    import warnings

    from opake.torch import DirectStepError

    model = _loss_sum_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private = _make(model=model, optimizer=optimizer)
    batch = next(iter(private.data_loader))
    before = [p.detach().clone() for p in model.parameters()]
    F.cross_entropy(model(batch[0]), batch[1], reduction="sum").backward()
    with pytest.raises(DirectStepError, match=r"SGD was given to make_private.*private\.optimizer.*Nothing was changed"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert private.steps_taken == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        private.optimizer.step()  # the private step goes through the wrapped optimizer's own step
    assert private.steps_taken == 1 and not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    private.detach()
    optimizer.step()  # detached: the optimizer is its own again


def test_a_scheduler_built_before_make_private_still_counts_the_private_steps():
    import warnings

    model = _loss_sum_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    private = _make(model=model, optimizer=optimizer, lr_scheduler=scheduler, epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() overridden" / "called before" warning
        for epoch in range(2):
            for x, y in private.data_loader:
                private.optimizer.zero_grad()
                F.cross_entropy(model(x), y, reduction="sum").backward()
                private.optimizer.step()
                scheduler.step()
    assert private.steps_taken == 8
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 8)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_the_clip_bound_is_one_value_from_plan_to_optimizer(clipping):
    """The clipping rule is normalised once, by the plan; the clipper holds that very value, and the
    optimizer's bound (the released pytree's l2_bound, Opacus' optimizer.max_grad_norm) reads it."""
    private = _make(max_grad_norm=0.5, clipping=clipping)
    assert private.optimizer.clipper.rule is private.plan.clipping
    assert private.optimizer.max_grad_norm == private.plan.max_grad_norm == 0.5
    assert "max_grad_norm" not in vars(private.optimizer)  # no second copy to drift
