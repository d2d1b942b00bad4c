"""Opacus' ``PrivacyEngine`` options its own tests use, in opake's terms (docs/from_opacus.md).

``grad_sample_mode``: each of Opacus' ways of computing per-example gradients is accepted and
changes nothing (one exact per-example clipping serves them all): the same key gives
bit-identical parameters; ``"ghost"`` returns Opacus' four values, criterion included.
``noise_multiplier=0``: clipping alone, as Opacus' tests use it; it warns, trains the planned
batches on clipped gradients without noise, and its epsilon is infinite. The optimizer's
``step(closure)``, ``pre_step()``, ``accumulated_iterations``: the same training as the plain loop,
and never a release outside the plan. ``ModuleValidator.validate``: Opacus' list of errors, or
(``strict=True``) one error naming them all.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opake.torch
from opake.errors import OpakeError
from opake.random import key
from opake.torch import ModuleValidator, PrivacyEngine, UnplannedBatchError
from opake.torch.opacus import NoNoiseWarning
from opake.torch.opacus.no_noise import PLACEHOLDER_SIGMA
from opake.torch.opacus.options import GRAD_SAMPLE_MODES
from opake.torch.validation import ModelValidationError


def _dataset(count=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 6, generator=generator)
    y = (x[:, 0] - x[:, 2] > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def _private(mode="hooks", *, noise_multiplier=1.0, with_epsilon=False, seed=3, max_grad_norm=1.0, **options):
    model = _model()
    call = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=16), max_grad_norm=max_grad_norm,
                epochs=1, grad_sample_mode=mode, key=key(seed), **options)
    engine = PrivacyEngine()
    if with_epsilon:
        returned = engine.make_private_with_epsilon(target_epsilon=4.0, target_delta=1e-5, **call)
    else:
        returned = engine.make_private(noise_multiplier=noise_multiplier, **call)
    return engine, returned


def _train(model, optimizer, loader, criterion=None, steps=4):
    criterion = nn.CrossEntropyLoss() if criterion is None else criterion
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _returns(mode, returned):
    if mode == "ghost":
        model, optimizer, criterion, loader = returned
        return model, optimizer, loader, criterion
    model, optimizer, loader = returned
    return model, optimizer, loader, None


@pytest.mark.parametrize("with_epsilon", [False, True])
def test_every_grad_sample_mode_gives_bit_identical_parameters(with_epsilon):
    trained = {}
    for mode in GRAD_SAMPLE_MODES:
        _, returned = _private(mode, with_epsilon=with_epsilon)
        assert len(returned) == (4 if mode == "ghost" else 3)
        trained[mode] = _train(*_returns(mode, returned))
    for mode in GRAD_SAMPLE_MODES:
        assert all(torch.equal(a, b) for a, b in zip(trained["hooks"], trained[mode])), mode
    assert not all(torch.equal(a, b) for a, b in zip(trained["hooks"], [p.detach() for p in _model().parameters()]))


def test_ghost_returns_the_criterion_given_or_opacus_default():
    criterion = nn.CrossEntropyLoss(reduction="mean")
    _, returned = _private("ghost", criterion=criterion)
    assert returned[2] is criterion
    _, returned = _private("ghost")
    assert isinstance(returned[2], nn.CrossEntropyLoss)


@pytest.mark.parametrize("mode", ["no_op", "ghost_fsdp", "Hooks", None])
def test_other_grad_sample_modes_are_refused_with_the_list(mode):
    with pytest.raises(ValueError, match=r"one of Opacus' modes \('hooks', 'ghost', 'functorch', 'ew'\)"):
        _private(mode)


# -- noise_multiplier=0: clipping alone, no privacy ----------------------------------------------------------


def _clipped_mean_step(model, x, y, lr, max_grad_norm, expected_batch_size):
    """One SGD step on the sum of per-example gradients clipped to max_grad_norm, over the expected batch size."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(x.shape[0]):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        factor = min(1.0, max_grad_norm / (norm + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads)]
    with torch.no_grad():
        for p, t in zip(model.parameters(), total):
            p -= lr * t / expected_batch_size


