"""The planned loader and step()'s check: one epoch per pass, and only the plan's batches released."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake.dpftrl.noise import blt_strategy
from opake.random import key
from opake.torch import PlanExhaustedError, UnplannedBatchError, make_private


def _data(n=40, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 5, generator=generator),
                                          torch.randint(0, 3, (n,), generator=generator))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _private(model, batch_size=8, epochs=2, dataset=None, **options):
    dataset = _data() if dataset is None else dataset
    dataset = torch.utils.data.TensorDataset(dataset.tensors[0].double(), dataset.tensors[1])
    return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                        batch_size=batch_size, epochs=epochs, noise_multiplier=1.0, target_delta=1e-5,
                        max_grad_norm=1.0, strategy=blt_strategy(max_buffers=2), key=key(3), **options)


def _step(private, model, x, y):
    private.optimizer.zero_grad()
    if len(y):
        F.cross_entropy(model(x), y).backward()
    private.optimizer.step()


def test_each_pass_serves_one_planned_epoch_in_order_and_a_pass_past_the_plan_is_refused():
    model = _model()
    private = _private(model)
    dataset, sampler = private.data_loader.dataset, private.optimizer.batches.sampler
    served = []
    for epoch in range(2):
        assert len(private.data_loader) == 5                     # 40 // 8 bins
        for x, y in private.data_loader:
            served.append(x)
            _step(private, model, x, y)
    assert private.steps_taken == 10 and private.plan.epochs == 2 and private.plan.steps_per_epoch == 5
    for step, x in enumerate(served):
        assert torch.equal(x, dataset.tensors[0][sampler.batch(step)])
    with pytest.raises(PlanExhaustedError, match=r"all 2 planned epochs \(10 steps\).*more epochs than"):
        next(iter(private.data_loader))
    assert len(private.data_loader) == 0


def test_the_whole_run_in_one_pass_and_a_resumed_pass_starts_at_the_next_step():
    model = _model()
    private = _private(model)
    loader = private.run_data_loader()
    assert len(loader) == 10
    for index, (x, y) in enumerate(loader):
        if index == 3:
            break
        _step(private, model, x, y)
    assert private.steps_taken == 3 and len(private.data_loader) == 2   # the rest of the first epoch
    assert len(list(private.data_loader)) == 2


def test_another_loader_is_refused_and_nothing_is_released():
    model = _model()
    private = _private(model)
    before = [p.detach().clone() for p in model.parameters()]
    other = torch.utils.data.DataLoader(private.data_loader.dataset, batch_size=8, shuffle=True)  # e.g. Trainer's
    x, y = next(iter(other))
    private.optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(UnplannedBatchError, match=r"no batch of the planned loader.*Nothing was released"):
        private.optimizer.step()
    assert private.steps_taken == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # served the planned batch, but trained on another one of a different size
    planned_x, planned_y = next(iter(private.data_loader))
    private.optimizer.zero_grad()
    F.cross_entropy(model(x[: len(planned_y) + 1]), y[: len(planned_y) + 1]).backward()
    with pytest.raises(UnplannedBatchError, match=r"come from \d+ example\(s\), but planned batch 0 has"):
        private.optimizer.step()
    assert private.steps_taken == 0


def test_merging_two_loader_batches_into_one_step_is_refused():
    model = _model()
    private = _private(model)
    batches = iter(private.data_loader)
    private.optimizer.zero_grad()
    for _ in range(2):                                     # gradient accumulation over two loader batches
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(UnplannedBatchError, match=r"already served batch 1.*merged"):
        private.optimizer.step()


def test_micro_batches_of_one_planned_batch_equal_one_backward():
    def run(parts):
        model = _model()
        private = _private(model)
        for x, y in private.data_loader:
            private.optimizer.zero_grad()
            for piece in torch.arange(len(y)).tensor_split(parts):
                F.cross_entropy(model(x[piece]), y[piece]).backward()   # each part a mean over its examples
            private.optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    for whole, split in zip(run(1), run(3)):
        torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)


def test_an_empty_planned_batch_steps_without_backward():
    model = _model()
    private = _private(model, batch_size=2, epochs=1, dataset=_data(n=10, seed=1))   # 5 bins of ~2
    sampler = private.optimizer.batches.sampler
    sizes = [len(sampler.batch(step)) for step in range(5)]
    assert 0 in sizes, sizes            # key(3) leaves a bin empty here
    for x, y in private.data_loader:
        _step(private, model, x, y)
    assert private.steps_taken == 5
    assert private.optimizer.last_step_examples == sizes[-1]


def test_step_without_backward_on_a_non_empty_batch_is_refused():
    model = _model()
    private = _private(model)
    next(iter(private.data_loader))
    private.optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"without a backward pass.*planned batch 0 has examples"):
        private.optimizer.step()


def test_make_private_twice_is_refused_until_detach():
    model = _model()
    first = _private(model)
    with pytest.raises(ValueError, match=r"already called on this module.*detach\(\)"):
        _private(model)
    first.detach()
    second = _private(model)
    x, y = next(iter(second.data_loader))
    _step(second, model, x, y)
    assert second.steps_taken == 1


def test_optimizer_reports_the_noise_multiplier():
    private = _private(_model())
    assert private.optimizer.noise_multiplier == private.plan.noise_multiplier == 1.0
    assert private.optimizer.max_grad_norm == 1.0


def test_options_that_replace_the_batches_are_refused():
    with pytest.raises(TypeError, match=r"does not take \['shuffle'\]"):
        _private(_model(), shuffle=True)
