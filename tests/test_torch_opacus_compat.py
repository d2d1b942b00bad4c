"""opake.torch.PrivacyEngine: Opacus' call shapes on make_private (docs/from_opacus.md).

Without Opacus: the adapter trains with the Opacus-shaped calls, its epsilon and batches are
make_private's for the same arguments and key, and it refuses what it does not implement. With
Opacus installed: the same "Opacus script" runs with opacus.PrivacyEngine and with
opake.torch.PrivacyEngine, differing only in the lines docs/from_opacus.md lists."""

from __future__ import annotations

import difflib
import pathlib
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opake.torch
from opake.random import key
from opake.torch import DPOptimizer, PlanExhaustedError, PrivacyEngine, make_private

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "from_opacus.md"
EPOCHS, EPSILON, DELTA, MAX_GRAD_NORM = 3, 8.0, 1e-5, 1.0


def _dataset(count=256, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 6, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return torch.utils.data.TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model(seed=0):
    torch.manual_seed(seed)
    return Net()


def _loss(model, dataset):
    x, y = dataset.tensors
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def _train(model, optimizer, train_loader) -> int:
    """The script's loop, as Opacus users write it: EPOCHS passes; returns the steps taken."""
    steps = 0
    for _ in range(EPOCHS):
        for x, y in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
    return steps


# --- the "Opacus script": a function of the engine class (the import line) --------------------

def opacus_script(PrivacyEngine, dataset):
    """An Opacus training script; returns (loss before, loss after, epsilon, steps)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    before = _loss(model, dataset)

    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=train_loader, epochs=EPOCHS,
        target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=MAX_GRAD_NORM)

    steps = _train(model, optimizer, train_loader)
    return before, _loss(model, dataset), privacy_engine.get_epsilon(DELTA), steps


def opacus_script_sigma(PrivacyEngine, dataset, **changed):
    """The noise-multiplier form; ``changed`` is the documented added line (``epochs=EPOCHS``)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    before = _loss(model, dataset)

    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=1.0, max_grad_norm=MAX_GRAD_NORM, **changed)

    _train(model, optimizer, train_loader)
    return before, _loss(model, dataset), privacy_engine.get_epsilon(DELTA)


# --- without Opacus ---------------------------------------------------------------------------

def test_opacus_shaped_calls_train_and_return_model_optimizer_loader():
    dataset = _dataset()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    before = _loss(model, dataset)
    privacy_engine = PrivacyEngine()
    returned = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=train_loader, epochs=EPOCHS,
        target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=MAX_GRAD_NORM, key=key(3))
    assert len(returned) == 3
    model_out, optimizer_out, loader_out = returned
    assert model_out is model and isinstance(optimizer_out, DPOptimizer)
    assert isinstance(loader_out, torch.utils.data.DataLoader) and loader_out.dataset is dataset
    assert len(loader_out) == 256 // 32
    for epoch in range(EPOCHS):
        for x, y in loader_out:
            optimizer_out.zero_grad()
            F.cross_entropy(model_out(x), y).backward()
            optimizer_out.step()
        assert privacy_engine.private.steps_taken == (epoch + 1) * 8
    assert _loss(model, dataset) < 0.8 * before
    assert 7.9 < privacy_engine.get_epsilon(DELTA) <= EPSILON
    with pytest.raises(PlanExhaustedError, match="more epochs than make_private"):
        next(iter(loader_out))


def _plain_arguments(**extra):
    dataset = _dataset()
    model = _model()
    return dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), **extra), dataset


def test_epsilon_and_batches_are_make_privates_for_the_same_arguments_and_key():
    adapter_arguments, dataset = _plain_arguments()
    engine = PrivacyEngine()
    _, optimizer, loader = engine.make_private_with_epsilon(
        **adapter_arguments, data_loader=torch.utils.data.DataLoader(dataset, batch_size=32), epochs=EPOCHS,
        target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=MAX_GRAD_NORM, key=key(7))
    direct_arguments, _ = _plain_arguments()
    direct = make_private(**direct_arguments, dataset=dataset, batch_size=32, epochs=EPOCHS,
                          target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=MAX_GRAD_NORM, key=key(7))
    assert engine.private.epsilon == direct.epsilon and engine.get_epsilon(DELTA) == 0.0   # nothing spent yet
    assert engine.private.plan.noise_multiplier == direct.plan.noise_multiplier

    served = []
    for _ in range(EPOCHS):        # the epoch passes serve the plan's batches in order
        for x, y in loader:
            served.append(x)
            optimizer.zero_grad()
            F.cross_entropy(engine.private.module(x), y).backward()
            optimizer.step()
    planned = [x for x, _y in direct.run_data_loader()]
    assert len(served) == len(planned) == EPOCHS * 8
    assert all(torch.equal(a, b) for a, b in zip(served, planned))
    assert engine.get_epsilon(DELTA) == direct.epsilon          # all planned steps taken: the whole run's
    assert engine.get_epsilon(1e-7) == pytest.approx(direct.plan.accountant.epsilon_at(1e-7))
    assert engine.get_epsilon(1e-7) > engine.get_epsilon(DELTA)


