"""nn.Conv1d and nn.Conv2d: the Linear rule over patches, with three routes to the weight's norms.

A convolution is a Linear layer over patches: the patches of one example's (padded) input give
``A_i`` (K x L, L output positions, K = in_channels/groups * kernel elements) and its output
gradient gives ``G_i`` (O x L, O = out_channels/groups), per group; the weight gradient of the
example is ``G_i A_i^T``. Its squared norm is formed by one of three routes, chosen per layer
from the shapes (``_weight_route``):

- ghost: ``sum_{l,m} (A_i^T A_i)[l,m] (G_i^T G_i)[l,m]``, about L^2 (K + O) multiply-adds per
  example and group against L K O for the others; taken when L (K + O) < K O (few output
  positions, many channels: late layers of deep networks).
- grouped: the examples become the groups of one convolution weight-gradient call
  (``torch.nn.grad.conv2d_weight`` of the (1, b*C, H, W) input against the (1, b*out, H', W')
  output gradient with b*groups groups), which returns the b per-example gradients without
  unfolding the input. The default: on CPU it runs in the convolution library's own kernels,
  1.2-8x faster than unfold and bmm for 16 or more input channels per group (2-conv CNN of
  issue 13, second layer at batch 256: 16 ms against 57 ms for unfold + bmm and 78 ms for
  ``F.unfold`` + einsum, one thread; 128 channels at 16x16: 76 ms against 89 ms). It is also
  how the ghost route's layers materialize when they must (shared parameters).
- unfold: the patches as a strided view of the padded input, copied once per chunk, and one
  ``bmm`` with ``G_i``. Taken for 1x1 kernels (the view needs no copy) and for layers with
  fewer than 8 input and at least 8 output channels per group (a network's first layer), where
  the copy is small and the library's grouped kernels vectorize poorly (first layer of the
  CNN: 11 ms against 14 ms grouped).

Per-example temporaries exist for a chunk of examples at a time, at most ``CHUNK_ELEMENTS``
elements (1 MiB in float32: the library's weight-gradient call holds about three times its
output in reorder buffers, and chunks of 16 to 80 examples measured faster than the whole
batch at once). The patch copy is made only by the unfold and ghost routes, a chunk at a time.

Per-example gradients formed by the grouped or unfold route are offered to the book-keeping to
keep for the sum pass (``materialized``; it grants them while they total at most the output
gradients the hooks hold): the sum is then a matrix-vector product instead of a second
convolution backward (CNN at batch 256: 97 ms a step against 111 ms recomputing, plain 68 ms).
Otherwise (and for ghost-route weights) the clipped sum does not unfold at all: it is the
convolution's own weight gradient with the input or the output gradient (the smaller) scaled
per example, one call for the batch.

Conv1d is handled as a Conv2d of height 1. Padding modes other than zeros, and string paddings
(``"same"``), are applied to the stored input exactly as the layer's forward applies them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from opake.torch.per_example.rules.base import LayerRule, autocast_input, example_chunks, squared_frobenius

CHUNK_ELEMENTS = 2**18

# Measured on CPU (module docstring): below this many input channels per group the unfold route
# beats the grouped convolution, when there are at least as many output channels per group.
_FEW_CHANNELS = 8


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
    """The layer as a 2-D convolution over an input with symmetric zero padding (or none)."""

    def __init__(self, module: nn.Module, stored: torch.Tensor, grad: torch.Tensor, dtype):
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
        grad = grad.to(dtype)
        self.grad = grad.unsqueeze(2) if spatial == 1 else grad  # (B, out, H', W')
        self.kernel = _as_pair(module.kernel_size, spatial, 1)
        self.stride = _as_pair(module.stride, spatial, 1)
        self.dilation = _as_pair(module.dilation, spatial, 1)
        self.padding = _as_pair(padding, spatial, 0)
        self.groups = module.groups
        self.in_channels = module.in_channels
        self.out_channels = module.out_channels
        self.group_in = module.in_channels // module.groups
        self.group_out = module.out_channels // module.groups
        self.patch = self.group_in * self.kernel[0] * self.kernel[1]
        self.out_size = tuple(self.grad.shape[2:])
        self.length = self.out_size[0] * self.out_size[1]

    def grad_rows(self, chunk: slice) -> torch.Tensor:
        """(b * groups, O, L) output gradient of the examples in ``chunk``."""
        return self.grad[chunk].reshape(-1, self.group_out, self.length)

    def patches(self, chunk: slice) -> torch.Tensor:
        """(b * groups, K, L) patches of the examples in ``chunk`` (one copy: a strided view of
        the padded input, K ordered as the weight's (in/groups, kh, kw))."""
        padded = self.inputs[chunk]
        if any(self.padding):
            pad_h, pad_w = self.padding
            padded = F.pad(padded, (pad_w, pad_w, pad_h, pad_h))
        s_batch, s_channel, s_height, s_width = padded.stride()
        view = padded.as_strided(
            (padded.shape[0], self.groups, self.group_in, *self.kernel, *self.out_size),
            (
                s_batch, self.group_in * s_channel, s_channel,
                self.dilation[0] * s_height, self.dilation[1] * s_width,
                self.stride[0] * s_height, self.stride[1] * s_width,
            ),
            padded.storage_offset(),
        )
        return view.reshape(-1, self.patch, self.length)

    def grouped_weight_grads(self, chunk: slice) -> torch.Tensor:
        """(b * groups, O, K) per-example weight gradients from one grouped convolution backward."""
        inputs, grad = self.inputs[chunk], self.grad[chunk]
        count = inputs.shape[0]
        gradient = torch.nn.grad.conv2d_weight(
            inputs.reshape(1, count * self.in_channels, *inputs.shape[2:]),
            (count * self.out_channels, self.group_in, *self.kernel),
            grad.reshape(1, count * self.out_channels, *self.out_size),
            self.stride,
            self.padding,
            self.dilation,
            count * self.groups,
        )
        return gradient.reshape(-1, self.group_out, self.patch)

    def unfolded_weight_grads(self, chunk: slice) -> torch.Tensor:
        """(b * groups, O, K) per-example weight gradients as ``G_i A_i^T``."""
        return torch.bmm(self.grad_rows(chunk), self.patches(chunk).transpose(1, 2))


def _weight_route(module: nn.Module, grad: torch.Tensor) -> str:
    """"ghost", "unfold" or "grouped": the cheapest route to the weight's norms (module docstring)."""
    group_in, group_out = module.in_channels // module.groups, module.out_channels // module.groups
    kernel = math.prod(module.kernel_size)
    patch, length = group_in * kernel, math.prod(grad.shape[2:])
    if length * (patch + group_out) < patch * group_out:
        return "ghost"
    if kernel == 1 or group_in < _FEW_CHANNELS <= group_out:
        return "unfold"
    return "grouped"


def _weight_grads(geometry: _ConvGeometry, route: str, chunk: slice) -> torch.Tensor:
    if route == "unfold":
        return geometry.unfolded_weight_grads(chunk)
    return geometry.grouped_weight_grads(chunk)


def _materialized_elements(geometry: _ConvGeometry, route: str) -> int:
    """Temporaries per example of the materializing routes (gradient, plus the patch copy)."""
    size = geometry.groups * geometry.group_out * geometry.patch
    if route == "unfold":
        size += geometry.groups * geometry.patch * geometry.length
    return size


class ConvRule(LayerRule):
    ghost = True

    def store(self, module, args, kwargs, names, output):
        # Under autocast, the low-precision copy the convolution used (rules/base.py).
        return autocast_input(args[0].detach()) if "weight" in names else None

    def materialized(self, module, stored, grads, names):
        # Formed once, a per-example gradient's sum is a matrix-vector product instead of a
        # second convolution backward; not for a ghost-route weight, whose gradient costs more
        # than its norm.
        if "weight" in names and _weight_route(module, grads[0]) == "ghost":
            return tuple(name for name in names if name != "weight")
        return tuple(names)

    def squared_norms(self, module, stored, grads, names, dtype):
        result = {}
        if "bias" in names:
            result["bias"] = grads[0].to(dtype).flatten(2).sum(dim=2).pow(2).sum(dim=1)
        if "weight" in names:
            geometry = _ConvGeometry(module, stored, grads[0], dtype)
            batch, groups, length = geometry.grad.shape[0], geometry.groups, geometry.length
            route = _weight_route(module, geometry.grad)
            parts = []
            if route == "ghost":
                per_example = groups * (geometry.patch * length + 3 * length * length)
                for chunk in example_chunks(batch, per_example, CHUNK_ELEMENTS):
                    rows_a, rows_g = geometry.patches(chunk), geometry.grad_rows(chunk)
                    gram_a = torch.bmm(rows_a.transpose(1, 2), rows_a)
                    gram_g = torch.bmm(rows_g.transpose(1, 2), rows_g)
                    parts.append((gram_a * gram_g).reshape(-1, groups * length * length).sum(dim=1))
            else:
                per_example = _materialized_elements(geometry, route)
                for chunk in example_chunks(batch, per_example, CHUNK_ELEMENTS):
                    gradient = _weight_grads(geometry, route, chunk)
                    parts.append(squared_frobenius(gradient.reshape(-1, groups * gradient[0].numel())))
            result["weight"] = torch.cat(parts) if parts else geometry.grad.new_zeros(0)
        return result

    def clipped_sums(self, module, stored, grads, names, weights, dtype):
        result = {}
        if "bias" in names:
            result["bias"] = grads[0].to(dtype).flatten(2).sum(dim=2).t() @ weights
        if "weight" in names:
            geometry = _ConvGeometry(module, stored, grads[0], dtype)
            # The weight gradient is bilinear in (input, output gradient): scale the smaller one.
            inputs, grad = geometry.inputs, geometry.grad
            if inputs.numel() < grad.numel():
                inputs = inputs * weights.reshape(-1, 1, 1, 1)
            else:
                grad = grad * weights.reshape(-1, 1, 1, 1)
            size = (module.out_channels, geometry.group_in, *geometry.kernel)
            gradient = torch.nn.grad.conv2d_weight(
                inputs, size, grad, geometry.stride, geometry.padding, geometry.dilation, geometry.groups
            )
            result["weight"] = gradient.reshape(module.weight.shape)
        return result

    def per_example_grads(self, module, stored, grads, names, dtype):
        result = {}
        if "bias" in names:
            result["bias"] = grads[0].to(dtype).flatten(2).sum(dim=2)
        if "weight" in names:
            geometry = _ConvGeometry(module, stored, grads[0], dtype)
            batch = geometry.grad.shape[0]
            route = "unfold" if _weight_route(module, geometry.grad) == "unfold" else "grouped"
            # Written into place a chunk at a time: a list of chunks and their concatenation would
            # hold the B per-example gradients twice.
            stacked = geometry.grad.new_empty(batch, geometry.groups, geometry.group_out, geometry.patch)
            for chunk in example_chunks(batch, _materialized_elements(geometry, route), CHUNK_ELEMENTS):
                stacked[chunk] = _weight_grads(geometry, route, chunk).reshape(stacked[chunk].shape)
            result["weight"] = stacked.reshape(batch, *module.weight.shape)
        return result


RULE = ConvRule()
