"""opake.torch.PrivacyEngine: Opacus scripts keep their meaning (docs/from_opacus.md).

What Opacus' own public-API tests check, in opake's terms: the noise-multiplier form is DP-SGD
with Poisson sampling and its epsilon is the PLD of the Poisson-subsampled Gaussian composed once
per step (dp_accounting called here directly, and an RDP figure above it; Opacus' PRV above it
where Opacus is installed); a target epsilon is met, never exceeded; torch.manual_seed
reproduces a run and another seed does not; BatchMemoryManager's physical parts give the
trained model of the logical batches; checkpoints round-trip; what is refused is refused before
anything moves. Small data (a few hundred examples), a few seconds each.
"""

from __future__ import annotations

import difflib
import io
import pathlib
import re
import warnings

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from torch import nn

import opake.torch
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.random import key
from opake.torch import (BatchMemoryManager, DPOptimizer, ModuleValidator, PlanExhaustedError, PrivacyEngine,
                         UnplannedBatchError)
from opake.torch.opacus import UNPLANNED_EPOCHS
from opake.torch.validation import ModelValidationError

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "from_opacus.md"
EPOCHS, EPSILON, DELTA, MAX_GRAD_NORM = 3, 8.0, 1e-5, 1.0


def _dataset(count=256, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 6, generator=generator, dtype=dtype)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return torch.utils.data.TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _loss(model, dataset):
    x, y = dataset.tensors
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def _epoch(model, optimizer, loader) -> int:
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        if len(y):
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    return steps


def _sigma_run(seed=0, *, engine=None, passes=1, dataset=None, batch_size=32, memory=None, noise_multiplier=4.0,
               **options):
    """torch.manual_seed(seed), a model, the noise-multiplier form, ``passes`` epochs trained; (engine, parameters).
    A large noise multiplier keeps the PLDs narrow, so each pricing takes a tenth of a second."""
    torch.manual_seed(seed)
    dataset = _dataset(dtype=torch.float64) if dataset is None else dataset
    model = Net().double()
    engine = PrivacyEngine() if engine is None else engine
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=batch_size), noise_multiplier=noise_multiplier,
        max_grad_norm=1.0, **options)
    for _ in range(passes):
        if memory is None:
            _epoch(model, optimizer, loader)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=memory, optimizer=optimizer) as parts:
                _epoch(model, optimizer, parts)
    return engine, torch.cat([p.detach().flatten() for p in model.parameters()])


def _pld_epsilon(sigma, rate, steps, delta=DELTA):
    """dp_accounting's PLD of the Poisson-subsampled Gaussian composed ``steps`` times, called directly."""
    accountant = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(delta)


def _rdp_epsilon(sigma, rate, steps, delta=DELTA):
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(delta)


# --- the noise-multiplier form is Opacus' mechanism, priced by an independent PLD ---------------

def test_noise_multiplier_form_is_poisson_dp_sgd_priced_by_the_poisson_pld():
    dataset = _dataset(count=1024, dtype=torch.float64)
    engine, _ = _sigma_run(dataset=dataset, passes=0, batch_size=16, epochs=2, noise_multiplier=1.0)
    plan = engine.private.plan
    assert (plan.sampling, str(plan.accounting), plan.num_groups) == ("poisson", "pld", 1)
    assert plan.strategy == identity_strategy() and plan.sample_rate == 16 / 1024
    assert plan.steps_per_epoch == 1024 // 16 and plan.n_steps == 2 * 64
    assert engine.accountant.mechanism() == "pld" and engine.private.optimizer.expected_batch_size == 16
    independent = _pld_epsilon(1.0, 16 / 1024, 128)
    assert plan.epsilon == pytest.approx(independent, rel=1e-9)
    assert independent < _rdp_epsilon(1.0, 16 / 1024, 128) < 1.5 * independent   # the RDP bound is looser
    assert _pld_epsilon(1.0, 32 / 1024, 128) > 1.2 * independent                 # control: the rate matters


def test_without_epochs_the_plan_is_a_limit_and_get_epsilon_prices_the_steps_taken():
    dataset = _dataset(count=1024, dtype=torch.float64)
    engine, _ = _sigma_run(dataset=dataset, batch_size=16, passes=1)
    plan = engine.private.plan
    assert plan.n_steps == UNPLANNED_EPOCHS * 64 and engine.private.steps_taken == 64
    spent = engine.get_epsilon(DELTA)
    assert spent == pytest.approx(_pld_epsilon(4.0, 16 / 1024, 64), rel=1e-9)
    assert spent == engine.accountant.get_epsilon(delta=DELTA) < engine.private.epsilon
    assert engine.accountant.history == [(4.0, 16 / 1024, 64)] and len(engine.accountant) == 1
    assert engine.get_epsilon(1e-7) > spent


