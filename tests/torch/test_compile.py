"""torch.compile and a private module: refused, before anything is hooked (compiled before
make_private) or before the compiled call computes anything (compiled after it). The per-example
hooks carry Python state from each layer call to the backward pass, which the compiler cannot
trace exactly. Each refusal is checked against the same loop on the uncompiled module, which
trains: the parameters move and the steps advance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake.dpftrl.noise import identity_strategy
from opake.errors import OpakeError
from opake.random import key
from opake.torch import CompiledModuleError, make_private

EXAMPLES, BATCH_SIZE = 40, 8
STEPS = EXAMPLES // BATCH_SIZE  # one epoch of 5 bins


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Every test compiles Module._call_impl for a new module; past the compiler's recompilation limit
    it would run the calls eagerly and stop tracing the hooks, so its caches are cleared after each."""
    yield
    torch._dynamo.reset()


def _dataset():
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(EXAMPLES, 5, generator=generator),
                                          torch.randint(0, 3, (EXAMPLES,), generator=generator))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _make(module: nn.Module):
    return make_private(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), dataset=_dataset(),
                        batch_size=BATCH_SIZE, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                        strategy=identity_strategy(), key=key(1))


def _train(private, call) -> None:
    for x, y in private.data_loader:
        private.optimizer.zero_grad()
        F.cross_entropy(call(x), y).backward()
        private.optimizer.step()


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _moved(model: nn.Module, snapshot: list[torch.Tensor]) -> bool:
    return any(not torch.equal(p, q) for p, q in zip(model.parameters(), snapshot))


def _hooked(model: nn.Module) -> bool:
    return any(layer._forward_pre_hooks or layer._forward_hooks for layer in model.modules())


# -- Compiled before make_private ------------------------------------------------------------------------------


def test_make_private_refuses_a_compiled_module_and_names_the_module_it_wraps():
    model = _model()
    compiled = torch.compile(model)
    before = _snapshot(model)
    with pytest.raises(CompiledModuleError, match=r"the module is compiled \(OptimizedModule\).*Nothing was hooked "
                                                   r"or planned.*make_private\(module=model._orig_mod") as refusal:
        _make(compiled)
    assert isinstance(refusal.value, OpakeError) and isinstance(refusal.value, RuntimeError)
    assert not _hooked(compiled) and not _moved(model, before)
    # Control: the fix the message names, the uncompiled module, is accepted and trains.
    private = _make(compiled._orig_mod)
    _train(private, private.module)
    assert private.steps_taken == STEPS and _moved(model, before)


def test_make_private_refuses_a_module_compiled_in_place():
    model = _model()
    model.compile()
    with pytest.raises(CompiledModuleError, match=r"the module is compiled \(Sequential\).*without \.compile\(\)"):
        _make(model)
    assert not _hooked(model)
    assert _make(_model()).plan.n_steps == STEPS  # control: the same model, not compiled, is accepted


@pytest.mark.parametrize("compile_submodule", [
    lambda model: model.__setitem__(2, torch.compile(model[2])),
    lambda model: model[2].compile(),
], ids=["wrapped", "in_place"])
def test_make_private_refuses_a_compiled_submodule(compile_submodule):
    model = _model()
    compile_submodule(model)
    with pytest.raises(CompiledModuleError, match=r"its submodule '2' is compiled"):
        _make(model)
    assert not _hooked(model)


# -- Compiled after make_private -------------------------------------------------------------------------------


def _compiled_module(private):
    return torch.compile(private.module)


def _compiled_in_place(private):
    private.module.compile()
    return private.module


def _compiled_function(private):
    return torch.compile(lambda x: private.module(x))


def _compiled_submodule(private):
    private.module[2].compile()
    return private.module


COMPILED_AFTER = [_compiled_module, _compiled_in_place, _compiled_function, _compiled_submodule]


@pytest.mark.parametrize("compiled_call", COMPILED_AFTER, ids=lambda f: f.__name__.removeprefix("_compiled_"))
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "control"])
def test_a_compiled_call_of_the_private_module_is_refused_before_the_first_step(compiled_call, compiled):
    model = _model()
    private = _make(model)
    before = _snapshot(model)
    if not compiled:  # control: the same loop on the uncompiled module trains
        _train(private, private.module)
        assert private.steps_taken == STEPS and _moved(model, before)
        return
    call = compiled_call(private)
    with pytest.raises(CompiledModuleError, match=r"a compiled call .* reached the per-example clipping hooks.*"
                                                   r"refused before it computed anything.*nothing was released.*"
                                                   r"call private.module itself.*private.detach\(\)") as refusal:
        _train(private, call)
    assert isinstance(refusal.value, OpakeError) and isinstance(refusal.value, RuntimeError)
    assert private.steps_taken == 0 and not _moved(model, before)
    assert all(p.grad is None for p in model.parameters())  # no backward ran


def test_a_full_graph_compile_of_the_private_module_is_refused_by_the_compiler():
    """With fullgraph=True the compiler refuses the hook's check itself (it may not leave the graph)."""
    model = _model()
    private = _make(model)
    before = _snapshot(model)
    with pytest.raises(Exception, match=r"skipped|disable"):
        _train(private, torch.compile(private.module, fullgraph=True))
    assert private.steps_taken == 0 and not _moved(model, before)
