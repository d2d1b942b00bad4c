"""The plan is a contract (opake.torch.contract): what a user changes after make_private is refused
before anything is computed or released.

Each refusal has the unprotected behaviour as its negative control: the same loop with the
contract switched off (``private.optimizer.contract.enabled = False``) trains a parameter on its
raw, unclipped and un-noised batch gradient, which ``_assert_not_trained_raw`` catches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opake.random
from opake.dpftrl.noise import blt_strategy
from opake.torch import make_private
from opake.torch.checkpoint import CheckpointError
from opake.torch.contract import PlanChangedError, RestartedWorkerError
from opake.torch.ranks import LauncherWorldError

LR = 0.1


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _dataset():
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(48, 4, generator=generator),
                                          torch.randint(0, 3, (48,), generator=generator))


def _private(model, optimizer=None, **overrides):
    settings = dict(module=model, optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=LR),
                    dataset=_dataset(), batch_size=8, epochs=2, max_grad_norm=1.0, noise_multiplier=1.0,
                    target_delta=1e-5, strategy=blt_strategy(max_buffers=2), key=opake.random.key(3))
    settings.update(overrides)
    return make_private(**settings)


def _twin(model) -> nn.Module:
    """A plain, hook-free model with ``model``'s current weights."""
    twin = _model()
    twin.load_state_dict({name: value.detach().clone() for name, value in model.state_dict().items()})
    return twin


def _raw_gradient(model, x, y, name: str, temperature=None) -> torch.Tensor:
    """The unclipped, un-noised batch gradient of parameter ``name`` (of the temperature, if given)."""
    twin = _twin(model)
    logits = twin(x) if temperature is None else twin(x) / temperature
    target = twin.get_parameter(name) if temperature is None else temperature
    return torch.autograd.grad(F.cross_entropy(logits, y), target)[0]


def _assert_not_trained_raw(before, after, raw) -> None:
    """The parameter did not move by the raw gradient's step (the hole: update / lr == raw gradient)."""
    assert not torch.allclose((before - after) / LR, raw, atol=1e-6), "trained on the raw batch gradient"


def _one_step(private, change):
    """Take the first planned step, then apply ``change`` to the module/optimizer and try the second."""
    model, optimizer = private.module, private.optimizer
    batches = iter(private.data_loader)
    x, y = next(batches)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    return change(), next(batches)


def _train_step(private, x, y, extra_optimizer=None):
    private.optimizer.zero_grad()
    if extra_optimizer is not None:
        extra_optimizer.zero_grad()
    F.cross_entropy(private.module(x), y).backward()
    if extra_optimizer is not None:  # the user's own optimizer steps first: the worst order
        extra_optimizer.step()
    private.optimizer.step()


@pytest.mark.parametrize("protected", [True, False])
@pytest.mark.parametrize("optimizer_name", ["SGD", "AdamW"])
def test_a_parameter_unfrozen_after_planning_is_refused(protected, optimizer_name):
    model = _model()
    model[0].weight.requires_grad_(False)
    make = {"SGD": lambda ps: torch.optim.SGD(ps, lr=LR), "AdamW": lambda ps: torch.optim.AdamW(ps, lr=LR)}
    private = _private(model, make[optimizer_name](model.parameters()))
    private.optimizer.contract.enabled = protected

    def unfreeze():
        model[0].weight.requires_grad_(True)

    _, (x, y) = _one_step(private, unfreeze)
    before = model[0].weight.detach().clone()
    raw = _raw_gradient(model, x, y, "0.weight")
    if protected:
        with pytest.raises(PlanChangedError, match="was frozen .* when the run was planned"):
            _train_step(private, x, y)
        assert torch.equal(model[0].weight, before) and private.steps_taken == 1
        assert model[0].weight.grad is None  # refused before the forward pass: no gradient was computed
    else:  # the hole: the unfrozen weight trains on its raw batch gradient (SGD: update / lr == raw)
        _train_step(private, x, y)
        if optimizer_name == "SGD":
            with pytest.raises(AssertionError, match="raw batch gradient"):
                _assert_not_trained_raw(before, model[0].weight.detach(), raw)
        else:
            assert not torch.equal(model[0].weight, before)


@pytest.mark.parametrize("protected", [True, False])
def test_a_parameter_group_added_after_planning_is_refused(protected):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    private = _private(model, optimizer)
    private.optimizer.contract.enabled = protected
    temperature = nn.Parameter(torch.tensor(2.0))

    _, (x, y) = _one_step(private, lambda: optimizer.add_param_group({"params": [temperature]}))
    private.optimizer.zero_grad()
    raw = _raw_gradient(model, x, y, "", temperature)
    F.cross_entropy(model(x) / temperature, y).backward()  # a learnable temperature outside the module
    before = temperature.detach().clone()
    if protected:
        with pytest.raises(PlanChangedError, match="add_param_group"):
            private.optimizer.step()
        assert torch.equal(temperature, before) and private.steps_taken == 1
    else:
        private.optimizer.step()
        with pytest.raises(AssertionError, match="raw batch gradient"):
            _assert_not_trained_raw(before, temperature.detach(), raw)


