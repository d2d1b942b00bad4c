"""nn.Embedding: norms from the token-equality mask, the clipped sum by index_add.

Example i looks up tokens ``x_i[t]`` and gets output gradients ``G_i[t]`` (T x dim). Its weight
gradient has row v equal to the sum of ``G_i[t]`` over the positions holding token v (positions
holding ``padding_idx`` contribute nothing, as in the layer's own backward), so

    ||grad_i||^2 = sum_{t,s} [x_i[t] == x_i[s] != padding_idx] * (G_i[t] . G_i[s])

which needs a T x T mask and Gram matrix per example (formed a chunk of examples at a time),
never the vocab x dim gradient. The clipped sum scatters ``c_i * G_i[t]`` into one vocab x dim
tensor with ``index_add_``. A small table is offered to the book-keeping to form per example
instead (``materialized``): one scatter into B x vocab x dim, reused for the norms and the sum.
Small means that its vocab x dim elements, each written (zeros, then the scatter) and read twice
(the norm, the sum) at ``KEPT_COST`` multiply-adds apiece (rules/base.py), cost no more than
the T^2 (dim + 1) of the ghost norm: GPT-2's 128 x 128 position table at T = 64 (262k against
528k per example), not Llama's 2048 x 128 token table (4.2M against 528k, and 1 MiB per
example held).
"""

from __future__ import annotations

import torch

from opake.torch.per_example.errors import UnsupportedModuleError
from opake.torch.per_example.rules.base import KEPT_COST, LayerRule, example_chunks


def _tokens_and_rows(module, stored, grad, dtype):
    """(B, T) tokens, (B, T, dim) output-gradient rows, and the (B, T) mask of positions that
    count (None when the layer has no padding_idx or no position holds it: all count)."""
    tokens = stored.reshape(stored.shape[0], -1)
    rows = grad.to(dtype).reshape(grad.shape[0], -1, grad.shape[-1])
    counted = None
    if module.padding_idx is not None:
        counted = tokens != module.padding_idx
        if bool(counted.all()):
            counted = None
    return tokens, rows, counted


class EmbeddingRule(LayerRule):
    ghost = True
    regroup_positions = True  # a scatter over positions: a unit's rows regroup as one example (per_example/units.py)

    def check(self, module, path):
        if module.scale_grad_by_freq:
            raise UnsupportedModuleError(
                f"the Embedding at {path!r} has scale_grad_by_freq=True, which divides each gradient by "
                f"token counts over the whole batch and so mixes examples; set scale_grad_by_freq=False"
            )

    def materialized(self, module, stored, grads, names):
        # A small table (position embeddings: n_positions x dim) is cheaper formed per example
        # (vocab x dim, one scatter) than through T x T Gram matrices (module docstring).
        length = stored[0].numel() if stored.shape[0] else 0
        table = module.num_embeddings * module.embedding_dim
        if KEPT_COST * table <= length * length * (module.embedding_dim + 1):
            return tuple(names)
        return ()

    def squared_norms(self, module, stored, grads, names, dtype):
        tokens, rows, counted = _tokens_and_rows(module, stored, grads[0], dtype)
        batch, length = tokens.shape
        parts = []
        for chunk in example_chunks(batch, 2 * length * length):
            same = tokens[chunk, :, None] == tokens[chunk, None, :]
            if counted is not None:
                same &= counted[chunk, :, None] & counted[chunk, None, :]
            gram = torch.bmm(rows[chunk], rows[chunk].transpose(1, 2))
            parts.append((gram * same).sum(dim=(1, 2)))
        return {"weight": torch.cat(parts) if parts else rows.new_zeros(0)}

    def clipped_sums(self, module, stored, grads, names, weights, dtype):
        tokens, rows, counted = _tokens_and_rows(module, stored, grads[0], dtype)
        scaled = rows * weights[:, None, None]
        total = torch.zeros(module.num_embeddings, module.embedding_dim, dtype=dtype, device=rows.device)
        if counted is None:
            total.index_add_(0, tokens.reshape(-1), scaled.reshape(-1, scaled.shape[-1]))
        else:
            total.index_add_(0, tokens[counted], scaled[counted])
        return {"weight": total}

    def per_example_grads(self, module, stored, grads, names, dtype):
        tokens, rows, counted = _tokens_and_rows(module, stored, grads[0], dtype)
        batch = tokens.shape[0]
        vocabulary = module.num_embeddings
        flat = torch.zeros(batch * vocabulary, module.embedding_dim, dtype=dtype, device=rows.device)
        offsets = torch.arange(batch, device=tokens.device)[:, None] * vocabulary
        if counted is None:
            flat.index_add_(0, (tokens + offsets).reshape(-1), rows.reshape(-1, rows.shape[-1]))
        else:
            flat.index_add_(0, (tokens + offsets)[counted], rows[counted])
        return {"weight": flat.reshape(batch, vocabulary, module.embedding_dim)}


RULE = EmbeddingRule()