def test_zero_noise_warns_trains_with_clipping_alone_and_spends_infinite_epsilon():
    with pytest.warns(NoNoiseWarning, match="no privacy guarantee"):
        engine, (model, optimizer, loader) = _private(noise_multiplier=0.0, max_grad_norm=0.1)
    assert issubclass(NoNoiseWarning, UserWarning)
    assert optimizer.noise_multiplier == 0.0 and engine.private.noise_multiplier == 0.0
    assert engine.get_epsilon(1e-5) == 0.0  # nothing released yet
    reference = _model()
    reference.load_state_dict(model.state_dict())
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        _clipped_mean_step(reference, x, y, lr=0.5, max_grad_norm=0.1, expected_batch_size=16)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert engine.get_epsilon(1e-5) == float("inf") and engine.accountant.get_epsilon(delta=1e-3) == float("inf")
    assert engine.private.epsilon == float("inf")
    assert engine.accountant.history == [(0.0, engine.private.plan.sample_rate, 3)]


def test_zero_noise_runs_are_reproducible_and_every_mode_agrees():
    trained = []
    for mode in ("hooks", "functorch"):
        with pytest.warns(NoNoiseWarning):
            _, returned = _private(mode, noise_multiplier=0)
        trained.append(_train(*_returns(mode, returned)))
    assert all(torch.equal(a, b) for a, b in zip(*trained))


def test_zero_noise_still_releases_only_the_planned_batch():
    with pytest.warns(NoNoiseWarning):
        _, (model, optimizer, loader) = _private(noise_multiplier=0)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x[: max(1, x.shape[0] - 1)]), y[: max(1, x.shape[0] - 1)]).backward()
    with pytest.raises(UnplannedBatchError):
        optimizer.step()


def test_zero_noise_checkpoint_never_loads_into_a_noised_run_as_a_private_one(tmp_path):
    with pytest.warns(NoNoiseWarning):
        engine, (model, optimizer, loader) = _private(noise_multiplier=0)
    _train(model, optimizer, loader, steps=2)
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    noised, (model2, optimizer2, _) = _private(noise_multiplier=PLACEHOLDER_SIGMA)
    # Opacus' checkpoint test loads it: the weights come in, and the noised run is noise-free from then on.
    noised.load_checkpoint(path=path, module=model2, optimizer=optimizer2, draws="replay")
    assert noised.get_epsilon(1e-5) == float("inf") == noised.private.epsilon
    assert noised.accountant.history == engine.accountant.history == [(0.0, engine.private.plan.sample_rate, 2)]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    with pytest.warns(NoNoiseWarning):
        again, (model3, optimizer3, _) = _private(noise_multiplier=0)
    again.load_checkpoint(path=path, module=model3, optimizer=optimizer3, draws="replay")
    assert again.private.steps_taken == 2 and again.get_epsilon(1e-5) == float("inf")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model3.parameters()))
    # Even given the checkpoint's own key (as the refusal's message suggests), a noised plan refuses it:
    # the record is marked noise-free. The control: the same record without the mark would match.
    from opake.torch.checkpoint import CheckpointError, check_checkpoint, whole_digest

    saved = torch.load(path, weights_only=True)["opake_private_training"]  # the run's state_dict()
    assert saved["plan"]["noise_free"] is True
    with pytest.raises(CheckpointError, match="another plan or key"):
        check_checkpoint(saved, again.private.plan, saved["key"])
    unmarked = {**saved, "plan": {k: v for k, v in saved["plan"].items() if k != "noise_free"}}
    unmarked["digest"] = whole_digest(unmarked)
    check_checkpoint(unmarked, again.private.plan, saved["key"])  # the mark is what refuses it


@pytest.mark.parametrize("noise_multiplier", [-1.0, float("nan")])
def test_negative_or_nan_noise_is_still_refused(noise_multiplier):
    with pytest.raises(ValueError, match="noise_multiplier"):
        _private(noise_multiplier=noise_multiplier)


def test_opake_make_private_still_refuses_zero_noise():
    model = _model()
    with pytest.raises(ValueError, match="noise_multiplier must be finite and > 0"):
        opake.torch.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 dataset=_dataset(), batch_size=16, epochs=1, max_grad_norm=1.0, target_delta=1e-5,
                                 noise_multiplier=0.0, key=key(0))


# -- the optimizer: step(closure), accumulated_iterations --------------------------------------------------------


def _train_with_closure(model, optimizer, loader, steps=4):
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break

        def closure():
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        losses.append(optimizer.step(closure))
    return [p.detach().clone() for p in model.parameters()], losses