@pytest.mark.parametrize("options, named", [
    (dict(strategy=blt_strategy()), "BLTStrategy"),
    (dict(strategy=band_mf_strategy(bands=2)), "BandMFStrategy"),
])
def test_horizon_dependent_mechanisms_need_epochs(options, named):
    with pytest.raises(TypeError, match=rf"{named}.*add epochs=EPOCHS"):
        _sigma_run(passes=0, **options)


def test_poisson_sampling_false_is_dp_sgd_on_balls_in_bins_priced_by_the_allocation_pld():
    torch.manual_seed(0)
    model = Net()
    engine = PrivacyEngine()
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                        data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=32), noise_multiplier=2.0,
                        max_grad_norm=1.0, epochs=2, poisson_sampling=False)
    plan = engine.private.plan
    assert (plan.sampling, str(plan.accounting), plan.num_bins) == ("balls_in_bins", "allocation_pld", 8)
    assert plan.strategy == identity_strategy()


# --- a target epsilon: the least noise among the proven mechanisms, never above the target -----

def test_target_epsilon_is_met_by_the_chosen_mechanism_and_the_choice_is_stated():
    torch.manual_seed(0)
    model, dataset = Net(), _dataset()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=32), epochs=2, target_epsilon=EPSILON,
        target_delta=DELTA, max_grad_norm=1.0)
    choice, plan = engine.choice, engine.private.plan
    assert (choice.strategy, choice.sampling, choice.noise_multiplier) == (plan.strategy, plan.sampling,
                                                                           plan.noise_multiplier)
    assert str(plan.accounting) == choice.accounting != "amplified"
    assert 0.998 * EPSILON <= engine.private.epsilon == choice.epsilon <= EPSILON
    assert choice.chosen.error == min(c.error for c in choice.candidates)
    assert "<- chosen" in choice.table() and choice.chosen.name in choice.reason
    for _ in range(2):
        _epoch(model, optimizer, loader)
    assert engine.get_epsilon(DELTA) == engine.private.epsilon <= EPSILON


def test_poisson_sampling_false_keeps_the_choice_on_balls_in_bins():
    torch.manual_seed(0)
    model = Net()
    engine = PrivacyEngine()
    engine.make_private_with_epsilon(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                     data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=32), epochs=2,
                                     target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=1.0,
                                     poisson_sampling=False)
    assert {c.sampling for c in engine.choice.candidates} == {"balls_in_bins"}
    assert engine.private.plan.sampling == "balls_in_bins" and engine.private.epsilon <= EPSILON


# --- randomness: torch.manual_seed reproduces, secure_mode draws from the OS -------------------

@pytest.mark.parametrize("noise_correction", [None, False])
def test_an_adam_is_corrected_for_the_noise_unless_told_not_to(noise_correction):
    torch.manual_seed(0)
    model = Net().double()
    engine = PrivacyEngine()
    options = {} if noise_correction is None else {"noise_correction": noise_correction}
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        data_loader=torch.utils.data.DataLoader(_dataset(dtype=torch.float64), batch_size=32), noise_multiplier=4.0,
        max_grad_norm=1.0, epochs=1, **options)
    _epoch(model, optimizer, loader)
    corrected = engine.private.noise_correction.enabled
    assert corrected == (noise_correction is None)
    assert all(("noise_variance_average" in state) == corrected for state in optimizer.state.values())


def test_torch_manual_seed_reproduces_a_run_and_another_seed_does_not():
    _, first = _sigma_run(0, passes=1, epochs=1)
    _, again = _sigma_run(0, passes=1, epochs=1)
    _, other = _sigma_run(1, passes=1, epochs=1)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)


def test_secure_mode_keys_come_from_the_os_and_exclude_a_given_key():
    _, first = _sigma_run(0, engine=PrivacyEngine(secure_mode=True), passes=1, epochs=1)
    _, second = _sigma_run(0, engine=PrivacyEngine(secure_mode=True), passes=1, epochs=1)
    assert not torch.allclose(first, second)     # same seed, same model: only the OS key differs
    with pytest.raises(ValueError, match=r"key= and secure_mode=True"):
        _sigma_run(0, engine=PrivacyEngine(secure_mode=True), passes=0, key=key(1), epochs=1)


