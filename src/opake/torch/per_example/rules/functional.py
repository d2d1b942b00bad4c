"""Any other layer that owns trainable parameters: per-example gradients by torch.func.

For a layer without a closed-form rule (nn.PReLU, nn.MultiheadAttention's fused projections, a
user's module with a parameter of its own) the clipper stores the layer's inputs and output
gradients and, once per backward pass, replays the layer on each example alone:
``vmap`` over examples of the vector-Jacobian product of ``functional_call(layer, params, x_i)``
with the stored output gradient ``G_i``. Only this layer's forward is replayed, and only its own
parameters are differentiated, so the cost is one extra forward and backward of this layer and
the memory is B x (this layer's parameter count), never the model's.

Under autocast the replay runs under the autocast state of the forward (recorded with the inputs),
so that it computes in the dtypes the forward did.

Tensor arguments whose dimension 0 is the batch are split per example; other arguments (flags,
an (L, S) attention mask) are passed whole. The replay must be deterministic: a layer that draws
random numbers in its forward (attention dropout) is refused, since its replay would not see the
masks of the real forward.
"""

from __future__ import annotations

import contextlib
import inspect

import optree
import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from opake.torch.per_example.errors import UnsupportedModuleError
from opake.torch.per_example.rules.base import LayerRule, autocast_state

# Layers whose forward reads their children's parameters directly (nn.MultiheadAttention uses
# out_proj.weight without calling out_proj): the rule covers the whole subtree.
FUSED_TYPES = (nn.MultiheadAttention,)

# Arguments that are never split per example, by layer type.
_SHARED_ARGUMENTS = {nn.MultiheadAttention: ("attn_mask",)}


class FunctionalRule(LayerRule):
    def check(self, module, path):
        if isinstance(module, nn.RNNBase):
            raise UnsupportedModuleError(
                f"the {type(module).__name__} at {path!r} runs a fused multi-step kernel the per-example "
                f"replay cannot split; build the recurrence from nn.LSTMCell/nn.GRUCell or nn.Linear layers"
            )
        if isinstance(module, nn.EmbeddingBag):
            raise UnsupportedModuleError(
                f"the EmbeddingBag at {path!r} takes a flat input with offsets, not a batch on dimension 0; "
                f"use nn.Embedding followed by a sum or mean over the bag dimension"
            )
        if isinstance(module, nn.MultiheadAttention):
            if not module.batch_first:
                raise UnsupportedModuleError(
                    f"the MultiheadAttention at {path!r} has batch_first=False; per-example clipping needs the "
                    f"batch on dimension 0: construct it with batch_first=True"
                )
            if module.dropout > 0:
                raise UnsupportedModuleError(
                    f"the MultiheadAttention at {path!r} has dropout={module.dropout}; its per-example replay "
                    f"cannot reproduce the forward's dropout masks. Set dropout=0.0, or build attention from "
                    f"nn.Linear and nn.Dropout layers"
                )

    def store(self, module, args, kwargs, names, output):
        detach = lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf  # noqa: E731
        args, kwargs = optree.tree_map(detach, (args, kwargs), none_is_leaf=True)
        return args, kwargs, autocast_state()

    def per_example_grads(self, module, stored, grads, names, dtype):
        args, kwargs, autocast = stored
        batch = next(grad.shape[0] for grad in grads if grad is not None)
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        shared = _SHARED_ARGUMENTS.get(type(module), ())
        names_and_specs, leaves, split = [], [], []
        for name, value in bound.arguments.items():
            argument_leaves, spec = optree.tree_flatten(value, none_is_leaf=True)
            names_and_specs.append((name, spec, len(argument_leaves)))
            for leaf in argument_leaves:
                leaves.append(leaf)
                split.append(
                    name not in shared
                    and isinstance(leaf, torch.Tensor)
                    and leaf.dim() > 0
                    and leaf.shape[0] == batch
                )
        params = {name: module.get_parameter(name).detach() for name in names}
        # Outputs that received no gradient (attention weights nobody used) contribute nothing.
        received = [index for index, grad in enumerate(grads) if grad is not None]
        cotangents = [grads[index] for index in received]

        def one_example(example_leaves, example_cotangents):
            example_leaves = [
                leaf.unsqueeze(0) if is_split else leaf for leaf, is_split in zip(example_leaves, split)
            ]
            arguments, start = {}, 0
            for name, spec, count in names_and_specs:
                arguments[name] = optree.tree_unflatten(spec, example_leaves[start:start + count])
                start += count
            call = inspect.BoundArguments(bound.signature, arguments)

            def outputs(layer_params):
                result = optree.tree_leaves(functional_call(module, layer_params, call.args, call.kwargs))
                return tuple(result[index] for index in received)

            _, pullback = vjp(outputs, params)
            return pullback(tuple(cotangent.unsqueeze(0) for cotangent in example_cotangents))[0]

        in_dims = ([0 if is_split else None for is_split in split], [0] * len(cotangents))
        try:
            with contextlib.ExitStack() as replay:
                for device, autocast_dtype in autocast:
                    replay.enter_context(torch.autocast(device, dtype=autocast_dtype))
                per_example = vmap(one_example, in_dims=in_dims, randomness="error")(leaves, cotangents)
        except RuntimeError as error:
            if "randomness" not in str(error):
                raise
            raise UnsupportedModuleError(
                f"the {type(module).__name__} layer draws random numbers in its forward, so its per-example "
                f"replay cannot reproduce the real forward; make it deterministic (put its dropout in a "
                f"separate nn.Dropout module) ({error})"
            ) from error
        return {name: per_example[name].to(dtype) for name in names}


RULE = FunctionalRule()
