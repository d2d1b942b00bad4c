"""The data set is part of the plan: make_private refuses data it cannot sample by index (an
IterableDataset), says so when the data set is empty or smaller than a batch, and its loader
refuses a data set whose length changed after planning (grown or shrunk, between epochs or within
one) before the batch is fetched or served. Each refusal is checked against the same run without
the change, which trains: the parameters move and the steps advance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake.dpftrl.noise import identity_strategy
from opake.dpftrl.sampling import BallsInBinsSampler
from opake.errors import OpakeError
from opake.random import key
from opake.torch import DatasetChangedError, DatasetNotIndexableError, DatasetTooSmallError, make_private

EXAMPLES, BATCH_SIZE, EPOCHS = 40, 8, 2
STEPS_PER_EPOCH = EXAMPLES // BATCH_SIZE  # 5 bins per epoch, 10 planned steps


def _examples(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(count, 5, generator=generator), torch.randint(0, 3, (count,), generator=generator)
    return list(zip(x, y))


class _GrowableDataset(torch.utils.data.Dataset):
    """A map-style data set over a list the test can append to or cut (data that changes)."""

    def __init__(self, examples):
        self.examples = list(examples)

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


class _Stream(torch.utils.data.IterableDataset):
    """An iterable-style data set: examples in order, no index."""

    def __init__(self, examples):
        self.examples = examples

    def __iter__(self):
        return iter(self.examples)


class _StreamOfKnownLength(_Stream):
    def __len__(self):
        return len(self.examples)


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _make(model: nn.Module, dataset, **options):
    """A fast plan (a named strategy and noise multiplier: no calibration)."""
    return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                        batch_size=BATCH_SIZE, epochs=EPOCHS, noise_multiplier=1.0, target_delta=1e-5,
                        max_grad_norm=1.0, strategy=identity_strategy(), key=key(1), **options)


def _train_one_pass(private, after_each_step=lambda: None) -> int:
    """One pass of the planned loader, the usual loop; returns the number of batches served."""
    served = 0
    for x, y in private.data_loader:
        served += 1
        private.optimizer.zero_grad()
        F.cross_entropy(private.module(x), y).backward()
        private.optimizer.step()
        after_each_step()
    return served


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _moved(model: nn.Module, snapshot: list[torch.Tensor]) -> bool:
    return any(not torch.equal(p, q) for p, q in zip(model.parameters(), snapshot))


def _untouched(model: nn.Module) -> bool:
    """No hook of opake's (or anyone's) on any layer: make_private refused before attaching."""
    return not any(layer._forward_pre_hooks or layer._forward_hooks for layer in model.modules())


# -- Data a private run cannot sample ---------------------------------------------------------------------


def test_an_iterable_dataset_of_known_length_is_refused_before_anything_is_hooked():
    model = _model()
    with pytest.raises(DatasetNotIndexableError, match=r"map-style dataset of known length.*IterableDataset.*"
                                                         r"samples by index.*list\(iterable_dataset\)") as refusal:
        _make(model, _StreamOfKnownLength(_examples(EXAMPLES)))
    assert isinstance(refusal.value, OpakeError) and isinstance(refusal.value, TypeError)
    assert _untouched(model)
    # Control: the same examples materialized into a list are accepted and train.
    private = _make(model, list(_StreamOfKnownLength(_examples(EXAMPLES))))
    before = _snapshot(model)
    assert _train_one_pass(private) == STEPS_PER_EPOCH
    assert private.steps_taken == STEPS_PER_EPOCH and _moved(model, before)


def test_an_iterable_dataset_without_a_length_is_refused_with_the_fix():
    model = _model()
    with pytest.raises(DatasetNotIndexableError, match=r"map-style dataset of known length.*list\("):
        _make(model, _Stream(_examples(EXAMPLES)))
    assert _untouched(model)


def test_a_dataset_without_getitem_is_refused_by_the_sampler_loader_too():
    class Sized:
        def __len__(self):
            return EXAMPLES

    sampler = BallsInBinsSampler(EXAMPLES, STEPS_PER_EPOCH, key(2))
    with pytest.raises(DatasetNotIndexableError, match=r"data_loader\(\) needs a map-style dataset.*got Sized, "
                                                         r"which lacks __len__ or __getitem__"):
        sampler.data_loader(Sized(), n_steps=STEPS_PER_EPOCH)
    with pytest.raises(DatasetNotIndexableError, match=r"got an IterableDataset"):
        sampler.data_loader(_StreamOfKnownLength(_examples(EXAMPLES)), n_steps=STEPS_PER_EPOCH)
    # Control: a list of the same examples is served.
    assert sum(len(y) for _, y in sampler.data_loader(_examples(EXAMPLES), n_steps=STEPS_PER_EPOCH)) == EXAMPLES


@pytest.mark.parametrize("privacy_unit", [None, []], ids=["examples", "users"])
def test_an_empty_dataset_is_called_empty(privacy_unit):
    model = _model()
    with pytest.raises(DatasetTooSmallError, match=r"the dataset is empty") as refusal:
        _make(model, _GrowableDataset([]), privacy_unit=privacy_unit)
    assert "batch_size <= 0" not in str(refusal.value)  # the old advice
    assert isinstance(refusal.value, OpakeError) and isinstance(refusal.value, ValueError)
    assert _untouched(model)
    # Control: a data set of exactly one batch is accepted.
    units = None if privacy_unit is None else list(range(BATCH_SIZE))
    assert _make(model, _GrowableDataset(_examples(BATCH_SIZE)), privacy_unit=units).plan.steps_per_epoch == 1


def test_a_dataset_smaller_than_a_batch_is_called_too_small():
    model = _model()
    with pytest.raises(DatasetTooSmallError, match=r"the dataset is too small: it has 3 examples, fewer than "
                                                     r"batch_size=8.*use batch_size <= 3 or more data"):
        _make(model, _GrowableDataset(_examples(3)))
    assert _untouched(model)
    assert _make(model, _GrowableDataset(_examples(BATCH_SIZE))).plan.steps_per_epoch == 1  # control


# -- Data that changes after planning ------------------------------------------------------------------------


@pytest.mark.parametrize("change, current", [
    (lambda data: data.examples.extend(_examples(5, seed=1)), EXAMPLES + 5),
    (lambda data: data.examples.__delitem__(slice(-3, None)), EXAMPLES - 3),
], ids=["grown", "shrunk"])
@pytest.mark.parametrize("changed", [True, False], ids=["changed", "control"])
def test_a_dataset_changed_between_epochs_is_refused_before_its_batch_is_served(change, current, changed):
    data = _GrowableDataset(_examples(EXAMPLES))
    model = _model()
    private = _make(model, data)
    assert _train_one_pass(private) == STEPS_PER_EPOCH
    after_first_epoch = _snapshot(model)
    last_gradients = [p.grad.clone() for p in model.parameters()]  # the noised gradient of the last step
    if not changed:  # control: the second epoch trains
        assert _train_one_pass(private) == STEPS_PER_EPOCH
        assert private.steps_taken == 2 * STEPS_PER_EPOCH and _moved(model, after_first_epoch)
        return
    change(data)
    served = []
    with pytest.raises(DatasetChangedError, match=rf"holds {current} examples now, but the run was planned over "
                                                   rf"{EXAMPLES}.*Nothing was served or released.*plan a new "
                                                   rf"run over the new data.*add up") as refusal:
        served.append(_train_one_pass(private))
    assert isinstance(refusal.value, OpakeError) and isinstance(refusal.value, RuntimeError)
    assert served == [] and private.steps_taken == STEPS_PER_EPOCH and not _moved(model, after_first_epoch)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), last_gradients))  # no zero_grad, no forward
    if current > EXAMPLES:  # the planned examples again: the run goes on where it stopped
        del data.examples[EXAMPLES:]
        assert _train_one_pass(private) == STEPS_PER_EPOCH and private.steps_taken == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("changed", [True, False], ids=["changed", "control"])
def test_a_dataset_changed_within_an_epoch_is_refused_before_its_last_batch(num_workers, changed):
    """Changed before the epoch's last batch: without workers the check before its fetch refuses it;
    a worker process has fetched it already, and the check as it is served refuses it."""
    data = _GrowableDataset(_examples(EXAMPLES))
    model = _model()
    private = _make(model, data, num_workers=num_workers)
    change_at = STEPS_PER_EPOCH - 1
    at_change = {}

    def grow_before_the_last_batch():
        if private.steps_taken == change_at:
            at_change["parameters"] = _snapshot(model)
            if changed:
                data.examples.append(_examples(1, seed=2)[0])

    if not changed:  # control: the epoch's last batch trains
        assert _train_one_pass(private, after_each_step=grow_before_the_last_batch) == STEPS_PER_EPOCH
        assert private.steps_taken == STEPS_PER_EPOCH and _moved(model, at_change["parameters"])
        return
    with pytest.raises(DatasetChangedError, match=rf"holds {EXAMPLES + 1} examples now.*planned over {EXAMPLES}"):
        _train_one_pass(private, after_each_step=grow_before_the_last_batch)
    assert private.steps_taken == change_at and not _moved(model, at_change["parameters"])


@pytest.mark.parametrize("changed", [True, False], ids=["changed", "control"])
def test_a_user_level_run_checks_its_number_of_examples_the_same_way(changed):
    data = _GrowableDataset(_examples(EXAMPLES))
    ids = [i // 2 for i in range(EXAMPLES)]  # 20 users of 2 examples
    model = _model()
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=data,
                           batch_size=4, epochs=2, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                           strategy=identity_strategy(), key=key(1), privacy_unit=ids)
    steps_per_epoch = 20 // 4
    assert _train_one_pass(private) == steps_per_epoch
    after_first_epoch = _snapshot(model)
    if not changed:
        assert _train_one_pass(private) == steps_per_epoch and _moved(model, after_first_epoch)
        return
    data.examples.extend(_examples(2, seed=3))  # a new user's two examples
    with pytest.raises(DatasetChangedError, match=rf"holds {EXAMPLES + 2} examples now, but the run was planned "
                                                   rf"over {EXAMPLES} \(the examples privacy_unit gave ids for\)"
                                                   rf".*one id per example"):
        _train_one_pass(private)
    assert private.steps_taken == steps_per_epoch and not _moved(model, after_first_epoch)
