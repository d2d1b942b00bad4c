"""Per-example gradient clipping in ordinary PyTorch backward passes (hooks, book-keeping).

    clipper = PerExampleClipper(model, max_grad_norm=1.0, loss_reduction="mean")
    loss = F.cross_entropy(model(x), y)      # the ordinary loss over the batch
    loss.backward()
    sums = clipper.clipped_sum()             # name -> sum_i min(1, C / ||g_i||) g_i
    clipper.reset()                          # next logical batch

The hot path, and its memory. During the forward pass every hooked layer (a layer that holds
trainable parameters directly) keeps a reference to its input: the tensor autograd keeps for
its own backward anyway, so this costs no copy. During the backward pass a hook on the layer's
output keeps the gradient of that output (B x the output's size, the one new allocation per
layer, the same size as the activations). When the last hooked output of the pass has its
gradient, two passes run over what was kept, and it is freed:

1. norms: per parameter, the (B,) squared norms of the examples' gradients. Linear (and
   transformers' Conv1D, the same rule transposed), Conv1d/2d and Embedding use ghost norms
   (Li et al. 2022) where they are cheaper: a Linear weight over T positions costs two T x T
   Gram matrices per example, T^2 (in + out) multiply-adds, against T in out for forming its
   gradient; the cheaper is chosen per call (``rules/linear.py``), and formed gradients are kept
   for the sum pass where they fit the book-keeping's budget (in all, no more elements than the
   kept output gradients; otherwise they are formed a chunk of examples at a time and reduced).
   A convolution picks per layer, from its shapes, between Gram matrices of its patches, one
   grouped weight-gradient call over a chunk of examples, and a strided patch copy with one bmm
   (``rules/conv.py``). An Embedding with a small table (positions) is formed per example, a
   large one (tokens) uses the token-equality mask. LayerNorm, GroupNorm and RMSNorm gradients
   (B x channels) are formed outright; any other layer with parameters is replayed per example
   with ``torch.func.vmap`` (B x that layer's parameter count, and a ``FallbackWarning`` when
   the clipper is built). Each stored byte is read once here.
2. sums: factors ``c_i = min(1, C / ||g_i||)`` (float64), and per parameter one contraction of
   the stored tensors with them (Linear: ``(c * G)^T A``, one matmul), or one matrix-vector
   product of a kept per-example gradient. Each stored byte is read once more, at most.

This is book-keeping (Bu et al. 2023): no second backward through the model, and no B x d
per-example gradients for the ghost layers beyond that budget. The alternative, one ``vmap(grad)`` over the model
(``opake.dpftrl.clipping``), holds B x d per-example gradients at once and runs a per-example
backward of every layer.

Tied input and output embeddings (one Parameter in an nn.Embedding and an nn.Linear head) get
their norm from the two layers' ghost norms and a cross term of two T x T matrices per example
(``rules/tied.py``). Other shared parameters, and layers called more than once in a forward
pass, get each example's gradient as the sum over the calls, so their norm needs the gradient
itself: for those parameters only, the per-example gradients (B x numel) are formed, summed over
the calls, and kept until the sum pass.

Layer rules are looked up by exact type (``rules/__init__.py``); ``register_rule`` adds one for
a layer of your own (or replaces one), by class or by qualified class name. Hugging Face
layers are registered by name (``transformers.pytorch_utils.Conv1D``, the Llama family's
RMSNorm classes), so nothing here imports transformers. Mixed precision (autocast, bfloat16
weights), shared position indices and gradient checkpointing: ``clipper.py``'s docstring.

Requirements the hooks cannot check: the batch is dimension 0 of every hooked layer's input and
output (checked against the model's first input where sizes differ), the loss is a sum or mean
over examples of per-example losses, and a trainable parameter is only used inside the forward
of a layer holding it (a parameter used directly in a parent's forward, as in
``h @ self.embedding.weight.T``, escapes the hooks: hold it in a layer, e.g. a Linear whose
weight is the tied Parameter). Such a use is detected on request: with ``track_coverage()``
the unclipped sums are formed too, and ``check_coverage()`` compares them with autograd's
``.grad``, which sees every use (``make_private`` does this on the first step of a run).
Dropout in its own nn.Dropout layer just works.

Half precision: the norms and the clipped sums of bfloat16/float16 parameters are formed and
returned in float32, for the reason given in ``opake.dpftrl.clipping``: a half-precision sum of
many clipped gradients rounds by more than one example's contribution. Under ``torch.autocast``
the rules of matrix-product layers (Linear, Conv1D, convolutions) keep the low-precision copy of
the input that the layer multiplied, so that their per-example gradients are formed from
autograd's operands; the fallback replays its layer under the forward's autocast state; the
two passes themselves run with autocast off (a ``backward()`` inside autocast does not lower
their precision). ``check_coverage``'s tolerance follows the lowest precision the calls
computed in (``coverage_tolerance``: 1e-3 of the gradient norm in float32, 4 eps in half).

Several backward passes before :meth:`PerExampleClipper.clipped_sum` (virtual batches) are each
clipped on their own examples and summed; ``examples`` counts them all.
"""

from opake.torch.per_example.clipper import PerExampleClipper, coverage_tolerance
from opake.torch.per_example.errors import (
    BatchDimensionError,
    ClipperUsageError,
    FallbackWarning,
    NonFiniteGradientError,
    UnhookedUseError,
    UnsupportedModuleError,
)
from opake.torch.per_example.rules import register_rule, registered_rule
from opake.torch.per_example.rules.base import LayerRule

__all__ = [
    "BatchDimensionError",
    "ClipperUsageError",
    "FallbackWarning",
    "LayerRule",
    "NonFiniteGradientError",
    "PerExampleClipper",
    "UnhookedUseError",
    "UnsupportedModuleError",
    "coverage_tolerance",
    "register_rule",
    "registered_rule",
]
