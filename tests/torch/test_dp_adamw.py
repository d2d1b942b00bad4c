"""DPAdamW (DP-AdamBC, Tang, Shpilevskiy, Lecuyer, AAAI 2024, arXiv 2312.14334).

Oracles: a hand-written float64 Adam with the correction (numpy, no torch optimizer, no opake
code), step by step; torch.optim.AdamW itself for the steps without noise; the variance of each
step's noise from the dense inverse of C (tests/dense.py). Negative controls: a nonzero variance
moves away from AdamW, and for a BLT a correction by the constant (sigma C / B)^2 gives other
parameters (for DP-SGD, whose rows of C^{-1} all have norm 1, the same ones).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dense import noise_row_norms, written_out_adam
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.errors import OpakeError
from opake.random import key
from opake.torch import DPAdamW, make_private
from opake.torch.adamw import MissingNoiseVarianceError, NoiseCorrectionError


# --- the dense reference: Adam with the correction, written out in float64 --------------------------------


def _reference(theta, gradients, variances, *, lr, betas, weight_decay, floor):
    """Algorithm 1 of DP-AdamBC with AdamW's decoupled weight decay and the variance average
    phi_t = beta2 phi_{t-1} + (1 - beta2) Var_t (= Phi when the variance is constant)."""
    return written_out_adam(theta, gradients, variances, lrs=lr, betas=betas, weight_decay=weight_decay, floor=floor)


@pytest.mark.parametrize("betas, weight_decay, floor", [((0.9, 0.999), 0.01, 1e-9), ((0.5, 0.9), 0.0, 1e-4)])
def test_each_step_equals_the_written_out_algorithm(betas, weight_decay, floor):
    rng = np.random.default_rng(0)
    steps, width = 12, 7
    signal = rng.normal(size=width) * np.array([1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0, 0.0])
    variances = 0.04 * (1 + np.arange(steps) / steps) ** 2       # growing, as a BLT's
    gradients = [signal + rng.normal(size=width) * np.sqrt(variance) for variance in variances]
    theta0 = rng.normal(size=width)
    lr = 0.01
    expected = _reference(theta0, gradients, variances, lr=lr, betas=betas, weight_decay=weight_decay, floor=floor)
    param = nn.Parameter(torch.tensor(theta0, dtype=torch.float64))
    optimizer = DPAdamW([param], lr=lr, betas=betas, weight_decay=weight_decay, variance_floor=floor)
    floored = 0
    for g, variance, theta in zip(gradients, variances, expected):
        param.grad = torch.tensor(g, dtype=torch.float64)
        optimizer.set_noise_variance(float(variance))
        optimizer.step()
        np.testing.assert_allclose(param.detach().numpy(), theta, rtol=1e-12, atol=1e-14)
        state = optimizer.state[param]
        t = int(state["step"])
        floored += int(((state["exp_avg_sq"] - state["noise_variance_average"]) / (1 - betas[1] ** t) < floor).sum())
    assert floored > 0  # the floor was reached by some coordinates: that branch is tested too


def test_parameter_groups_keep_their_own_settings():
    rng = np.random.default_rng(1)
    a, b = nn.Parameter(torch.tensor(rng.normal(size=3))), nn.Parameter(torch.tensor(rng.normal(size=2)))
    optimizer = DPAdamW([{"params": [a]}, {"params": [b], "lr": 0.3, "weight_decay": 0.0}], lr=0.02,
                        weight_decay=0.1, variance_floor=1e-6)
    start_a, start_b = a.detach().numpy().copy(), b.detach().numpy().copy()
    grads_a = [rng.normal(size=3) for _ in range(5)]
    grads_b = [rng.normal(size=2) for _ in range(5)]
    for ga, gb in zip(grads_a, grads_b):
        a.grad, b.grad = torch.tensor(ga), torch.tensor(gb)
        optimizer.set_noise_variance(0.5)
        optimizer.step()
    common = dict(betas=(0.9, 0.999), floor=1e-6)
    np.testing.assert_allclose(a.detach().numpy(), _reference(start_a, grads_a, [0.5] * 5, lr=0.02, weight_decay=0.1,
                                                               **common)[-1], rtol=1e-12)
    np.testing.assert_allclose(b.detach().numpy(), _reference(start_b, grads_b, [0.5] * 5, lr=0.3, weight_decay=0.0,
                                                               **common)[-1], rtol=1e-12)


# --- without noise it is AdamW, to the last bit ----------------------------------------------------------------


@pytest.mark.parametrize("tell_zero", [False, True])
def test_without_noise_it_is_exactly_adamw(tell_zero):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    twin = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    twin.load_state_dict(model.state_dict())
    ours = DPAdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    theirs = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.05)
    for step in range(15):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        for net, optimizer in ((model, ours), (twin, theirs)):
            optimizer.zero_grad()
            net(x).pow(2).sum().backward()
        if tell_zero:
            ours.set_noise_variance(0.0)
        ours.step()
        theirs.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
    # Negative control: the same run told a variance moves away from AdamW.
    ours.set_noise_variance(1e-3)
    ours.step()
    theirs.step()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


# --- the variance it uses is the engine's, for BLT, BandMF and DP-SGD -----------------------------------------


class _Recording(DPAdamW):
    def __init__(self, *args, constant=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.told, self.constant = [], constant

    def set_noise_variance(self, variance):
        self.told.append(variance)
        super().set_noise_variance(variance if self.constant is None else self.constant)


def _run(strategy, constant=None, epochs=3):
    generator = torch.Generator().manual_seed(5)
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 5, generator=generator),
                                             torch.randint(0, 3, (40,), generator=generator))
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    optimizer = _Recording(model.parameters(), lr=0.01, variance_floor=1e-8, constant=constant)
    private = make_private(module=model, optimizer=optimizer, dataset=dataset, batch_size=8, epochs=epochs,
                           noise_multiplier=1.7, target_delta=1e-5, max_grad_norm=0.6, strategy=strategy, key=key(3))
    for xb, yb in private.run_data_loader():
        private.optimizer.zero_grad()
        if len(yb):
            F.cross_entropy(model(xb), yb).backward()
        private.optimizer.step()
    return private, optimizer, model


@pytest.mark.parametrize("name, strategy", [("blt", blt_strategy(max_buffers=3)),
                                            ("band_mf", band_mf_strategy(bands=3)),
                                            ("dp_sgd", identity_strategy())])
def test_the_variance_is_the_engines_at_every_step(name, strategy):
    private, optimizer, model = _run(strategy)
    n = private.plan.n_steps
    scale = 1.7 * 0.6 / private.plan.expected_batch_size
    expected = scale**2 * noise_row_norms(private.run.noise_fn.mechanism, n)
    np.testing.assert_allclose(optimizer.told, expected, rtol=1e-12)
    # Its running average is the beta2-average of exactly those variances.
    beta2, average = 0.999, 0.0
    for variance in expected:
        average = beta2 * average + (1 - beta2) * variance
    for p in model.parameters():
        assert optimizer.state[p]["noise_variance_average"] == pytest.approx(average, rel=1e-12)
    if name == "blt":  # a BLT's variance grows with t: the constant (sigma C / B)^2 is not it
        assert expected[-1] > 1.2 * expected[0] and expected[0] == pytest.approx(scale**2, rel=1e-12)
    if name == "dp_sgd":
        np.testing.assert_allclose(expected, scale**2, rtol=1e-12)


@pytest.mark.parametrize("name, strategy", [("blt", blt_strategy(max_buffers=3)), ("dp_sgd", identity_strategy())])
def test_a_constant_sigma_correction_differs_for_a_blt_only(name, strategy):
    private, _, exact = _run(strategy)
    scale = 1.7 * 0.6 / private.plan.expected_batch_size
    _, _, constant = _run(strategy, constant=scale**2)
    same = all(torch.equal(p, q) for p, q in zip(exact.parameters(), constant.parameters()))
    assert same == (name == "dp_sgd")   # DP-SGD's rows of C^{-1} all have norm 1: (sigma C / B)^2 is exact


# --- checkpoints, refusals ---------------------------------------------------------------------------------


def test_the_state_round_trips_and_the_run_continues_identically():
    rng = np.random.default_rng(3)
    gradients = [torch.tensor(rng.normal(size=4)) for _ in range(8)]

    def run(split=None):
        param = nn.Parameter(torch.ones(4, dtype=torch.float64))
        optimizer = DPAdamW([param], lr=0.05, variance_floor=1e-6)
        for step, g in enumerate(gradients):
            if step == split:
                saved = {"param": param.detach().clone(), "optimizer": optimizer.state_dict()}
                param = nn.Parameter(saved["param"])
                optimizer = DPAdamW([param], lr=0.05, variance_floor=1e-6)
                optimizer.load_state_dict(saved["optimizer"])
            param.grad = g
            optimizer.set_noise_variance(0.1 + 0.01 * step)
            optimizer.step()
        return param.detach()

    assert torch.equal(run(), run(split=4))


@pytest.mark.parametrize("variance", [-1e-3, float("nan"), float("inf"), None, "0.1", True])
def test_a_bad_variance_is_refused(variance):
    optimizer = DPAdamW([nn.Parameter(torch.ones(2))])
    with pytest.raises(NoiseCorrectionError):
        optimizer.set_noise_variance(variance)


@pytest.mark.parametrize("options", [dict(amsgrad=True), dict(maximize=True), dict(fused=True),
                                     dict(capturable=True), dict(variance_floor=0.0),
                                     dict(variance_floor=float("nan")), dict(variance_floor="auto")])
def test_unsupported_settings_are_refused_with_the_fix(options):
    with pytest.raises(NoiseCorrectionError) as raised:
        DPAdamW([nn.Parameter(torch.ones(2))], **options)
    assert isinstance(raised.value, OpakeError) and isinstance(raised.value, ValueError)


def test_a_step_without_its_variance_after_noisy_steps_is_refused_before_anything_moves():
    param = nn.Parameter(torch.ones(3))
    optimizer = DPAdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.set_noise_variance(0.2)
    optimizer.step()
    before = param.detach().clone()
    state = {name: value.clone() if torch.is_tensor(value) else value for name, value in optimizer.state[param].items()}
    with pytest.raises(MissingNoiseVarianceError, match="set_noise_variance"):
        optimizer.step()
    assert torch.equal(param, before)
    assert torch.equal(optimizer.state[param]["exp_avg"], state["exp_avg"]) and optimizer.state[param]["step"] == 1
