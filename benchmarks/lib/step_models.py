"""The models and data of benchmarks/training_step.py, shared with its Opacus peer.

Plain torch only: ``benchmarks/peers/opacus_step.py`` imports this module in Opacus' own
environment, where opake is not installed. ``SIZES`` are the full and ``--quick`` settings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CNN", "SIZES", "Transformer", "data", "loss", "model"]

SIZES = {False: dict(batches=(64, 256), width=128, layers=2, length=64, repeats=7),
         True: dict(batches=(8, 16), width=32, layers=1, length=16, repeats=2)}


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    """Pre-norm transformer block; attention from Linear layers (what ghost clipping covers)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.out(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocabulary=1000, width=128, layers=2, heads=4, length=64):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(length, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)  # batch first, as hooks need
        x = self.embed(tokens) + self.position(positions)
        return self.head(self.norm(self.blocks(x)))


def data(name: str, count: int, size: dict):
    generator = torch.Generator().manual_seed(0)
    if name == "cnn":
        return torch.utils.data.TensorDataset(torch.randn(count, 1, 28, 28, generator=generator),
                                              torch.randint(0, 10, (count,), generator=generator))
    tokens = torch.randint(0, 1000, (count, size["length"] + 1), generator=generator)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())  # Opacus needs contiguous ids


def loss(name, model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def model(name, size: dict):
    torch.manual_seed(0)
    if name == "cnn":
        return CNN()
    return Transformer(width=size["width"], layers=size["layers"], length=size["length"])
