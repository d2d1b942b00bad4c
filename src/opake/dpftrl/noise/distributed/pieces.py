"""Noise for stretches of parameters: the per-rank core of the distributed noise stages.

A *piece* is the element range [start, stop) of one parameter tensor (flattened), with the
columns it owns in this rank's (B, n_local) buffers. ``PieceStream`` computes, for a list of
pieces, exactly what the single-process engine (``engine.CorrelatedNoise``) computes for those
elements: the same keyed block draws (``engine.draws.BlockSampler``: z depends only on key,
step, parameter path and block index), the same streaming inverse (``engine.streaming``; every
op is elementwise over buffer columns) in the same compute dtype, and the same final
``engine.add_noise`` (gradient + scale * x). A piece that starts or stops inside a noise
block draws the whole block into a one-block scratch and keeps its slice, so any cut of the
parameters (whole tensors, blocks, FSDP shards) reproduces the single-process values bit for
bit (tests check this with ``torch.equal``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opake.dpftrl.noise.engine.correlated_noise import add_noise, columns_per_advance
from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS, BlockSampler
from opake.dpftrl.noise.engine.layout import LeafSlot

__all__ = ["Piece", "PieceStream"]


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of leaf ``leaf`` (its slot ``slot``), at ``column`` in the buffers."""

    leaf: int
    slot: LeafSlot
    start: int
    stop: int
    column: int

    @property
    def length(self) -> int:
        return self.stop - self.start


class PieceStream:
    """Advances the buffers of a list of pieces by one step and writes gradient + scale * x."""

    def __init__(self, pieces: tuple[Piece, ...], inverse, key, dtype: torch.dtype, device: torch.device):
        self.pieces = pieces
        self.inverse = inverse
        self.dtype = dtype
        self.device = device
        self.size = sum(piece.length for piece in pieces)
        self._coefficients = inverse.coefficients(dtype, device)
        self._sampler = BlockSampler(key, device)
        self._block = None    # one noise block, for pieces that cut a block
        self._scratch = None  # x for outputs in another dtype than the compute dtype

    def _scratch_of(self, name: str, length: int) -> torch.Tensor:
        current = getattr(self, name)
        if current is None or current.numel() < length:
            current = torch.empty(BLOCK_ELEMENTS, dtype=self.dtype, device=self.device)
            setattr(self, name, current)
        return current.narrow(0, 0, length)

    def advance(self, gradients, outputs, buffers: torch.Tensor, step: int, scale: float) -> None:
        """``gradients[i]`` and ``outputs[i]``: 1-D tensors of piece i's length (outputs may be
        any floating dtype); ``buffers``: this rank's (B, size) buffers, updated in place."""
        chunk = columns_per_advance(self.device)
        coefficients = self.inverse.at_step(self._coefficients, step)
        for piece, gradient, output in zip(self.pieces, gradients, outputs):
            first = piece.start // BLOCK_ELEMENTS
            last = -(-piece.stop // BLOCK_ELEMENTS)
            for block in range(first, last):
                block_begin = block * BLOCK_ELEMENTS
                block_length = min(BLOCK_ELEMENTS, piece.slot.numel - block_begin)
                lo, hi = max(piece.start, block_begin), min(piece.stop, block_begin + block_length)
                length, at = hi - lo, lo - piece.start
                out = output.narrow(0, at, length)
                direct = output.dtype == self.dtype
                x = out if direct else self._scratch_of("_scratch", length)
                if length == block_length:
                    self._sampler.fill(x, step, piece.slot.code, block)                    # x <- z
                else:
                    whole = self._scratch_of("_block", block_length)
                    self._sampler.fill(whole, step, piece.slot.code, block)
                    x.copy_(whole.narrow(0, lo - block_begin, length))                     # x <- z
                grad = gradient.narrow(0, at, length)
                columns = piece.column + at
                step_size = length if chunk is None else chunk
                for begin in range(0, length, step_size):
                    size = min(step_size, length - begin)
                    x_part = x.narrow(0, begin, size)
                    self.inverse.advance(x_part, buffers.narrow(1, columns + begin, size),
                                         coefficients)                                     # x <- (C^{-1} z)_t
                    add_noise(grad.narrow(0, begin, size), x_part, out.narrow(0, begin, size), scale)