# --- BatchMemoryManager: physical parts, one step per planned batch ----------------------------

def test_physical_parts_train_the_model_of_the_logical_batches():
    logical_engine, logical = _sigma_run(0, passes=2, epochs=2)
    physical_engine, physical = _sigma_run(0, passes=2, memory=5, epochs=2)
    assert torch.allclose(logical, physical, rtol=0, atol=1e-12)
    assert physical_engine.private.steps_taken == logical_engine.private.steps_taken == 16


def test_physical_parts_are_small_and_unsignalled_parts_are_refused():
    torch.manual_seed(0)
    model = Net()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=32), noise_multiplier=1.0,
        max_grad_norm=1.0, epochs=1)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=7, optimizer=optimizer) as parts:
        sizes = [len(y) for _, y in parts]
    assert max(sizes) <= 7 and sum(sizes) == sum(len(engine.private.run.batches.indices(s)) for s in range(8))
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=7, optimizer=optimizer) as parts:
        x, y = next(iter(parts))                 # the first part of a larger planned batch
        F.cross_entropy(model(x), y).backward()
        optimizer.clear_skipped_steps()          # control: the step is not told it ends a part only
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(UnplannedBatchError, match=r"planned batch 0 has"):
            optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(TypeError, match=r"the loader make_private returned"):
        BatchMemoryManager(data_loader=torch.utils.data.DataLoader(_dataset()), max_physical_batch_size=4,
                           optimizer=optimizer)


# --- checkpoints -------------------------------------------------------------------------------

def test_checkpoint_round_trip_restores_the_run_replayed_or_with_new_noise():
    _, uninterrupted = _sigma_run(0, passes=2, epochs=2)
    saver, _ = _sigma_run(0, passes=1, epochs=2)
    buffer = io.BytesIO()
    saver.save_checkpoint(path=buffer, module=saver.private.module, optimizer=saver.private.optimizer,
                          checkpoint_dict={"epoch": 1})
    results = {}
    for draws in ("replay", None):
        buffer.seek(0)
        loader_engine, _ = _sigma_run(0, passes=0, epochs=2)
        extra = loader_engine.load_checkpoint(path=buffer, module=loader_engine.private.module,
                                              optimizer=loader_engine.private.optimizer, draws=draws)
        assert extra == {"epoch": 1}
        assert loader_engine.private.steps_taken == 8
        assert loader_engine.accountant.state_dict() == saver.accountant.state_dict()
        private = loader_engine.private
        _epoch(private.module, private.optimizer, private.data_loader)
        results[draws] = torch.cat([p.detach().flatten() for p in private.module.parameters()])
    assert torch.equal(results["replay"], uninterrupted)        # the same noise: the same run
    assert not torch.allclose(results[None], uninterrupted)     # the default: new noise after the checkpoint


def test_a_checkpoint_loads_only_into_the_same_plan_and_key():
    saver, _ = _sigma_run(0, passes=1, epochs=2)
    buffer = io.BytesIO()
    saver.save_checkpoint(path=buffer, module=saver.private.module)
    buffer.seek(0)
    other, _ = _sigma_run(1, passes=0, epochs=2)       # another seed: another key
    before = [p.detach().clone() for p in other.private.module.parameters()]
    with pytest.raises(ValueError, match=r"another plan or key"):
        other.load_checkpoint(path=buffer, module=other.private.module)
    assert all(torch.equal(a, p) for a, p in zip(before, other.private.module.parameters()))
    with pytest.raises(ValueError, match=r"not one of opake.torch.opacus' schedulers"):
        saver.save_checkpoint(path=io.BytesIO(), module=saver.private.module, noise_scheduler=object())


# --- models: Opacus' validator and compatible modules, recurrent layers -------------------------

