"""Tied input and output embeddings: one Parameter in an nn.Embedding and an nn.Linear head.

GPT-2, BERT and Llama with ``tie_word_embeddings`` use one table W (V x d) twice: the Embedding
looks up tokens ``x_i`` (T_E of them, output gradients ``G1_i``, T_E x d) and the output head
multiplies its input ``A_i`` (T_L x d) by W^T (output gradients ``G2_i``, T_L x V). Example i's
gradient of W is ``g_E + g_L``, with ``g_E[v] = sum_{t: x_i[t] = v} G1_i[t]`` (positions holding
``padding_idx`` left out, as the layer's backward leaves them) and ``g_L = G2_i^T A_i``, so

    ||g_E + g_L||^2 = ||g_E||^2 + ||g_L||^2 + 2 <g_E, g_L>,

the first two being each layer's own squared norm (its rule's ghost norms), and the cross term

    <g_E, g_L> = sum_t G1_i[t] . g_L[x_i[t]] = sum_{s,t} G2_i[s, x_i[t]] * (A_i[s] . G1_i[t])

needing two T_L x T_E matrices per example: ``A_i G1_i^T`` and ``G2_i`` gathered at the tokens.
The clipped sum of W is the two rules' clipped sums added (each is linear in its output
gradients). Without this the book-keeping forms both layers' per-example gradients, B x V x d
(GPT-2: 38.6M elements, 154 MB in float32, per example).
"""

from __future__ import annotations

import torch

from opake.torch.per_example.rules import linear
from opake.torch.per_example.rules.base import example_chunks
from opake.torch.per_example.rules.embedding import EmbeddingRule, _tokens_and_rows
from opake.torch.per_example.rules.linear import LinearRule, _rows


def is_tied_pair(first_rule, first_local: str, second_rule, second_local: str) -> bool:
    """Whether the cross term is known for these two holders of one parameter (in either order)."""
    kinds = {(type(first_rule), first_local), (type(second_rule), second_local)}
    return kinds == {(EmbeddingRule, "weight"), (LinearRule, "weight")}


def cross_term(embedding, embedding_stored, embedding_grads, linear_stored, linear_grads, dtype) -> torch.Tensor:
    """(B,) the inner products ``<g_E, g_L>`` of the module docstring, a chunk of examples at a time."""
    tokens, rows_e, counted = _tokens_and_rows(embedding, embedding_stored, embedding_grads[0], dtype)
    rows_a, rows_g = _rows(linear_stored, dtype), _rows(linear_grads[0], dtype)
    if counted is not None:
        rows_e = rows_e * counted[..., None]
    batch, length_e = tokens.shape
    length_l = rows_a.shape[1]
    parts = []
    for chunk in example_chunks(batch, 2 * length_l * length_e):
        products = torch.bmm(rows_a[chunk], rows_e[chunk].transpose(1, 2))  # (b, T_L, T_E): A[s] . G1[t]
        index = tokens[chunk, None, :].expand(-1, length_l, -1)
        gathered = torch.gather(rows_g[chunk], 2, index)  # (b, T_L, T_E): G2[s, x[t]]
        parts.append((products * gathered).sum(dim=(1, 2)))
    return torch.cat(parts) if parts else rows_a.new_zeros(0)


def keeps_per_example(linear_stored, linear_grads) -> bool:
    """Whether forming the table's B per-example gradients (``per_example_grads``) and keeping
    them for both passes costs less than the ghost norms, cross term and ghost sums: the head's
    own cost model (rules/linear.py; tiny GPT-2's 2048 x 128 table at T = 64: 8.9M multiply-adds
    per example saved against 4.2M for the kept elements). The embedding's side is a scatter of
    T_E rows either way. The caller grants the B x V x d elements from its memory budget."""
    return linear._keeps_weight(linear_stored, linear_grads[0])


def per_example_grads(embedding, embedding_stored, embedding_grads, linear_stored, linear_grads, dtype) -> torch.Tensor:
    """(B, V, d) example i's gradient of the tied table, ``g_L + g_E`` (module docstring): the
    head's ``G2_i^T A_i`` by one batched product, then the embedding's rows ``G1_i[t]`` added in
    place at rows ``x_i[t]`` (positions holding ``padding_idx`` left out), so that only one
    B x V x d tensor is ever allocated."""
    tokens, rows_e, counted = _tokens_and_rows(embedding, embedding_stored, embedding_grads[0], dtype)
    rows_a, rows_g = _rows(linear_stored, dtype), _rows(linear_grads[0], dtype)
    grads = torch.bmm(rows_g.transpose(1, 2), rows_a)  # (B, V, d): the Linear's weight layout
    batch, vocabulary = grads.shape[0], grads.shape[1]
    flat = grads.view(batch * vocabulary, grads.shape[2])
    offsets = torch.arange(batch, device=tokens.device)[:, None] * vocabulary
    if counted is None:
        flat.index_add_(0, (tokens + offsets).reshape(-1), rows_e.reshape(-1, rows_e.shape[-1]))
    else:
        flat.index_add_(0, (tokens + offsets)[counted], rows_e[counted])
    return grads