def test_noise_multiplier_form_needs_epochs_and_reports_any_delta():
    arguments, dataset = _plain_arguments()
    loader = torch.utils.data.DataLoader(dataset, batch_size=32)
    with pytest.raises(TypeError, match=r"needs epochs=.*EPOCHS"):
        PrivacyEngine().make_private(**arguments, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    engine = PrivacyEngine()
    engine.make_private(**arguments, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, epochs=2,
                        key=key(0))
    direct_arguments, _ = _plain_arguments()
    direct = make_private(**direct_arguments, dataset=dataset, batch_size=32, epochs=2, noise_multiplier=1.0,
                          target_delta=DELTA, max_grad_norm=1.0, key=key(0))
    assert engine.private.epsilon == pytest.approx(direct.epsilon, rel=1e-12)
    assert engine.private.delta == min(1e-5, 1 / 256)
    assert engine.private.plan.participation.n_steps == 16


def test_a_pass_resumes_at_the_next_untaken_step():
    arguments, dataset = _plain_arguments()
    engine = PrivacyEngine()
    _, optimizer, loader = engine.make_private_with_epsilon(
        **arguments, data_loader=torch.utils.data.DataLoader(dataset, batch_size=32), epochs=2,
        target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=1.0, key=key(1))
    def train(x, y):
        optimizer.zero_grad()
        F.cross_entropy(engine.private.module(x), y).backward()
        optimizer.step()

    for step, (x, y) in enumerate(loader):
        train(x, y)
        if step == 2:
            break                          # 3 of the epoch's 8 steps taken
    assert len(loader) == 5 and sum(1 for _ in loader) == 5
    for x, y in loader:
        train(x, y)
    assert engine.private.steps_taken == 8 and len(loader) == 8


def test_loading_settings_pass_through():
    arguments, dataset = _plain_arguments()
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.utils.data.default_collate(items) if items else (torch.zeros(0, 6), torch.zeros(0).long())

    user_loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, collate_fn=collate,
                                              num_workers=2, pin_memory=False, persistent_workers=False,
                                              prefetch_factor=3, timeout=30)
    _, _, loader = PrivacyEngine().make_private_with_epsilon(
        **arguments, data_loader=user_loader, epochs=1, target_epsilon=EPSILON, target_delta=DELTA,
        max_grad_norm=1.0, key=key(2))
    assert (loader.num_workers, loader.prefetch_factor, loader.timeout) == (2, 3, 30)
    assert loader.collate_fn is collate and loader.batch_size is None


def _refused(message, exception=ValueError, engine=None, **changes):
    arguments, dataset = _plain_arguments()
    call = dict(**arguments, data_loader=torch.utils.data.DataLoader(dataset, batch_size=32), epochs=1,
                target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=1.0)
    call.update(changes)
    with pytest.raises(exception, match=message):
        (engine or PrivacyEngine()).make_private_with_epsilon(**call)


@pytest.mark.parametrize("changes, message", [
    (dict(poisson_sampling=False), r"poisson_sampling=False.*balls-in-bins"),
    (dict(clipping="per_layer"), r"clipping='per_layer'.*flat clipping, by hooks"),
    (dict(clipping="adaptive"), r"clipping='adaptive'.*flat clipping"),
    (dict(max_grad_norm=[1.0, 1.0]), r"flat clipping.*one float"),
    (dict(grad_sample_mode="ghost"), r"grad_sample_mode='ghost'.*own hooks"),
    (dict(grad_sample_mode="functorch"), r"grad_sample_mode='functorch'"),
    (dict(noise_generator=torch.Generator()), r"noise_generator.*key=opake.random.key"),
    (dict(batch_first=False), r"batch_first=False.*dimension 0"),
    (dict(wrap_model=False), r"never wraps the module"),
])
def test_opacus_options_other_than_the_defaults_are_refused(changes, message):
    _refused(message, **changes)