class Recurrent(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.rnn, self.fc = layer, nn.Linear(4, 2)

    def forward(self, x):
        out, _ = self.rnn(x.view(x.shape[0], 3, 2))
        return self.fc(out[:, -1])


@pytest.mark.parametrize("layer", [nn.LSTM(2, 4, batch_first=True), nn.GRU(2, 4, batch_first=True),
                                   nn.LSTMCell(2, 4)], ids=["LSTM", "GRU", "LSTMCell"])
def test_recurrent_layers_are_refused_by_name_before_anything_moves(layer):
    model = Recurrent(layer)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    with pytest.raises(ModelValidationError, match=rf"rnn \({type(layer).__name__}\): a recurrent layer.*DPLSTM"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                     data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=32),
                                     noise_multiplier=1.0, max_grad_norm=1.0)
    assert not model._forward_hooks and not model.rnn._forward_hooks and not model.rnn._backward_hooks
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())


def test_get_compatible_module_and_module_validator_fix_what_they_can():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    assert not ModuleValidator.is_valid(model) and len(ModuleValidator.validate(model)) == 1
    with pytest.raises(ModelValidationError, match=r"BatchNorm1d"):
        ModuleValidator.validate(model, strict=True)
    fixed = PrivacyEngine.get_compatible_module(model)
    assert isinstance(fixed[1], nn.GroupNorm) and ModuleValidator.is_valid(fixed)
    assert isinstance(model[1], nn.BatchNorm1d)                        # the caller's model is untouched
    recurrent = ModuleValidator.fix(Recurrent(nn.LSTM(2, 4, batch_first=True)))
    assert isinstance(recurrent.rnn, opake.torch.DPLSTM) and PrivacyEngine.is_compatible(module=recurrent)
    with pytest.raises(ModelValidationError, match=r"LSTMCell"):
        PrivacyEngine.get_compatible_module(Recurrent(nn.LSTMCell(2, 4)))


# --- what is refused -----------------------------------------------------------------------------

def _refused(message, exception=ValueError, engine=None, **changes):
    torch.manual_seed(0)
    model = Net()
    call = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=32), noise_multiplier=1.0,
                max_grad_norm=1.0, epochs=1)
    call.update(changes)
    with pytest.raises(exception, match=message):
        (engine or PrivacyEngine()).make_private(**call)


@pytest.mark.parametrize("changes, message", [
    (dict(clipping="per_layer"), r"clipping='per_layer' takes max_grad_norm as a list of one bound per trainable"),
    (dict(clipping="adaptive"), r"clipping='adaptive' needs .*missing \['target_unclipped_quantile'"),
    (dict(clipping="quantile"), r"clipping must be one of \('flat', 'per_layer', 'adaptive'\).*'quantile'"),
    (dict(max_grad_norm=[1.0, 1.0]), r"clipping='flat' takes one float max_grad_norm.*clipping='per_layer'"),
    (dict(grad_sample_mode="no_op"), r"one of Opacus' modes \('hooks', 'ghost', 'functorch', 'ew'\).*'no_op'"),
    (dict(noise_generator=torch.Generator()), r"noise_generator.*torch.manual_seed"),
    (dict(rand_on_empty=True), r"rand_on_empty=True"),
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


def test_other_refusals_and_the_empty_accountant():
    _refused(r"does not take \['total_steps'\]", TypeError, total_steps=10)
    with pytest.raises(ValueError, match=r"accountant must be one of"):
        PrivacyEngine(accountant="moments")
    engine = PrivacyEngine(accountant="rdp")
    assert engine.get_epsilon(DELTA) == 0.0 and engine.accountant.history == [] and len(engine.accountant) == 0
    _sigma_run(engine=engine, passes=0, epochs=1)
    with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
        engine.get_epsilon(0.0)
    _refused(r"planned a run already.*new PrivacyEngine", engine=engine)
    assert issubclass(PlanExhaustedError, RuntimeError)


def test_the_loader_serves_one_planned_epoch_per_pass_and_stops_after_the_plan():
    engine, _ = _sigma_run(0, passes=1, epochs=1)
    with pytest.raises(PlanExhaustedError, match=r"more epochs than make_private"):
        next(iter(engine.private.data_loader))
    assert isinstance(engine.private.optimizer, DPOptimizer)


def test_the_returned_loader_given_to_a_new_engine_plans_a_fresh_run_over_the_same_data():
    # Opacus' examples/mnist.py --n-runs: each run builds a new model and engine but privatizes the loader
    # the previous make_private returned. Opacus reads its DPDataLoader as the same data at the same rate;
    # so does the adapter: the dataset, batch size and loading options of the DataLoader it was made from.
    collate = torch.utils.data.default_collate
    first, _ = _sigma_run(0, passes=1, epochs=1, noise_multiplier=2.0)
    planned = first.private.data_loader
    torch.manual_seed(1)
    model = Net().double()
    second = PrivacyEngine()
    _, optimizer, loader = second.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=planned,
        noise_multiplier=2.0, max_grad_norm=1.0)
    assert loader is not planned and loader.dataset is planned.dataset and loader.collate_fn is not collate
    one, two = first.private.plan, second.private.plan
    assert (two.sampling, two.sample_rate, two.steps_per_epoch) == ("poisson", one.sample_rate, one.steps_per_epoch)
    assert optimizer.expected_batch_size == 32 and second.private.steps_taken == 0 and second.get_epsilon(DELTA) == 0
    assert _epoch(model, optimizer, loader) == 8
    assert second.get_epsilon(DELTA) == pytest.approx(_pld_epsilon(2.0, 32 / 256, 8), rel=1e-9)
    with pytest.raises(PlanExhaustedError):          # the first loader still serves the first run (1 epoch, done)
        next(iter(planned))
    # The loading options come with it (here a collate function of the caller's).
    seen = []

    def counting(batch):
        seen.append(len(batch))
        return torch.utils.data.default_collate(batch) if batch else collate([_dataset()[0]])

    torch.manual_seed(2)
    model = Net()
    engines = [PrivacyEngine(), PrivacyEngine()]
    _, _, returned = engines[0].make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=2.0,
        data_loader=torch.utils.data.DataLoader(_dataset(), batch_size=64, collate_fn=counting), max_grad_norm=1.0,
        epochs=1)
    model = Net()
    _, _, again = engines[1].make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                          data_loader=returned, noise_multiplier=2.0, max_grad_norm=1.0, epochs=1)
    assert again.collate_fn is counting and engines[1].private.plan.sample_rate == 64 / 256
    next(iter(again))
    assert len(seen) == 1
    # A planned loader of opake.torch.make_private itself records no batch size: refused, saying what to pass.
    model = Net()
    own = opake.torch.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                   dataset=_dataset(), batch_size=32, epochs=1, max_grad_norm=1.0,
                                   noise_multiplier=2.0, target_delta=DELTA, strategy=identity_strategy(),
                                   sampling="poisson", key=key(0))
    _refused(r"planned loader of a run made by opake.torch.make_private.*DataLoader\(dataset, batch_size=B\)",
             data_loader=own.data_loader)