def test_a_group_added_through_the_private_optimizer_is_refused_at_once():
    private = _private(_model())
    with pytest.raises(PlanChangedError, match="fixed by its privacy plan"):
        private.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


@pytest.mark.parametrize("protected", [True, False])
def test_a_layer_replaced_after_planning_is_refused_before_its_own_optimizer_can_train_it(protected):
    model = _model()
    private = _private(model)
    private.optimizer.contract.enabled = protected
    head_optimizer = []

    def replace_head():
        model[2] = nn.Linear(8, 3)
        head_optimizer.append(torch.optim.SGD(model[2].parameters(), lr=LR))

    _, (x, y) = _one_step(private, replace_head)
    before = model[2].weight.detach().clone()
    raw = _raw_gradient(model, x, y, "2.weight")
    if protected:
        with pytest.raises(PlanChangedError, match="'2.weight' is not the Parameter object that was planned"):
            _train_step(private, x, y, head_optimizer[0])
        assert torch.equal(model[2].weight, before) and model[2].weight.grad is None
    else:
        _train_step(private, x, y, head_optimizer[0])  # the head's own optimizer applies the raw gradient
        with pytest.raises(AssertionError, match="raw batch gradient"):
            _assert_not_trained_raw(before, model[2].weight.detach(), raw)


@pytest.mark.parametrize("protected", [True, False])
def test_a_parameter_replaced_after_planning_is_refused_not_left_untrained(protected):
    model = _model()
    private = _private(model)
    private.optimizer.contract.enabled = protected

    def replace_weight():
        model[2].weight = nn.Parameter(model[2].weight.detach().clone())

    _, (x, y) = _one_step(private, replace_weight)
    before = model[2].weight.detach().clone()
    if protected:
        with pytest.raises(PlanChangedError, match="replaced after make_private"):
            _train_step(private, x, y)
    else:  # the hole: the new Parameter silently never trains (the noise goes to the old object)
        _train_step(private, x, y)
        assert torch.equal(model[2].weight, before)


def test_a_planned_parameter_frozen_after_planning_is_refused():
    model = _model()
    private = _private(model)
    _, (x, y) = _one_step(private, lambda: model[2].bias.requires_grad_(False))
    with pytest.raises(PlanChangedError, match="frozen .* after make_private"):
        _train_step(private, x, y)


def test_evaluation_without_gradients_is_not_checked():
    model = _model()
    private = _private(model)
    model[0].weight.requires_grad_(False)  # e.g. a probe freezing for an evaluation under no_grad
    with torch.no_grad():
        model(torch.randn(2, 4))
    model[0].weight.requires_grad_(True)
    x, y = next(iter(private.data_loader))
    _train_step(private, x, y)
    assert private.steps_taken == 1


def test_gradual_unfreezing_recipe_holds_a_stage_still_then_trains_it():
    """docs/torch.md's recipe: every parameter trainable at planning, a later stage held still by a
    learning rate of 0 until it begins; the run never leaves the plan."""
    model = _model()
    head = list(model[2].parameters())
    body = list(model[0].parameters())
    optimizer = torch.optim.SGD([{"params": head, "lr": LR}, {"params": body, "lr": 0.0}], lr=LR)
    private = _private(model, optimizer)
    frozen_body = [p.detach().clone() for p in body]
    for epoch in range(2):
        if epoch == 1:
            optimizer.param_groups[1]["lr"] = LR  # the body's stage begins
        for x, y in private.data_loader:
            _train_step(private, x, y)
        if epoch == 0:
            assert all(torch.equal(p, b) for p, b in zip(body, frozen_body))
    assert not all(torch.equal(p, b) for p, b in zip(body, frozen_body))
    assert private.steps_taken == private.plan.n_steps


def test_a_restarted_worker_must_restore_its_run(monkeypatch, tmp_path):
    model = _model()
    private = _private(model)
    x, y = next(iter(private.data_loader))
    _train_step(private, x, y)
    torch.save(private.state_dict(), tmp_path / "run.pt")

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = _private(_model(), key=opake.random.key(3))
    x, y = next(iter(restarted.data_loader))
    before = [p.detach().clone() for p in restarted.module.parameters()]
    with pytest.raises(RestartedWorkerError, match="TORCHELASTIC_RESTART_COUNT=1"):
        _train_step(restarted, x, y)
    assert all(torch.equal(p, b) for p, b in zip(restarted.module.parameters(), before))
    restarted.load_state_dict(torch.load(tmp_path / "run.pt", weights_only=True), draws="replay")
    x, y = next(iter(restarted.data_loader))
    _train_step(restarted, x, y)
    assert restarted.steps_taken == 2

    deliberate = _private(_model(), key=opake.random.key(4))
    deliberate.new_run_after_restart()
    x, y = next(iter(deliberate.data_loader))
    _train_step(deliberate, x, y)
    assert deliberate.steps_taken == 1