def test_step_with_a_closure_trains_as_the_plain_loop():
    _, (model, optimizer, loader) = _private()
    plain = _train(model, optimizer, loader)
    _, (model, optimizer, loader) = _private()
    with_closure, losses = _train_with_closure(model, optimizer, loader)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_closure))
    assert all(isinstance(loss, torch.Tensor) and loss.ndim == 0 for loss in losses)


def test_step_with_a_closure_under_no_grad_still_computes_gradients():
    _, (model, optimizer, loader) = _private()
    x, y = next(iter(loader))
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with torch.no_grad():
        optimizer.step(closure)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_closure_cannot_release_anything_outside_the_plan():
    _, (model, optimizer, loader) = _private()
    x, y = next(iter(loader))
    other = _dataset(seed=1).tensors
    before = [p.detach().clone() for p in model.parameters()]

    def closure():  # computes its loss on examples that are not the planned batch
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(other[0][: x.shape[0] + 1]), other[1][: x.shape[0] + 1])
        loss.backward()
        return loss

    with pytest.raises(UnplannedBatchError):
        optimizer.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.steps_taken == 0


def test_accumulated_iterations_counts_the_passes_since_zero_grad():
    _, (model, optimizer, loader) = _private()
    x, y = next(iter(loader))
    optimizer.zero_grad()
    assert optimizer.accumulated_iterations == 0
    half = x.shape[0] // 2
    for part in (slice(0, half), slice(half, None)):
        nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
    assert optimizer.accumulated_iterations == 2
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.accumulated_iterations == 0


def test_pre_step_then_step_trains_as_step_and_releases_once():
    _, (model, optimizer, loader) = _private()
    plain = _train(model, optimizer, loader)
    _, (model, optimizer, loader) = _private()
    for step, (x, y) in enumerate(loader):
        if step == 4:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert optimizer.pre_step() is True
        assert optimizer.steps_taken == step + 1 and all(p.grad is not None for p in model.parameters())
        with pytest.raises(RuntimeError, match="already released"):
            optimizer.pre_step()
        optimizer.step()
        assert optimizer.steps_taken == step + 1
    assert all(torch.equal(a, b) for a, b in zip(plain, model.parameters()))


def test_pre_step_of_a_skipped_step_releases_nothing():
    _, (model, optimizer, loader) = _private()
    x, y = next(iter(loader))
    optimizer.zero_grad()
    optimizer.signal_skip_step(do_skip=True)
    nn.functional.cross_entropy(model(x), y).backward()
    assert optimizer.pre_step() is False
    assert optimizer.steps_taken == 0


def test_pre_step_still_checks_the_planned_batch():
    _, (model, optimizer, loader) = _private()
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x[:-1]), y[:-1]).backward()
    with pytest.raises(UnplannedBatchError):
        optimizer.pre_step()
    assert optimizer.steps_taken == 0


def test_add_noise_alone_is_refused_naming_pre_step():
    _, (_, optimizer, _) = _private()
    with pytest.raises(RuntimeError, match=r"add_noise\(\) is not available.*pre_step\(\)") as raised:
        optimizer.add_noise()
    assert isinstance(raised.value, OpakeError)


# -- ModuleValidator.validate ----------------------------------------------------------------------------------


def test_validate_returns_one_error_a_layer_and_strict_raises_them_all():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    errors = ModuleValidator.validate(model, strict=False)
    assert isinstance(errors, list) and len(errors) == 2
    assert all(isinstance(error, ValueError) and isinstance(error, OpakeError) for error in errors)
    assert "1 (BatchNorm1d)" in str(errors[0]) and "3 (BatchNorm1d)" in str(errors[1])
    assert len(ModuleValidator.validate(model)) == 2  # strict=False is the default
    with pytest.raises(ValueError, match=r"1 \(BatchNorm1d\).*3 \(BatchNorm1d\)") as raised:
        ModuleValidator.validate(model, strict=True)
    assert isinstance(raised.value, ModelValidationError) and len(raised.value.errors) == 2
    fixed = ModuleValidator.fix(model)
    assert ModuleValidator.validate(fixed) == [] and ModuleValidator.validate(fixed, strict=True) == []
    assert ModuleValidator.is_valid(fixed) and not ModuleValidator.is_valid(model)
