"""The clipper as people use it: registering rules, mixed precision, gradient checkpointing.

Companion of tests/torch/per_example/test_clipper.py (the layer families and passes), against the same
oracles: ``torch_per_example_support.reference`` (vmap) and, where the forward must run as
written (autocast), ``torch_hf_support.loop_reference`` (batch-size-1 backward passes).
"""

from __future__ import annotations

import copy
import math
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

from opake.torch.per_example import (
    ClipperUsageError,
    FallbackWarning,
    LayerRule,
    PerExampleClipper,
    UnhookedUseError,
    coverage_tolerance,
    register_rule,
    registered_rule,
)
from opake.torch.per_example import rules
from tests.torch_hf_support import largest_relative_error, loop_reference
from tests.torch_per_example_support import assert_sums_close, check_against_reference, reference, squared_error

F64 = torch.float64


def _targets_like(model, inputs, seed=1):
    with torch.no_grad():
        shape = model(inputs).shape
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=inputs.dtype)


# Registry and fallback -----------------------------------------------------------------------


class _Scale(nn.Module):
    """y = weight * x, elementwise over the last dimension: a layer with no rule of its own."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return self.weight * x


def test_a_layer_without_a_rule_warns_with_the_fallbacks_cost():
    model = nn.Sequential(nn.Linear(3, 3), _Scale(3))
    with pytest.warns(FallbackWarning, match=r"_Scale at '1'.*replayed per example.*batch size x its trainable "
                                             r"parameter count.*register_rule"):
        PerExampleClipper(model, 1.0).remove()


def test_register_rule_as_a_decorator_is_used_and_exact():
    spied = []

    with mock.patch.dict(rules._BY_TYPE), mock.patch.dict(rules._BY_NAME):

        @register_rule(_Scale)
        class ScaleRule(LayerRule):
            def per_example_grads(self, module, stored, grads, names, dtype):
                spied.append(module)
                product = grads[0].to(dtype) * stored.to(dtype)
                return {"weight": product.reshape(product.shape[0], -1, product.shape[-1]).sum(dim=1)}

        assert isinstance(registered_rule(_Scale), ScaleRule)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), _Scale(3), nn.Tanh()).to(F64)
        inputs = torch.randn(5, 2, 3, dtype=F64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            check_against_reference(model, inputs, _targets_like(model, inputs))
        assert spied and spied[0] is model[1]
    assert registered_rule(_Scale) is None  # the patch undid the registration


def test_register_rule_by_qualified_name_keeps_exact_types():
    with mock.patch.dict(rules._BY_TYPE), mock.patch.dict(rules._BY_NAME):
        register_rule(f"{_Scale.__module__}._Scale", rules.normalization.RMS_NORM)
        assert registered_rule(_Scale) is rules.normalization.RMS_NORM

        class Sub(_Scale):
            pass

        assert registered_rule(Sub) is None


@pytest.mark.parametrize(
    "arguments,error,pattern",
    [
        ((nn.Linear, rules.linear.RULE), ValueError,
         r"torch\.nn\.modules\.linear\.Linear already has a rule.*replace=True"),
        (("torch.nn.modules.linear.Linear", rules.linear.RULE), ValueError, r"already has a rule"),
        ((_Scale, object()), TypeError, r"rule must be an instance of a LayerRule subclass"),
        ((int, rules.linear.RULE), TypeError, r"layer_type must be a torch\.nn\.Module subclass"),
        (("Scale", rules.linear.RULE), ValueError, r"qualified name, 'package\.module\.Class'"),
    ],
)
def test_register_rule_refuses(arguments, error, pattern):
    with mock.patch.dict(rules._BY_TYPE), mock.patch.dict(rules._BY_NAME):
        with pytest.raises(error, match=pattern):
            register_rule(*arguments)


def test_register_rule_replaces_only_when_asked():
    with mock.patch.dict(rules._BY_TYPE), mock.patch.dict(rules._BY_NAME):
        replacement = rules.linear.LinearRule()
        register_rule(nn.Linear, replacement, replace=True)
        assert rules.rule_for(nn.Linear(2, 2)) is replacement
    assert rules.rule_for(nn.Linear(2, 2)) is rules.linear.RULE


# Mixed precision -----------------------------------------------------------------------------


class _MixedModel(nn.Module):
    """A Conv2d, GroupNorm, a fallback PReLU, Linear, LayerNorm, RMSNorm, attention (fallback)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.group_norm = nn.GroupNorm(2, 4)
        self.prelu = nn.PReLU(4)
        self.project = nn.Linear(4 * 4, 8)
        self.layer_norm = nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.rms_norm = nn.RMSNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.prelu(self.group_norm(self.conv(x)))  # (B, 4, 4, 4)
        h = self.layer_norm(self.project(h.flatten(2).transpose(1, 2).reshape(x.shape[0], 4, 16)))  # (B, 4, 8)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        return self.head(self.rms_norm(h)).float().pow(2).mean(dim=(1, 2))


