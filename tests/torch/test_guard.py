"""Only the private optimizer moves a private module's parameters (opake.torch.guard).

After make_private, autograd's unclipped gradients never stay in ``.grad`` and a step of any other
optimizer holding the module's parameters is refused before anything moves. Each test has the
unprotected behaviour as its negative control: the same loop after ``private.detach()`` trains
on the raw, un-noised gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opake.random
from opake.dpftrl.noise import blt_strategy
from opake.torch import DirectStepError, ForeignOptimizerError, make_private

FOREIGN = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "SGD-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-2),
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _private(model, optimizer=None, **overrides):
    generator = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=generator),
                                             torch.randint(0, 3, (48,), generator=generator))
    settings = dict(module=model, optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=0.1),
                    dataset=dataset, batch_size=8, epochs=2, max_grad_norm=1.0, noise_multiplier=1.0,
                    target_delta=1e-5, strategy=blt_strategy(max_buffers=2), key=opake.random.key(3))
    settings.update(overrides)
    return make_private(**settings)


def _snapshot(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model, before) -> bool:
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_another_optimizer_is_refused_before_any_parameter_moves(name):
    model = _model()
    private = _private(model)
    foreign = FOREIGN[name](model.parameters())  # built after make_private, as Trainer builds its own
    for step, (x, y) in enumerate(private.data_loader):
        private.optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = _snapshot(model)
        with pytest.raises(ForeignOptimizerError, match=r"not the private optimizer.*private\.optimizer.*"
                                                        r"DPTrainer.*detach\(\).*Nothing was changed"):
            foreign.step()
        assert _unchanged(model, before)
        private.optimizer.step()  # the private step still goes through
        assert not _unchanged(model, before)
        if step == 2:
            break
    assert private.steps_taken == 3
    # Negative control: the unprotected behaviour. Detached, the same optimizer steps on autograd's
    # raw gradient (no clipping, no noise) while the plan's epsilon would still be printed.
    private.detach()
    x, y = next(iter(torch.utils.data.DataLoader(private._dataset, batch_size=8)))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    assert all(g is not None for g in raw)
    before = _snapshot(model)
    foreign.step()
    assert not _unchanged(model, before)


def test_grad_never_holds_an_unclipped_gradient():
    # A manual update (p -= lr * p.grad) between backward and the private step has nothing to apply:
    # autograd's sums are taken out of .grad as they accumulate, micro-batches included, on the
    # first step (whose coverage check reads them) as on later ones.
    model = _model()
    private = _private(model)
    for step, (x, y) in enumerate(private.data_loader):
        private.optimizer.zero_grad()
        for part in (slice(0, 3), slice(3, None)):  # two micro-batches of one planned batch
            F.cross_entropy(model(x[part]), y[part], reduction="sum").div(len(x)).backward()
            assert all(p.grad is None for p in model.parameters())
        with pytest.raises(TypeError):
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        before = _snapshot(model)
        private.optimizer.step()
        # .grad now holds the released (noised) gradient that plain SGD applied
        for p, b in zip(model.parameters(), before):
            torch.testing.assert_close(p.grad, (b - p.detach()) / 0.1, rtol=1e-4, atol=1e-5)
        if step == 2:
            break
    # negative control: a module that was not made private keeps autograd's sum in .grad
    plain = _model()
    F.cross_entropy(plain(x), y).backward()
    assert all(p.grad is not None for p in plain.parameters())


def test_the_given_optimizer_refuses_and_a_scheduler_built_after_make_private_counts():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    private = _private(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # after make_private
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for epoch in range(2):
            for x, y in private.data_loader:
                private.optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                before = _snapshot(model)
                with pytest.raises(DirectStepError, match="was given to make_private") as refused:
                    optimizer.step()
                assert type(refused.value) is DirectStepError and _unchanged(model, before)
                private.optimizer.step()
                scheduler.step()
    assert private.steps_taken == 12
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 12)


def test_an_optimizer_over_shared_parameters_of_another_module_is_refused():
    # A wrapper module around the private one is another module: make_private's check of a second
    # plan does not see it, the parameters' guard does.
    inner = _model()
    _private(inner)
    outer = nn.Sequential(inner, nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"already belong to another private run.*detach\(\)"):
        _private(outer, torch.optim.SGD(outer.parameters(), lr=0.1))
    foreign = torch.optim.SGD(outer.parameters(), lr=0.1)
    outer(torch.randn(2, 4)).sum().backward()
    before = _snapshot(outer)
    with pytest.raises(ForeignOptimizerError):
        foreign.step()
    assert _unchanged(outer, before)


def test_optimizers_of_other_modules_are_untouched():
    _private(_model())
    other = _model(seed=1)
    optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other(torch.randn(2, 4)).sum().backward()
    before = _snapshot(other)
    optimizer.step()
    assert not _unchanged(other, before)
