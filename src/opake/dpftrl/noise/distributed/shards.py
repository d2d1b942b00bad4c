"""Noise for sharded gradients (FSDP-style): each rank noises only its shard, no collective.

``shard_mf_gaussian_noise(grad_template, strategy, shards=..., ...)``: ``grad_template`` is the
*full* parameter pytree (shapes only, e.g. on the meta device is not supported: use CPU/GPU
zeros or the unsharded parameters' shapes), ``shards`` a pytree of the same structure whose
leaves are ``slice(start, stop)``: the flat element range of each parameter this rank holds
(``ownership.even_shards`` gives FSDP's even split of the flattened parameters). The
gradients passed to ``noise_fn`` have the same structure with 1-D leaves of stop - start
elements; the noise added to them equals the single-process engine's noise for those
elements, bit for bit. State: (B, n_shard) buffers.

No collective runs per step. When a process group is initialized (or ``process_group`` is
given), construction checks once that the ranks agree on the configuration; per-step
agreement (same step, same scale) is then the training loop's responsibility, as with FSDP's
own gradient reduction.
"""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

from opake.dpftrl.noise.distributed.agreement import check_agreement, fingerprint_components
from opake.dpftrl.noise.engine.correlated_noise import check_dense_gradient, validated_arguments
from opake.dpftrl.noise.distributed.ownership import map_fingerprint
from opake.dpftrl.noise.distributed.pieces import Piece
from opake.dpftrl.noise.distributed.stage import PieceStage
from opake.dpftrl.noise.engine.layout import path_text
from opake.dpftrl.noise.engine.state import NoiseState
from opake.dpftrl.noise.engine.variance import step_noise_variance
from opake.dpftrl.noise.engine.streaming import streaming_inverse
from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.random import RngKey
from opake.types import ClippedPytree, NoisedPytree

__all__ = ["ShardNoise", "shard_mf_gaussian_noise"]


def _shard_ranges(layout, shards) -> list[tuple[int, int]]:
    paths, leaves, treespec = optree.tree_flatten_with_path(shards)
    if treespec != layout.treespec:
        raise InvalidArgumentError(
            f"shards must have grad_template's structure with one slice(start, stop) per parameter; "
            f"got structure {treespec}, expected {layout.treespec}"
        )
    ranges = []
    for slot, leaf in zip(layout.leaves, leaves):
        where = path_text(slot.path)
        if not isinstance(leaf, slice) or leaf.step not in (None, 1):
            raise InvalidTypeError(f"shards[{where!r}] must be slice(start, stop) (step 1), got {leaf!r}")
        start, stop = leaf.start or 0, slot.numel if leaf.stop is None else leaf.stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= slot.numel):
            raise InvalidArgumentError(
                f"shards[{where!r}] = {leaf!r} is not a range of the parameter's {slot.numel} elements; "
                f"need 0 <= start <= stop <= {slot.numel}"
            )
        ranges.append((start, stop))
    return ranges


class ShardNoise(PieceStage):
    """``noise_fn`` of ``shard_mf_gaussian_noise``: ``(clipped shard, state) -> (NoisedPytree, state)``."""

    def __init__(self, layout, ranges, mechanism, participation, noise_multiplier, key, dtype, rank, world_size):
        inverse = streaming_inverse(mechanism)
        inverse.check_dtype(dtype)
        pieces, column = [], 0
        for leaf, (start, stop) in enumerate(ranges):
            pieces.append(Piece(leaf, layout.leaves[leaf], start, stop, column))
            column += stop - start
        super().__init__(layout, tuple(pieces), mechanism, inverse, participation, noise_multiplier, key,
                         dtype, "shards", rank, world_size,
                         map_fingerprint(layout, tuple(ranges), "shards", world_size))
        self.ranges = tuple(ranges)

    def __call__(self, clipped: ClippedPytree, state: NoiseState) -> tuple[NoisedPytree, NoiseState]:
        with torch.no_grad():
            self.check_state(state)
            self.check_clipped(clipped)
            paths, leaves, treespec = optree.tree_flatten_with_path(clipped.pytree)
            if treespec != self.layout.treespec:
                raise InvalidArgumentError(
                    f"the gradient shards do not have grad_template's structure (got {treespec}, "
                    f"expected {self.layout.treespec}); pass this rank's shard of every parameter"
                )
            gradients = []
            for piece, leaf in zip(self.pieces, leaves):
                where = path_text(piece.slot.path)
                if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                    raise InvalidTypeError(
                        f"gradient shard {where!r} must be a floating-point torch.Tensor, got {leaf!r:.80}"
                    )
                check_dense_gradient(where, leaf)
                if leaf.shape != (piece.length,):
                    raise InvalidArgumentError(
                        f"gradient shard {where!r} has shape {tuple(leaf.shape)} but this rank's shard is "
                        f"elements [{piece.start}, {piece.stop}) of the parameter: expected ({piece.length},)"
                    )
                if leaf.device != self.device:
                    raise InvalidArgumentError(
                        f"gradient shard {where!r} is on {leaf.device}, the stage on {self.device}"
                    )
                gradients.append(leaf)
            self.check_finite(gradients)
            scale = self.noise_multiplier * clipped.l2_bound / clipped.normalization
            # In the template's dtypes, as mf_gaussian_noise (gradients may be wider, e.g.
            # float32 clipped sums of bfloat16 parameters).
            outputs = [torch.empty(piece.length, dtype=piece.slot.dtype, device=self.device) for piece in self.pieces]
            step = state.step
            new_state = self.run(state, gradients, outputs, scale)
            return (NoisedPytree(pytree=self.layout.treespec.unflatten(outputs), step=step,
                                 noise_variance=step_noise_variance(self.mechanism, step, scale)), new_state)


def shard_mf_gaussian_noise(
    grad_template,
    strategy,
    *,
    shards,
    n_steps: int,
    min_sep: int = 1,
    max_participations: int | None = None,
    noise_multiplier: float,
    key: RngKey,
    process_group=None,
    dtype: torch.dtype = torch.float32,
) -> tuple[ShardNoise, NoiseState]:
    """Correlated noise for this rank's gradient shards (FSDP-style), with no per-step collective.

    See the module docstring; ``shards`` is a pytree like ``grad_template`` of
    ``slice(start, stop)`` element ranges (``opake.dpftrl.noise.distributed.even_shards(template,
    rank, world_size)`` for FSDP's even split). The state holds (B, n_shard) buffers.
    """
    layout, mechanism, participation, sigma = validated_arguments(
        grad_template, strategy, n_steps, min_sep, max_participations, noise_multiplier, key, dtype)
    ranges = _shard_ranges(layout, shards)
    rank, world_size = 0, 1
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        inverse = streaming_inverse(mechanism)
        check_agreement(fingerprint_components(
            layout, str(getattr(mechanism, "fingerprint", "")), inverse, participation, sigma, key, dtype,
            "shards"), process_group)
    noise_fn = ShardNoise(layout, ranges, mechanism, participation, sigma, key, dtype, rank, world_size)
    return noise_fn, noise_fn.init()
