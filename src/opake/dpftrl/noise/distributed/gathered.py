"""Data-parallel noise with sharded state: each rank noises what it owns, one all-gather shares it.

``sharded_mf_gaussian_noise(grad_template, strategy, ..., process_group=None,
ownership="tensors")`` is the distributed form of ``mf_gaussian_noise`` for DDP-style training
(every rank holds the same, all-reduced, clipped gradients). Every rank computes the same
ownership map (``ownership``), keeps (B, n_owned) buffers only for its own parameters and, at
each step, writes gradient + scale * x for them into a byte buffer; one
``all_gather_into_tensor`` over the process group gives every rank all of them, and every
leaf of the returned pytree is copied out of the gathered bytes into a tensor of its own
(see "What a released leaf owns" below). The values equal ``mf_gaussian_noise``'s bit for bit on the same device type for
any world size (noise is keyed by (key, step, parameter path, block); see ``pieces``).

What travels: each rank's slot is a 32-byte header (a format tag, its state's step, the bits
of its noise scale as float64, and a status: 0 ok, 1 its local checks failed) followed by its
outputs, each aligned to 8 bytes, padded to the largest rank's size; the alignment gaps and the
padding are zeroed before the gather, so no rank sends uninitialized memory. After the gather
every rank reads all headers and raises the same ``RankDisagreementError`` when the steps or
scales differ or a rank's checks failed (that rank re-raises its own error), so a mismatch is an
error on every rank, never different noise, and never a hang (a failing rank still joins the
collective). After such an error the ranks' streams are out of step: restore every rank from
its checkpoint. Outputs have the template's dtypes (as in ``mf_gaussian_noise``, whatever the
gradients' floating dtypes), which fixes the byte layout on all ranks.

What a released leaf owns: exactly its own values. ``torch.save`` writes a tensor's whole
storage, so a leaf that viewed the gathered bytes would carry, in every saved file, the headers,
the padding, every other leaf and whatever the allocator left in memory it handed out (in a
review run: about 400 000 raw float32 values of a training example). So each leaf is copied out
of the gathered bytes into a tensor of its own (one copy of d values per step; the gathered
buffer is freed when the step returns), and ``leaf.untyped_storage().nbytes() == leaf.numel() *
leaf.element_size()`` in every ownership mode (tests check this, and that an un-noised gradient
value never appears in a released storage). On CPU these tensors are recycled as the engine's
output (``engine.pages.OutputVectors``, one per leaf): a leaf's tensor from the last step is
overwritten in full once the caller no longer references it, else a new one is allocated.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from opake.dpftrl.noise.distributed.agreement import (
    RankDisagreementError,
    check_agreement,
    fingerprint_components,
    group_rank_and_size,
)
from opake.dpftrl.noise.distributed.ownership import OWNERSHIP_MODES, map_fingerprint, ownership_map
from opake.dpftrl.noise.distributed.pieces import Piece
from opake.dpftrl.noise.distributed.stage import PieceStage
from opake.dpftrl.noise.engine.correlated_noise import validated_arguments
from opake.dpftrl.noise.engine.layout import Layout, path_text
from opake.dpftrl.noise.engine.pages import OutputVectors
from opake.dpftrl.noise.engine.state import NoiseState
from opake.dpftrl.noise.engine.variance import step_noise_variance
from opake.dpftrl.noise.engine.streaming import streaming_inverse
from opake.errors import InvalidArgumentError
from opake.random import RngKey
from opake.types import ClippedPytree, NoisedPytree

__all__ = ["GatheredNoise", "sharded_mf_gaussian_noise"]

_HEADER_BYTES = 32
_TAG = 0x6F70616B  # "opak"
_ALIGN = 8
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _byte_layout(layout: Layout, ranges) -> tuple[list, int]:
    """For one rank's ranges: their byte offsets after the header, and the slot's total bytes."""
    offsets, at = [], _HEADER_BYTES
    for leaf, start, stop in ranges:
        offsets.append(at)
        at += _aligned((stop - start) * layout.leaves[leaf].dtype.itemsize)
    return offsets, at


def _padding(layout: Layout, ranges, slot_bytes: int) -> list[tuple[int, int]]:
    """For one rank's slot: (start, length) of each byte that is neither header nor output."""
    offsets, _ = _byte_layout(layout, ranges)
    gaps, ends = [], [offset + (stop - start) * layout.leaves[leaf].dtype.itemsize
                      for offset, (leaf, start, stop) in zip(offsets, ranges)]
    for end, next_start in zip(ends, offsets[1:] + [slot_bytes]):
        if next_start > end:
            gaps.append((end, next_start - end))
    if not ranges and slot_bytes > _HEADER_BYTES:
        gaps.append((_HEADER_BYTES, slot_bytes - _HEADER_BYTES))
    return gaps


