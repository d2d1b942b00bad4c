"""A second oracle for the per-example clipper: a loop of batch-size-1 backward passes.

Unlike ``torch_per_example_support.reference`` (one ``vmap(grad)`` over the model), this runs the
model itself on each example alone, with ``torch.autograd.grad``: it works for any forward
(Hugging Face models, autocast, checkpointing off) and is the reference Opacus' tests use. Each
example's gradient over all trainable parameters is flattened, its norm taken in float64,
clipped by ``min(1, C / norm)`` and summed.
"""

from __future__ import annotations

import torch


def loop_reference(model, example_loss, batch, max_grad_norm):
    """(clipped sums by parameter name, per-example norms) for ``example_loss(slice) -> scalar``."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    sums = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params.items()}
    norms = []
    for index in range(batch):
        loss = example_loss(slice(index, index + 1))
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        norm = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
        norms.append(norm)
        factor = min(1.0, max_grad_norm / norm) if norm > 0 else 1.0
        for name, g in zip(params, grads):
            sums[name] += factor * g.double()
    return sums, norms


def largest_relative_error(ours, expected):
    """max |ours - expected| over all entries, relative to the largest expected entry."""
    assert set(ours) == set(expected), (sorted(ours), sorted(expected))
    scale = max(float(t.abs().max()) for t in expected.values() if t.numel())
    return max(float((ours[name].double() - value).abs().max()) for name, value in expected.items()) / scale
