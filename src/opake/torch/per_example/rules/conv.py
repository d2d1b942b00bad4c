"""nn.Conv1d and nn.Conv2d: the Linear rule applied to unfolded patches, one group at a time.

A convolution is a Linear layer over patches: unfolding the (padded) input of one example gives
``A_i`` (L x K, L output positions, K = in_channels/groups * kernel elements) and the output
gradient gives ``G_i`` (L x out/groups), per group. The squared norm of the weight gradient is
then the Linear ghost norm with T = L, chosen when L^2 < (out/groups) * K, and otherwise the
per-example gradient ``G_i^T A_i`` formed for a chunk of examples. The unfolded input is K times
the input, so it only ever exists for one chunk. (Folding the examples into the groups of one
convolution backward avoids the unfold but measured 20x slower on CPU.) The clipped sum does not unfold at all: it is
the convolution's own weight gradient with the output gradient scaled per example
(``torch.nn.grad.conv2d_weight``), one call for the batch.

Conv1d is handled as a Conv2d of height 1. Padding modes other than zeros, and string paddings
(``"same"``), are applied to the stored input exactly as the layer's forward applies them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opake.torch.per_example.rules.base import LayerRule, example_chunks, squared_frobenius


def _as_pair(values, spatial_dims: int, neutral: int) -> tuple[int, int]:
    """A 1-D setting as the 2-D one of a height-1 convolution (``neutral`` for the height)."""
    values = tuple(values) if isinstance(values, (tuple, list)) else (values,) * spatial_dims
    return (neutral, values[0]) if spatial_dims == 1 else (values[0], values[1])


def _pad_amounts(module: nn.Module) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dimension, as the layer's forward pads."""
    if module.padding == "valid":
        return [(0, 0)] * len(module.kernel_size)
    if module.padding == "same":
        amounts = []
        for dilation, kernel in zip(module.dilation, module.kernel_size):
            total = dilation * (kernel - 1)
            amounts.append((total // 2, total - total // 2))
        return amounts
    return [(pad, pad) for pad in module.padding]


class _ConvGeometry:
    """The layer as a 2-D convolution over an explicitly padded input."""

    def __init__(self, module: nn.Module, stored: torch.Tensor, dtype):
        spatial = len(module.kernel_size)
        amounts = _pad_amounts(module)
        symmetric = all(before == after for before, after in amounts)
        inputs = stored.to(dtype)
        if module.padding_mode == "zeros" and symmetric:
            padding = [before for before, _ in amounts]
        else:
            flat = [amount for pair in reversed(amounts) for amount in pair]
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            inputs = F.pad(inputs, flat, mode=mode)
            padding = [0] * spatial
        self.inputs = inputs.unsqueeze(2) if spatial == 1 else inputs
        self.kernel = _as_pair(module.kernel_size, spatial, 1)
        self.stride = _as_pair(module.stride, spatial, 1)
        self.dilation = _as_pair(module.dilation, spatial, 1)
        self.padding = _as_pair(padding, spatial, 0)
        self.groups = module.groups
        self.out_channels = module.out_channels
        self.group_in = module.in_channels // module.groups
        self.group_out = module.out_channels // module.groups
        self.patch = self.group_in * self.kernel[0] * self.kernel[1]

    def patches(self, chunk: slice) -> torch.Tensor:
        """(b, groups, K, L) unfolded input of the examples in ``chunk``."""
        unfolded = F.unfold(self.inputs[chunk], self.kernel, self.dilation, self.padding, self.stride)
        return unfolded.reshape(unfolded.shape[0], self.groups, self.patch, -1)

    def grad_rows(self, grad: torch.Tensor, dtype) -> torch.Tensor:
        """(B, groups, out/groups, L) output gradient."""
        return grad.to(dtype).reshape(grad.shape[0], self.groups, self.group_out, -1)


class ConvRule(LayerRule):
    ghost = True

    def store(self, module, args, kwargs, names):
        return args[0].detach() if "weight" in names else None

    def squared_norms(self, module, stored, grads, names, dtype):
        result = {}
        if "bias" in names:
            result["bias"] = grads[0].to(dtype).flatten(2).sum(dim=2).pow(2).sum(dim=1)
        if "weight" in names:
            geometry = _ConvGeometry(module, stored, dtype)
            rows_g = geometry.grad_rows(grads[0], dtype)
            batch, groups, _, length = rows_g.shape
            weight_size = geometry.group_out * geometry.patch
            parts = []
            if length * length < weight_size:
                per_example = groups * (geometry.patch * length + 2 * length * length)
                for chunk in example_chunks(batch, per_example):
                    rows_a = geometry.patches(chunk)
                    gram_a = torch.einsum("bgkl,bgkm->bglm", rows_a, rows_a)
                    gram_g = torch.einsum("bgol,bgom->bglm", rows_g[chunk], rows_g[chunk])
                    parts.append((gram_a * gram_g).sum(dim=(1, 2, 3)))
            else:
                per_example = groups * (weight_size + geometry.patch * length)
                for chunk in example_chunks(batch, per_example):
                    gradient = torch.einsum("bgol,bgkl->bgok", rows_g[chunk], geometry.patches(chunk))
                    parts.append(squared_frobenius(gradient))
            result["weight"] = torch.cat(parts) if parts else rows_g.new_zeros(0)
        return result

    def clipped_sums(self, module, stored, grads, names, weights, dtype):
        scale = weights.reshape(-1, *([1] * (grads[0].dim() - 1)))
        scaled = grads[0].to(dtype) * scale
        result = {}
        if "bias" in names:
            result["bias"] = scaled.transpose(0, 1).reshape(module.out_channels, -1).sum(dim=1)
        if "weight" in names:
            geometry = _ConvGeometry(module, stored, dtype)
            size = (module.out_channels, geometry.group_in, *geometry.kernel)
            gradient = torch.nn.grad.conv2d_weight(
                geometry.inputs,
                size,
                scaled.reshape(scaled.shape[0], module.out_channels, -1, scaled.shape[-1]),
                geometry.stride,
                geometry.padding,
                geometry.dilation,
                geometry.groups,
            )
            result["weight"] = gradient.reshape(module.weight.shape)
        return result

    def per_example_grads(self, module, stored, grads, names, dtype):
        result = {}
        if "bias" in names:
            result["bias"] = grads[0].to(dtype).flatten(2).sum(dim=2)
        if "weight" in names:
            geometry = _ConvGeometry(module, stored, dtype)
            rows_g = geometry.grad_rows(grads[0], dtype)
            batch, groups, _, length = rows_g.shape
            per_example = groups * (geometry.group_out * geometry.patch + geometry.patch * length)
            parts = [
                torch.einsum("bgol,bgkl->bgok", rows_g[chunk], geometry.patches(chunk))
                for chunk in example_chunks(batch, per_example)
            ]
            stacked = torch.cat(parts) if parts else rows_g.new_zeros(0, groups, geometry.group_out, geometry.patch)
            result["weight"] = stacked.reshape(batch, *module.weight.shape)
        return result


RULE = ConvRule()