# --- the documented scripts -----------------------------------------------------------------------

def _doc_blocks():
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)


def test_the_documented_scripts_differ_only_in_the_import_line():
    opacus_block, opake_block = _doc_blocks()[:2]
    diff = [line for line in difflib.ndiff(opacus_block.splitlines(), opake_block.splitlines())
            if line.startswith(("-", "+"))]
    assert [line[2:] for line in diff if line.startswith("-")] == ["from opacus import PrivacyEngine"]
    assert [line[2:] for line in diff if line.startswith("+")] == ["from opake.torch import PrivacyEngine"]
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
    printed = [float(line.split("epsilon ")[1]) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == EPOCHS and printed == sorted(printed) and printed[0] < printed[-1] <= EPSILON
    assert namespace["privacy_engine"].private.steps_taken == EPOCHS * 8


# --- with Opacus -----------------------------------------------------------------------------------

def test_the_same_script_trains_with_opacus_and_with_opake_and_opake_prints_no_larger_epsilon(capsys):
    pytest.importorskip("opacus")
    opacus_namespace = _run_block(_doc_blocks()[0])
    opacus_printed = capsys.readouterr().out
    opake_namespace = _run_block(_doc_blocks()[1])
    opake_printed = capsys.readouterr().out
    assert type(opacus_namespace["privacy_engine"]).__module__.startswith("opacus")
    final = [float(printed.splitlines()[-1].split("epsilon ")[1]) for printed in (opacus_printed, opake_printed)]
    assert final[1] <= final[0] + 0.01           # printed to two decimals


def test_the_pld_is_no_larger_than_opacus_prv_for_the_same_sigma_rate_and_steps():
    accountants = pytest.importorskip("opacus.accountants")
    for sigma, rate, steps in ((1.0, 1 / 8, 24), (0.8, 0.01, 1000), (2.0, 0.05, 300)):
        prv = accountants.PRVAccountant()
        prv.history = [(sigma, rate, steps)]
        assert _pld_epsilon(sigma, rate, steps) <= prv.get_epsilon(DELTA)
