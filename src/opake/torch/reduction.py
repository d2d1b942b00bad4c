"""How the clipped sums of one step meet across processes, and where the noised gradient lands.

A private step has three parts that depend on how the model is spread over processes: forming
the global clipped sum from each process's part of the batch, adding the noise once, and writing
the noised gradient where the optimizer reads it. ``DPOptimizer`` asks its reduction for each:

* ``SingleProcess``: the sum is the process's own; ``mf_gaussian_noise`` adds the noise.
* ``Replicated`` (every rank holds the whole model, torch.distributed with more than one rank):
  the clipped sums are all-reduced (one collective per dtype; clipping is per example, so the
  sum of the parts is the clipped sum of the batch), each rank noises the parameters it owns
  with ``sharded_mf_gaussian_noise`` and one all-gather shares the noised gradient, so every
  rank applies the same update (docs/distributed.md).

The noise is a function of (key, step, parameter path, element index), whatever the reduction:
a run equals the one-process run with the same key up to the order of float summation.
"""

from __future__ import annotations

import torch

from opake.dpftrl.noise import mf_gaussian_noise, sharded_mf_gaussian_noise

__all__ = ["Replicated", "SingleProcess"]


class SingleProcess:
    """One process holds the model and the whole batch."""

    rank, world_size = 0, 1

    def noise(self, template: dict, strategy, **engine_arguments):
        """The noise engine's pair ``(noise_fn, noise_state)`` for ``template`` (name -> tensor)."""
        return mf_gaussian_noise(template, strategy, **engine_arguments)

    def reduce(self, sums: dict) -> dict:
        """The clipped sums of the whole batch, from this process's part (here: all of it)."""
        return sums

    def write(self, parameters: dict, noised: dict) -> None:
        """Put the noised gradient where the optimizer reads it."""
        for name, parameter in parameters.items():
            parameter.grad = noised[name]


class Replicated(SingleProcess):
    """Every rank of ``process_group`` holds the whole model and clips its part of each batch."""

    def __init__(self, process_group, rank: int, world_size: int):
        self.process_group = process_group
        self.rank, self.world_size = rank, world_size

    def noise(self, template: dict, strategy, **engine_arguments):
        return sharded_mf_gaussian_noise(template, strategy, process_group=self.process_group, **engine_arguments)

    def reduce(self, sums: dict) -> dict:
        """The sum over ranks of every rank's clipped sums: one all-reduce per dtype."""
        import torch.distributed as dist

        result = {}
        for dtype in sorted({tensor.dtype for tensor in sums.values()}, key=str):
            names = [name for name, tensor in sums.items() if tensor.dtype == dtype]
            flat = torch.cat([sums[name].reshape(-1) for name in names])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            for name, piece in zip(names, flat.split([sums[name].numel() for name in names])):
                result[name] = piece.view(sums[name].shape)
        return result