def test_loaders_without_a_fixed_batch_size_or_indexable_dataset_are_refused():
    dataset = _dataset()
    batch_sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), 32, False)
    _refused(r"no fixed batch_size.*DataLoader\(dataset, batch_size=B\)",
             data_loader=torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(dataset)

    _refused(r"map-style dataset with len", data_loader=torch.utils.data.DataLoader(Stream(), batch_size=32))
    _refused(r"data_loader must be a torch.utils.data.DataLoader", TypeError, data_loader=list(dataset))


def test_other_refusals():
    _refused(r"does not take \['total_steps'\]", TypeError, total_steps=10)
    with pytest.raises(ValueError, match=r"secure_mode=True.*SECURITY.md"):
        PrivacyEngine(secure_mode=True)
    with pytest.raises(ValueError, match=r"accountant must be one of"):
        PrivacyEngine(accountant="moments")
    engine = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match=r"no run is planned yet"):
        engine.get_epsilon(DELTA)
    arguments, dataset = _plain_arguments()
    engine.make_private_with_epsilon(**arguments, data_loader=torch.utils.data.DataLoader(dataset, batch_size=32),
                                     epochs=1, target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
        engine.get_epsilon(0.0)
    _refused(r"planned a run already.*new PrivacyEngine", engine=engine)
    assert issubclass(PlanExhaustedError, RuntimeError)


def test_the_adapter_runs_the_opacus_script_with_only_the_import_changed():
    before, after, epsilon, steps = opacus_script(PrivacyEngine, _dataset())
    assert after < 0.8 * before and 7.9 < epsilon <= EPSILON and steps == EPOCHS * 8
    before, after, epsilon = opacus_script_sigma(PrivacyEngine, _dataset(), epochs=EPOCHS)
    assert after < 0.8 * before and 0 < epsilon < 100


# --- the documented scripts --------------------------------------------------------------------

def _doc_blocks():
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)


def test_the_documented_scripts_differ_only_in_the_marked_lines():
    opacus_block, opake_block = _doc_blocks()[:2]
    diff = [line for line in difflib.ndiff(opacus_block.splitlines(), opake_block.splitlines())
            if line.startswith(("-", "+"))]
    added = [line[2:] for line in diff if line.startswith("+")]
    removed = [line[2:] for line in diff if line.startswith("-")]
    assert added == [line for line in opake_block.splitlines() if "# changed" in line]
    assert removed == ["from opacus import PrivacyEngine"] and len(added) == 1
    assert opake.torch.PrivacyEngine is PrivacyEngine


def _run_block(block):
    namespace = {"Net": Net, "train_dataset": _dataset(), "__name__": "docs_script"}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # Opacus' secure-RNG and hook warnings
        exec(compile(block, str(DOCS), "exec"), namespace)
    return namespace


def test_the_documented_opake_script_runs(capsys):
    namespace = _run_block(_doc_blocks()[1])
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == EPOCHS                                 # the epsilon spent so far, each epoch
    spent = [float(line.split("epsilon ")[1]) for line in printed]
    assert spent == sorted(spent) and spent[0] < spent[-1] and f"{spent[-1]:.2f}" == "8.00"
    assert namespace["privacy_engine"].private.steps_taken == EPOCHS * 8


# --- with Opacus --------------------------------------------------------------------------------

def test_the_same_script_trains_with_opacus_and_with_opake():
    opacus = pytest.importorskip("opacus")
    dataset = _dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opacus_before, opacus_after, opacus_epsilon, _ = opacus_script(opacus.PrivacyEngine, dataset)
        opake_before, opake_after, opake_epsilon, opake_steps = opacus_script(PrivacyEngine, dataset)
    assert opacus_before == opake_before                    # the same model and data
    assert opacus_after < 0.8 * opacus_before and opake_after < 0.8 * opake_before
    assert opacus_epsilon <= EPSILON + 0.1 and 7.9 < opake_epsilon <= EPSILON
    assert opake_steps == EPOCHS * 8


def test_the_noise_multiplier_form_differs_by_the_epochs_line():
    opacus = pytest.importorskip("opacus")
    dataset = _dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opacus_result = opacus_script_sigma(opacus.PrivacyEngine, dataset)
        opake_result = opacus_script_sigma(PrivacyEngine, dataset, epochs=EPOCHS)
    for before, after, epsilon in (opacus_result, opake_result):
        assert after < 0.8 * before and 0 < epsilon < 100


def test_the_documented_opacus_script_runs(capsys):
    pytest.importorskip("opacus")
    namespace = _run_block(_doc_blocks()[0])
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == EPOCHS
    assert type(namespace["privacy_engine"]).__module__.startswith("opacus")
