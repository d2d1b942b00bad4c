"""The noise correction by default: make_private steps a plain AdamW or Adam with DP-AdamBC's
second moment floored at the noise's own variance (opake.torch.adamw.corrected_adam_step).

Oracles: a float64 Adam written out with numpy (tests/dense.py, no torch optimizer, no opake code), fed the
noised gradients the private optimizer actually wrote and the variances the dense inverse of C
gives; torch's own AdamW for the runs without the correction. Negative controls: the written-out
Adam without the correction does not match a corrected run, and noise_correction=False does not
match the default.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dense import noise_row_norms, written_out_adam
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.random import key
from opake.torch import DPAdamW, make_private
from opake.torch.adamw import NoiseCorrectionError, corrected_adam_step, noise_correction_for


@pytest.mark.parametrize("kind, weight_decay", [("AdamW", 0.01), ("AdamW", 0.0), ("Adam", 0.05), ("Adam", 0.0)])
def test_a_corrected_step_equals_the_written_out_adam(kind, weight_decay):
    rng = np.random.default_rng(0)
    steps, width = 10, 6
    signal = rng.normal(size=width) * np.array([1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0])
    variances = 0.04 * (1 + np.arange(steps) / steps) ** 2
    gradients = [signal + rng.normal(size=width) * np.sqrt(variance) for variance in variances]
    theta0 = rng.normal(size=width)
    param = nn.Parameter(torch.tensor(theta0, dtype=torch.float64))
    optimizer = getattr(torch.optim, kind)([param], lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    for t, (g, variance) in enumerate(zip(gradients, variances), start=1):
        param.grad = torch.tensor(g)
        corrected_adam_step(optimizer, float(variance))
        expected = written_out_adam(theta0, gradients[:t], variances[:t], lrs=0.01, betas=(0.8, 0.99), eps=1e-6,
                                    weight_decay=weight_decay, decoupled=kind == "AdamW")[-1]
        np.testing.assert_allclose(param.detach().numpy(), expected, rtol=1e-12, atol=1e-15)
    # Both branches of the floor were taken, and the uncorrected Adam is another path (negative control).
    state = optimizer.state[param]
    v_hat = state["exp_avg_sq"].numpy() / (1 - 0.99**steps)
    phi_hat = state["noise_variance_average"] / (1 - 0.99**steps)
    assert (v_hat < 2 * phi_hat).any() and (v_hat > 2 * phi_hat).any()
    plain = written_out_adam(theta0, gradients, variances, lrs=0.01, betas=(0.8, 0.99), eps=1e-6,
                             weight_decay=weight_decay, decoupled=kind == "AdamW", floor=None)[-1]
    assert np.abs(param.detach().numpy() - plain).max() > 1e-4


def _dense_variances(mechanism, n, scale):
    return scale**2 * noise_row_norms(mechanism, n)


def _data():
    generator = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(48, 5, generator=generator, dtype=torch.float64),
                                          torch.randint(0, 3, (48,), generator=generator))


def _train(optimizer_fn, strategy=None, record=False, epochs=3, **options):
    """A make_private run (float64); with ``record``, the noised gradient each step released."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = optimizer_fn(model.parameters())
    private = make_private(module=model, optimizer=optimizer, dataset=_data(), batch_size=8, epochs=epochs,
                           noise_multiplier=1.3, target_delta=1e-5, max_grad_norm=0.5, strategy=strategy,
                           key=key(3), **options)
    released = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a scheduler's "step before optimizer.step()" warning fails the test
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        for xb, yb in private.run_data_loader():
            private.optimizer.zero_grad()
            if len(yb):
                F.cross_entropy(model(xb), yb).backward()
            private.optimizer.step()
            scheduler.step()
            if record:
                released.append([p.grad.detach().numpy().copy() for p in model.parameters()])
    return private, model, start, released


@pytest.mark.parametrize("name, strategy", [("blt", blt_strategy(max_buffers=3)), ("band_mf", band_mf_strategy(bands=2)),
                                            ("dp_sgd", identity_strategy())])
