"""The oracle for tests/torch/per_example/test_clipper.py: torch.func per-example gradients, clipped, summed.

Deliberately the slow, obvious route: ``vmap(grad)`` of one example's loss over the whole model
(``functional_call`` on the trainable parameters), each example's gradient flattened over all
trainable parameters, its norm, ``min(1, C / norm)``, and the weighted sum, all in float64.
"""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, vmap

from opake.torch.per_example import PerExampleClipper


def reference(model, per_example_loss, inputs, targets, max_grad_norm):
    """(clipped sums, per-example norms before clipping, per-example norms after clipping)."""
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def one_loss(params, x, t):
        output = functional_call(model, params, (x.unsqueeze(0),))
        return per_example_loss(output, t.unsqueeze(0))[0]

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, inputs, targets)
    batch = inputs.shape[0]
    flat = torch.cat([per_example[name].reshape(batch, -1).double() for name in params], dim=1)
    norms = flat.norm(dim=1)
    factors = torch.clamp(max_grad_norm / torch.where(norms > 0, norms, 1.0), max=1.0)
    sums = {
        name: (per_example[name].double() * factors.reshape(-1, *[1] * (g.dim() - 1))).sum(0)
        for name, g in per_example.items()
    }
    return sums, norms, (flat * factors[:, None]).norm(dim=1)


def clipper_sums(model, per_example_loss, inputs, targets, max_grad_norm, loss_reduction="mean"):
    """The clipper's sums for one forward and backward of the batch loss."""
    clipper = PerExampleClipper(model, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction)
    losses = per_example_loss(model(inputs), targets)
    (losses.mean() if loss_reduction == "mean" else losses.sum()).backward()
    sums = clipper.clipped_sum()
    assert clipper.examples == inputs.shape[0]
    clipper.remove()
    return sums


def assert_sums_close(ours, expected, rtol):
    """Every entry within ``rtol`` times the largest entry of the expected sums."""
    assert set(ours) == set(expected), (sorted(ours), sorted(expected))
    scale = max(float(t.abs().max()) for t in expected.values() if t.numel()) or 1.0
    for name, value in expected.items():
        torch.testing.assert_close(
            ours[name].double(), value.double(), rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}"
        )


def squared_error(output, target):
    """Per-example losses (B,): half the squared error summed over all but the batch dimension."""
    return 0.5 * (output - target).pow(2).reshape(output.shape[0], -1).sum(dim=1)


def check_against_reference(model, inputs, targets, *, loss=squared_error, max_grad_norm=None,
                            loss_reduction="mean", rtol=1e-10, truth=None):
    """The clipper equals the oracle (run on ``truth``, e.g. a float64 copy; default ``model``)."""
    truth = model if truth is None else truth
    dtype = next(truth.parameters()).dtype
    truth_inputs = inputs.to(dtype) if inputs.is_floating_point() else inputs
    truth_targets = targets.to(dtype) if targets.is_floating_point() else targets
    if max_grad_norm is None:
        # Half the median norm: some examples clipped, some not.
        _, norms, _ = reference(truth, loss, truth_inputs, truth_targets, 1.0)
        max_grad_norm = float(norms.median()) * 0.5 or 1.0
    expected, norms, clipped_norms = reference(truth, loss, truth_inputs, truth_targets, max_grad_norm)
    assert bool((clipped_norms <= max_grad_norm * (1 + 1e-9)).all())
    ours = clipper_sums(model, loss, inputs, targets, max_grad_norm, loss_reduction)
    assert_sums_close(ours, expected, rtol)
    return norms