@pytest.mark.parametrize("world", ["2", "1"])
def test_a_launcher_with_several_processes_and_no_group_is_refused(monkeypatch, world):
    monkeypatch.setenv("WORLD_SIZE", world)
    if world == "1":  # the control: one process plans as before
        assert _private(_model()).steps_taken == 0
        return
    model = _model()
    with pytest.raises(LauncherWorldError, match="WORLD_SIZE=2"):
        _private(model)
    assert not hasattr(model, "_opake_private_training")  # nothing was hooked


# -- checkpoints: whole, validated before anything is replaced --------------------------------------------


def _trained(steps: int, seed: int = 0):
    private = _private(_model(seed))
    loader = iter(private.run_data_loader())
    for _ in range(steps):
        x, y = next(loader)
        _train_step(private, x, y)
    return private


def _state_of(private) -> list:
    return [t.detach().clone() for t in private.module.state_dict().values()]


def _flip_bit(tensor: torch.Tensor, index: int) -> None:
    flat = tensor.view(-1).view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.view(-1)
    flat[index % flat.numel()] ^= 1 << (index % 8)


@pytest.mark.parametrize("entry", ["module", "optimizer", "noise"])
def test_a_flipped_bit_anywhere_in_a_checkpoint_is_refused(entry, tmp_path):
    saved = _trained(2).state_dict()
    torch.save(saved, tmp_path / "run.pt")
    generator = torch.Generator().manual_seed(7)
    tensors = {"module": lambda sd: list(sd["module"].values()),
               "optimizer": lambda sd: [s for state in sd["optimizer"]["state"].values() for s in state.values()
                                        if isinstance(s, torch.Tensor)] or [torch.zeros(0)],
               "noise": lambda sd: [sd["noise"]["buffers"]]}
    candidates = [t for t in tensors[entry](torch.load(tmp_path / "run.pt", weights_only=True)) if t.numel()]
    if not candidates:  # SGD without momentum keeps no optimizer state: flip a learning rate instead
        corrupted = torch.load(tmp_path / "run.pt", weights_only=True)
        corrupted["optimizer"]["param_groups"][0]["lr"] *= 1.0000001
        flips = [corrupted]
    else:
        flips = []
        for trial in range(5):
            corrupted = torch.load(tmp_path / "run.pt", weights_only=True)
            chosen = tensors[entry](corrupted)[trial % len(candidates)]
            _flip_bit(chosen, int(torch.randint(0, 1 << 20, (1,), generator=generator)))
            flips.append(corrupted)
    fresh = _private(_model(5))
    before = _state_of(fresh)
    for corrupted in flips:
        with pytest.raises(CheckpointError, match="do not match its digest"):
            fresh.load_state_dict(corrupted, draws="replay")
        assert all(torch.equal(a, b) for a, b in zip(_state_of(fresh), before))
    fresh.load_state_dict(torch.load(tmp_path / "run.pt", weights_only=True), draws="replay")  # the intact one
    assert fresh.steps_taken == 2


def test_a_model_that_does_not_fit_is_refused_before_any_weight_moves():
    saved = _trained(2).state_dict()
    fresh = _private(_model(5))
    fresh.module.register_buffer("extra", torch.zeros(2))
    before = _state_of(fresh)
    with pytest.raises(CheckpointError, match="missing"):
        fresh.load_state_dict(saved, draws="replay")
    assert all(torch.equal(a, b) for a, b in zip(_state_of(fresh), before))
    x, y = next(iter(fresh.data_loader))  # the noise state was not retired: the run still steps
    _train_step(fresh, x, y)
    assert fresh.steps_taken == 1


def test_an_older_checkpoint_is_refused_by_a_live_run_past_it():
    private = _private(_model())
    loader = iter(private.run_data_loader())
    x, y = next(loader)
    _train_step(private, x, y)
    old = copy.deepcopy(private.state_dict())  # the state dict holds live tensors
    for _ in range(3):
        x, y = next(loader)
        _train_step(private, x, y)
    spent = private.epsilon_spent()
    with pytest.raises(CheckpointError, match="already released 4 steps"):
        private.load_state_dict(old, draws="replay")
    assert private.steps_taken == 4 and private.epsilon_spent() == spent


def test_a_checkpoint_without_the_whole_digest_loads_with_a_warning():
    saved = _trained(1).state_dict()
    del saved["digest"]
    fresh = _private(_model(5))
    with pytest.warns(UserWarning, match="no whole digest"):
        fresh.load_state_dict(saved, draws="replay")
    assert fresh.steps_taken == 1