def test_make_private_corrects_adamw_by_default_as_the_written_out_adam(name, strategy):
    adamw = lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)  # noqa: E731
    private, model, start, released = _train(adamw, strategy, record=True)
    assert private.noise_correction.enabled and "AdamW" in str(private.noise_correction)
    n = private.plan.n_steps
    variances = _dense_variances(private.run.noise_fn.mechanism, n, 1.3 * 0.5 / private.plan.expected_batch_size)
    rates = [0.02 * 0.5 ** (t // 4) for t in range(n)]  # StepLR(step_size=4, gamma=0.5), read at each step
    for index, (p, p0) in enumerate(zip(model.parameters(), start)):  # the written-out AdamW, scheduler's rates
        theta = written_out_adam(p0.numpy(), [step[index] for step in released], variances, lrs=rates,
                                 betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)[-1]
        np.testing.assert_allclose(p.detach().numpy(), theta, rtol=1e-9, atol=1e-12)
    # Negative control: the same run without the correction is another run.
    _, plain, _, _ = _train(adamw, strategy, noise_correction=False)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_without_the_correction_the_run_is_torch_adamw_on_the_released_gradients():
    adamw = lambda params: torch.optim.AdamW(params, lr=0.02)  # noqa: E731
    private, model, start, released = _train(adamw, blt_strategy(max_buffers=2), record=True, noise_correction=False)
    assert not private.noise_correction.enabled and "noise_correction=False" in private.noise_correction.reason
    twin = [nn.Parameter(p0.clone()) for p0 in start]
    reference = torch.optim.AdamW(twin, lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(reference, step_size=4, gamma=0.5)
    for grads in released:
        for p, g in zip(twin, grads):
            p.grad = torch.tensor(g)
        reference.step()
        scheduler.step()
    for p, q in zip(model.parameters(), twin):
        assert torch.equal(p.detach(), q.detach())


def test_an_explicit_dpadamw_with_the_noise_floor_is_the_default():
    _, default, _, _ = _train(lambda params: torch.optim.AdamW(params, lr=0.02), blt_strategy(max_buffers=2))
    private, explicit, _, _ = _train(lambda params: DPAdamW(params, lr=0.02), blt_strategy(max_buffers=2))
    assert private.noise_correction.by_optimizer
    for p, q in zip(default.parameters(), explicit.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-15)


def test_only_plain_adam_and_adamw_are_corrected_and_the_reason_is_said():
    params = [nn.Parameter(torch.ones(2))]

    class MyAdamW(torch.optim.AdamW):
        pass

    assert noise_correction_for(torch.optim.AdamW(params)).enabled
    assert noise_correction_for(torch.optim.AdamW(params, fused=True)).enabled
    assert noise_correction_for(torch.optim.Adam(params, weight_decay=0.1)).enabled
    for optimizer in (torch.optim.SGD(params, lr=0.1, momentum=0.9), MyAdamW(params), torch.optim.RMSprop(params)):
        decision = noise_correction_for(optimizer)
        assert not decision.enabled and type(optimizer).__name__ in decision.reason
        with pytest.raises(NoiseCorrectionError, match="noise_correction=True"):
            noise_correction_for(optimizer, True)
    amsgrad = noise_correction_for(torch.optim.AdamW(params, amsgrad=True))
    assert not amsgrad.enabled and "amsgrad" in amsgrad.reason
    with pytest.raises(NoiseCorrectionError, match="DPAdamW"):
        noise_correction_for(DPAdamW(params), False)
    with pytest.raises(TypeError, match="noise_correction"):
        noise_correction_for(torch.optim.AdamW(params), "yes")


def test_a_refused_request_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    with pytest.raises(NoiseCorrectionError, match="SGD"):
        make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=_data(),
                     batch_size=8, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                     key=key(0), noise_correction=True)
    assert not model._forward_hooks and not model._backward_hooks
    make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=_data(),
                 batch_size=8, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0, key=key(0))


def test_the_corrected_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    adamw = lambda params: torch.optim.AdamW(params, lr=0.02)  # noqa: E731

    def run(stop=None, resume=None):
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        optimizer = adamw(model.parameters())
        private = make_private(module=model, optimizer=optimizer, dataset=_data(), batch_size=8, epochs=2,
                               noise_multiplier=1.3, target_delta=1e-5, max_grad_norm=0.5,
                               strategy=blt_strategy(max_buffers=2), key=key(3))
        if resume is not None:
            private.load_state_dict(torch.load(resume, weights_only=True), draws="replay")
        for xb, yb in private.run_data_loader():
            private.optimizer.zero_grad()
            if len(yb):
                F.cross_entropy(model(xb), yb).backward()
            private.optimizer.step()
            if stop is not None and private.steps_taken == stop:
                torch.save(private.state_dict(), tmp_path / "run.pt")
                return None
        return model

    whole = run()
    run(stop=5)
    resumed = run(resume=tmp_path / "run.pt")
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_step_counts_are_read_whatever_their_dtype_and_in_order():
    from opake.torch.adamw import _step_counts

    steps = [torch.tensor(3.0), torch.tensor(5.0, dtype=torch.float64), torch.zeros(()) + 7, torch.tensor(2.0**24)]
    assert _step_counts(steps) == [3, 5, 7, 2**24]
    assert _step_counts([]) == []
