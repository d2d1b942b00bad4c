"""``DPMultiheadAttention``: ``nn.MultiheadAttention``'s interface with its projections in ``nn.Linear`` layers.

``nn.MultiheadAttention`` projects queries, keys and values with one fused weight and computes
attention in one kernel; opake clips it by replaying it per example (``rules/functional.py``), which
needs ``batch_first=True``. This layer (Opacus' name) keeps ``nn.MultiheadAttention``'s constructor
and call (``(output, weights)``, ``key_padding_mask``, ``attn_mask``, ``need_weights``,
``average_attn_weights``, ``batch_first=False`` by default: inputs (L, N, E)) but projects with four
``nn.Linear`` layers (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``), whose per-example gradients
opake forms exactly, and computes the attention itself on (N, L, E) tensors: its projections always
see the batch first, whatever ``batch_first`` says (``BATCH_FIRST_INSIDE``, read by the clipper
under ``make_private(batch_first=False)``). ``add_bias_kv`` and ``add_zero_attn`` are refused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from opake.errors import InvalidArgumentError

__all__ = ["DPMultiheadAttention"]


class DPMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with ``nn.Linear`` projections (module docstring)."""

    BATCH_FIRST_INSIDE = True  # its layers see (N, L, E) whatever the module's input layout

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise InvalidArgumentError("DPMultiheadAttention does not implement add_bias_kv or add_zero_attn; "
                                       "append the extra key and value positions to the inputs instead")
        if embed_dim % num_heads:
            raise InvalidArgumentError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.embed_dim, self.num_heads, self.dropout = int(embed_dim), int(num_heads), float(dropout)
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.batch_first = bool(batch_first)
        self.head_dim = embed_dim // num_heads
        options = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, embed_dim, **options)
        self.k_proj = nn.Linear(self.kdim, embed_dim, **options)
        self.v_proj = nn.Linear(self.vdim, embed_dim, **options)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **options)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False):
        batched = query.dim() == 3
        if not batched:  # (L, E): one example
            query, key, value = (t.unsqueeze(0 if self.batch_first else 1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (N, L, E) from here on
        batch, target, source = query.shape[0], query.shape[1], key.shape[1]
        heads = (lambda t, length: t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2))
        q = heads(self.q_proj(query), target) / math.sqrt(self.head_dim)
        k, v = heads(self.k_proj(key), source), heads(self.v_proj(value), source)
        scores = q @ k.transpose(-2, -1)  # (N, H, L, S)
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(target, source, dtype=torch.bool, device=query.device).triu(1)
        if attn_mask is not None:
            mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(batch, self.num_heads, target, source)
            scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if key_padding_mask is not None:
            padding = key_padding_mask.view(batch, 1, 1, source)
            scores = (scores.masked_fill(padding, float("-inf")) if padding.dtype == torch.bool
                      else scores + padding)
        weights = F.softmax(scores, dim=-1)
        attended = F.dropout(weights, self.dropout, training=self.training) @ v  # (N, H, L, D)
        output = self.out_proj(attended.transpose(1, 2).reshape(batch, target, self.embed_dim))
        if not self.batch_first:
            output = output.transpose(0, 1)
        if not batched:
            output = output.squeeze(0 if self.batch_first else 1)
        if not need_weights:
            return output, None
        weights = weights.mean(dim=1) if average_attn_weights else weights
        return output, (weights if batched else weights.squeeze(0))