class GatheredNoise(PieceStage):
    """``noise_fn`` of ``sharded_mf_gaussian_noise``: ``(clipped, state) -> (NoisedPytree, state)``.

    Attributes: ``rank``, ``world_size``, ``ownership`` (the map: for each rank its
    (leaf index, start, stop) ranges), ``owned_paths`` (paths this rank computes),
    ``local_size`` (its buffer columns), ``mechanism``, ``key``, ``dtype``.
    """

    def __init__(self, layout, mechanism, participation, noise_multiplier, key, dtype, mode, process_group):
        rank, world_size = group_rank_and_size(process_group)
        inverse = streaming_inverse(mechanism)
        inverse.check_dtype(dtype)
        check_agreement(fingerprint_components(
            layout, str(getattr(mechanism, "fingerprint", "")), inverse, participation, noise_multiplier,
            key, dtype, mode), process_group)
        ranges = ownership_map(layout, world_size, mode)
        pieces, column = [], 0
        for leaf, start, stop in ranges[rank]:
            pieces.append(Piece(leaf, layout.leaves[leaf], start, stop, column))
            column += stop - start
        super().__init__(layout, tuple(pieces), mechanism, inverse, participation, noise_multiplier, key,
                         dtype, mode, rank, world_size, map_fingerprint(layout, ranges, mode, world_size))
        self.ownership = ranges
        self.process_group = process_group
        self.owned_paths = tuple(path_text(layout.leaves[leaf].path) for leaf, _, _ in ranges[rank])
        self._offsets = [_byte_layout(layout, r)[0] for r in ranges]
        self._slot_bytes = max(_byte_layout(layout, r)[1] for r in ranges)
        self._padding = _padding(layout, ranges[rank], self._slot_bytes)
        self._outputs = [OutputVectors(self.device) for _ in layout.leaves]

    def __call__(self, clipped: ClippedPytree, state: NoiseState) -> tuple[NoisedPytree, NoiseState]:
        with torch.no_grad():
            return self._step(clipped, state)

    def _local_checks(self, clipped, state):
        self.check_state(state)
        self.check_clipped(clipped)
        leaves = self.layout.flatten_gradients(clipped.pytree)
        self.check_dense(leaves)  # before reshape/narrow, which fail on sparse tensors
        gradients = [leaves[p.leaf].reshape(-1).narrow(0, p.start, p.length) for p in self.pieces]
        self.check_finite(gradients)
        return gradients, self.noise_multiplier * clipped.l2_bound / clipped.normalization

    def _step(self, clipped, state):
        send = torch.empty(self._slot_bytes, dtype=torch.uint8, device=self.device)
        step = state.step if isinstance(state, NoiseState) else -1
        failure, scale, new_state = None, 0.0, None
        try:
            gradients, scale = self._local_checks(clipped, state)
        except (ValueError, TypeError, RuntimeError) as error:
            failure = error
        header = struct.pack("<qqdq", _TAG, step, scale, 0 if failure is None else 1)
        send[:_HEADER_BYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        for start, length in self._padding:  # torch.empty's bytes must not travel to the other ranks
            send.narrow(0, start, length).zero_()
        if failure is None:
            outputs = [self._view(send, offset, piece)
                       for offset, piece in zip(self._offsets[self.rank], self.pieces)]
            new_state = self.run(state, gradients, outputs, scale)
        if self.world_size == 1:
            gathered = send  # nothing to share
        else:
            gathered = torch.empty(self._slot_bytes * self.world_size, dtype=torch.uint8, device=self.device)
            _gather(gathered, send, group=self.process_group)                   # the one collective
        slots = gathered.view(self.world_size, self._slot_bytes)
        headers = [struct.unpack("<qqdq", bytes(slots[r, :_HEADER_BYTES].cpu().numpy()))
                   for r in range(self.world_size)]
        self._agree(headers, failure)
        variance = step_noise_variance(self.mechanism, step, headers[0][2])  # rank 0's scale, as every rank's
        return NoisedPytree(pytree=self._unpack(slots), step=step, noise_variance=variance), new_state

    def _agree(self, headers, failure) -> None:
        failed = [r for r, h in enumerate(headers) if h[3] != 0 or h[0] != _TAG]
        if failure is not None:
            raise failure
        if failed:
            raise RankDisagreementError(
                f"rank(s) {failed} refused this step (see the error raised there); no rank returns "
                f"noise for it. Restore every rank from its checkpoint after fixing the cause"
            )
        steps = [h[1] for h in headers]
        if len(set(steps)) > 1:
            raise RankDisagreementError(
                f"the ranks are at different steps (step by rank: {steps}), so their noise would not "
                f"match; resume every rank from checkpoints saved at the same step"
            )
        scales = [h[2] for h in headers]
        if len(set(scales)) > 1:
            raise RankDisagreementError(
                f"the ranks use different noise scales noise_multiplier * l2_bound / normalization "
                f"(by rank: {scales}); pass the same l2_bound and normalization on every rank"
            )

    def _view(self, buffer: torch.Tensor, offset: int, piece: Piece) -> torch.Tensor:
        dtype = piece.slot.dtype
        return buffer.narrow(0, offset, piece.length * dtype.itemsize).view(dtype)

    def _unpack(self, slots: torch.Tensor):
        """Each leaf as a tensor of its own, its pieces copied out of the gathered slots.

        Never a view: ``torch.save`` writes a view's whole storage, here the headers, padding
        and every other leaf (see the module doc). The tensors come from ``OutputVectors``, one
        per leaf: on CPU the last step's once the caller no longer references it (no page
        faults), else a new one."""
        parts: list[list] = [[] for _ in self.layout.leaves]
        for rank, ranges in enumerate(self.ownership):
            for offset, (leaf, start, stop) in zip(self._offsets[rank], ranges):
                dtype = self.layout.leaves[leaf].dtype
                parts[leaf].append((start, slots[rank].narrow(0, offset, (stop - start) * dtype.itemsize).view(dtype)))
        outputs = []
        for slot, vectors, pieces in zip(self.layout.leaves, self._outputs, parts):
            flat = vectors.get(slot.dtype, slot.numel)
            for start, piece in pieces:
                flat.narrow(0, start, piece.numel()).copy_(piece)
            outputs.append(flat.view(slot.shape))
        return self.layout.treespec.unflatten(outputs)


def sharded_mf_gaussian_noise(
    grad_template,
    strategy,
    *,
    n_steps: int,
    min_sep: int = 1,
    max_participations: int | None = None,
    noise_multiplier: float,
    key: RngKey,
    process_group=None,
    ownership: str = "tensors",
    dtype: torch.dtype = torch.float32,
) -> tuple[GatheredNoise, NoiseState]:
    """``mf_gaussian_noise`` for data-parallel training, with the noise state sharded over ranks.

    Call it on every rank of ``process_group`` (default: the world) with the same arguments;
    it checks, with one collective, that they agree. ``ownership``: ``"tensors"`` (each rank
    owns whole tensors, greedy-balanced by size), ``"blocks"`` (contiguous runs of 2**20-element
    noise blocks, for models dominated by a few huge tensors) or ``"even"`` (equal runs of
    elements, cut anywhere: at most ceil(d / world_size) buffer columns per rank). Each rank's state holds
    (B, n_owned) buffers; ``noise_fn(clipped, state)`` returns on every rank the full noisy
    gradients, identical on all ranks and to ``mf_gaussian_noise`` with the same key, using one
    all-gather per step. Checkpoint with ``state.state_dict()`` on each rank and resume with
    ``noise_fn.load_state_dict(saved, draws="replay")`` (or ``fresh_key=k``, the same on every
    rank; see ``engine.state`` for what each costs) at the same world size.
    """
    if ownership not in OWNERSHIP_MODES:
        raise InvalidArgumentError(f"ownership must be one of {OWNERSHIP_MODES}, got {ownership!r}")
    layout, mechanism, participation, sigma = validated_arguments(
        grad_template, strategy, n_steps, min_sep, max_participations, noise_multiplier, key, dtype)
    noise_fn = GatheredNoise(layout, mechanism, participation, sigma, key, dtype, ownership, process_group)
    return noise_fn, noise_fn.init()