def test_autocast_through_every_rule_and_the_fallback():
    # float32 weights, bfloat16 products; the reference runs each example alone under the
    # same autocast. Before, the fallback's replay failed on mixed dtypes.
    torch.manual_seed(0)
    model = _MixedModel()
    inputs = torch.randn(6, 2, 4, 4)

    def loss(part):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(inputs[part]).sum()

    _, norms = loop_reference(model, loss, 6, math.inf)
    bound = float(torch.tensor(norms).median())
    expected, _ = loop_reference(model, loss, 6, bound)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        clipper = PerExampleClipper(model, bound, loss_reduction="sum")
    clipper.track_coverage()
    model.zero_grad()
    loss(slice(None)).backward()
    sums = clipper.clipped_sum()
    clipper.check_coverage()
    assert largest_relative_error(sums, expected) < 3e-2
    # Float32 norms and sums, not bfloat16 ones: agreement to bfloat16 rounding, far from the
    # unclipped sum the clipping changed.
    plain = {name: param.grad.double() for name, param in model.named_parameters()}
    assert largest_relative_error(plain, expected) > 0.1


def test_coverage_tolerance_by_dtype():
    assert coverage_tolerance(F64) == coverage_tolerance(torch.float32) == coverage_tolerance(None) == 1e-3
    assert coverage_tolerance(torch.bfloat16) == 4 * 2.0**-7  # bfloat16: 8 significant bits
    assert coverage_tolerance(torch.float16) == 4 * 2.0**-10  # float16: 11 significant bits


class _LeakyMLP(nn.Module):
    """An MLP whose first weight is also used outside its layer when ``leak`` is set."""

    def __init__(self, leak):
        super().__init__()
        self.leak = leak
        self.first = nn.Linear(8, 128)
        self.second = nn.Linear(128, 2)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if self.leak:
            h = h + 0.5 * torch.tanh(x @ self.first.weight.t())
        return self.second(h)


@pytest.mark.parametrize("leak", [False, True])
def test_bfloat16_coverage_check_passes_rounding_and_catches_a_use_outside_the_layer(leak):
    # Without the leak, .grad (bfloat16) and the hooks' float32 sums differ by rounding alone:
    # 1.2e-3 of the gradient norm here, which the float32 tolerance 1e-3 used to call a leak.
    torch.manual_seed(0)
    model = _LeakyMLP(leak).to(torch.bfloat16)
    clipper = PerExampleClipper(model, 1.0)
    clipper.track_coverage()
    inputs, targets = torch.randn(64, 8).to(torch.bfloat16), torch.randn(64, 2).to(torch.bfloat16)
    squared_error(model(inputs).float(), targets.float()).mean().backward()
    if leak:
        with pytest.raises(UnhookedUseError, match=r"'first\.weight' got gradient from outside"):
            clipper.check_coverage()
    else:
        clipper.check_coverage()


# Gradient checkpointing ----------------------------------------------------------------------


class _Checkpointed(nn.Module):
    def __init__(self, reentrant=None):
        super().__init__()
        self.reentrant = reentrant  # None: no checkpointing
        self.first = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if self.reentrant is None:
            h = self.block(h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("skip_weights", [False, True])
def test_torch_checkpoint_matches_the_uncheckpointed_model(reentrant, skip_weights):
    torch.manual_seed(0)
    truth = _Checkpointed().to(F64)
    model = copy.deepcopy(truth)
    model.reentrant = reentrant
    runs = []
    model.block[0].register_forward_hook(lambda *args: runs.append(1))
    inputs = torch.randn(5, 4, dtype=F64)
    targets = torch.randn(5, 2, dtype=F64)
    _, norms, _ = reference(truth, squared_error, inputs, targets, 1.0)
    bound = float(norms.median())
    expected, _, _ = reference(truth, squared_error, inputs, targets, bound)
    clipper = PerExampleClipper(model, bound)
    clipper.skip_autograd_weight_gradients(skip_weights)
    for _ in range(2):  # twice: nothing of the first step is left over
        squared_error(model(inputs), targets).mean().backward()
        assert_sums_close(clipper.clipped_sum(), expected, 1e-10)
        assert clipper.examples == 5
        clipper.reset()
    assert len(runs) == 4  # each forward ran the block twice: the recomputation happened


def test_reentrant_checkpoint_with_two_passes_awaiting_backward_is_refused():
    model = _Checkpointed(reentrant=True)
    PerExampleClipper(model, 1.0)
    inputs = torch.randn(4, 4)
    loss = model(inputs[:2]).sum() + model(inputs[2:]).sum()
    with pytest.raises(ClipperUsageError, match=r"use_reentrant=True.*2 forward passes.*use_reentrant=False"):
        loss.backward()


def test_a_kept_loss_does_not_keep_the_passes_stored_activations_alive():
    """``loss = model(x).sum(); loss.backward()`` keeps the graph, and with it the gradient hooks
    on each hooked layer's output, which hold that layer's call: once the pass is clipped, what the
    call stored for the norms (inputs, output gradients) must be dropped anyway. Negative control:
    the calls of a pass not yet clipped (no backward) still hold theirs."""
    import gc

    from opake.torch.per_example.bookkeeping import LayerCall

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def live_calls():  # this model's (other tests may leave calls of their own)
        gc.collect()
        return [o for o in gc.get_objects() if type(o) is LayerCall and any(o.layer.module is m for m in model)]

    clipper = PerExampleClipper(model, 1.0, loss_reduction="sum")
    loss = model(torch.randn(5, 4)).sum()
    assert len(live_calls()) == 2 and all(call.stored is not None for call in live_calls())
    loss.backward()
    clipper.clipped_sum()
    held = live_calls()
    assert held, "the kept graph's hooks still hold the calls (what this test is about)"
    assert all(call.stored is None and not any(g is not None for g in call.grads) for call in held)
    pending = model(torch.randn(5, 4)).sum()
    assert any(call.stored is not None for call in live_calls()) and pending.requires_grad
    clipper.remove()
