"""What the two distributed noise stages share: configuration, local state, checks, resume.

A rank's state is an ordinary ``engine.state.NoiseState`` whose buffers are (B, n_local), the
columns of the pieces this rank computes, and whose ``layout_fingerprint`` reads
``"distributed:<mode>:world_size=<W>:rank=<r>:<hash of the whole ownership map>"``. So
``state.state_dict()`` / ``torch.save`` work as for one process, each rank saving its part,
and ``noise_fn.load_state_dict(saved, draws="replay")`` (or ``fresh_key=k``) refuses, with a
message naming the difference, a checkpoint from another world size, rank or ownership mode
before the generic checks (integrity, key, mechanism, horizon, ...). The choice between
replaying and redrawing is required as for one process (``engine.state``); every rank must make
the same one (the same fresh key), else the ranks' pieces continue different streams.

A state drawing with a fresh draw key (``state.draw_key != noise_fn.key``) is advanced by a
``PieceStream`` of that key, built once and cached, as the engine caches its samplers.
"""

from __future__ import annotations

import math

import torch

from opake.dpftrl.noise.distributed.pieces import Piece, PieceStream
from opake.dpftrl.noise.engine.draws import PerDrawKey
from opake.dpftrl.noise.engine.correlated_noise import check_dense_gradient
from opake.dpftrl.noise.engine.layout import Layout, path_text
from opake.dpftrl.noise.engine.state import check_state_for, NoiseState
from opake.dpftrl.noise.priced import check_noise_priced
from opake.errors import InvalidArgumentError, InvalidTypeError, OpakeError
from opake.random import RngKey
from opake.types import ClippedPytree

__all__ = ["DistributedCheckpointError", "PieceStage"]

_PREFIX = "distributed"


class DistributedCheckpointError(OpakeError, ValueError):
    """A checkpoint from another world size, rank or ownership mode."""


def _parse(fingerprint) -> dict | None:
    if not isinstance(fingerprint, str) or not fingerprint.startswith(_PREFIX + ":"):
        return None
    parts = fingerprint.split(":")
    if len(parts) != 5:
        return None
    return {"mode": parts[1], "world_size": parts[2].partition("=")[2], "rank": parts[3].partition("=")[2]}


class PieceStage:
    """Base of the distributed stages: owns ``pieces`` of ``layout`` on ``rank`` of ``world_size``."""

    def __init__(self, layout: Layout, pieces: tuple[Piece, ...], mechanism, inverse, participation,
                 noise_multiplier: float, key, dtype: torch.dtype, mode: str, rank: int,
                 world_size: int, map_hash: str):
        self.layout = layout
        self.pieces = pieces
        self.mechanism = mechanism
        self.inverse = inverse
        self.participation = participation
        self.noise_multiplier = noise_multiplier
        self.key = key
        self.dtype = dtype
        self.device = layout.device
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self._streams = PerDrawKey(key, lambda draw_key: PieceStream(pieces, inverse, draw_key, dtype, layout.device))
        self.local_size = self._streams.own.size
        self._mechanism_fingerprint = str(getattr(mechanism, "fingerprint", ""))
        self._layout_fingerprint = f"{_PREFIX}:{mode}:world_size={world_size}:rank={rank}:{map_hash}"

    def check_accounted_by(self, process) -> None:
        """Raise unless ``process`` priced exactly this noise (as ``noise_fn.check_accounted_by``
        of the single-process engine: mechanism, participation context, noise multiplier)."""
        check_noise_priced(process, mechanism=self.mechanism, participation=self.participation,
                           noise_multiplier=self.noise_multiplier)

    def init(self) -> NoiseState:
        """A fresh state: zero (B, n_local) buffers, step 0."""
        return NoiseState.fresh(self, self.local_size, self._mechanism_fingerprint, self._layout_fingerprint)

    def load_state_dict(self, state_dict: dict, *, draws: str | None = None,
                        fresh_key: RngKey | None = None) -> NoiseState:
        """This rank's state saved by ``state.state_dict()``, checked against this stage.

        ``draws="replay"`` or ``fresh_key=k`` is required, with the privacy costs described in
        ``NoiseState.load_state_dict``; use the same choice on every rank.
        """
        saved = _parse(state_dict.get("layout_fingerprint")) if isinstance(state_dict, dict) else None
        if saved is None:
            raise DistributedCheckpointError(
                "this checkpoint was not saved by a distributed noise stage (a single-process "
                "state, or not a noise state); load it with the engine that saved it"
            )
        for name, mine in (("ownership", self.mode), ("world_size", str(self.world_size)), ("rank", str(self.rank))):
            theirs = saved["mode" if name == "ownership" else name]
            if theirs != mine:
                raise DistributedCheckpointError(
                    f"this checkpoint was saved with {name}={theirs} but this run has {name}={mine}; "
                    f"each rank saves only the noise buffers of what it owns, so resume with the "
                    f"same world size and ownership, each rank loading its own file"
                )
        return self.init().load_state_dict(state_dict, draws=draws, fresh_key=fresh_key)

    # -- checks (all run before any buffer is written) ----------------------------------------

    def check_state(self, state) -> None:
        check_state_for(self, state, mechanism=self._mechanism_fingerprint, layout=self._layout_fingerprint,
                        columns=self.local_size, returned_by="this stage when it was built or by its previous call")

    @staticmethod
    def check_clipped(clipped) -> None:
        if not isinstance(clipped, ClippedPytree):
            raise InvalidTypeError(
                f"noise_fn needs an opake.types.ClippedPytree, which carries the L2 bound that "
                f"scales the noise; got {type(clipped).__name__}. Wrap gradients you clipped "
                f"yourself with opake.types.clipped(pytree, l2_bound=..., normalization=...)"
            )

    def check_dense(self, leaves) -> None:
        """``leaves``: one gradient (or gradient shard) per template leaf, in layout order."""
        for slot, leaf in zip(self.layout.leaves, leaves):
            check_dense_gradient(path_text(slot.path), leaf)

    def check_finite(self, gradients) -> None:
        """``gradients``: the 1-D gradient stretch of each owned piece."""
        for piece, gradient in zip(self.pieces, gradients):
            if gradient.numel() and not all(math.isfinite(v.item()) for v in torch.aminmax(gradient)):
                raise InvalidArgumentError(
                    f"the gradients contain NaN or inf (in {path_text(piece.slot.path)!r}); noise "
                    f"cannot make them private. Check the loss and the clipping before calling noise_fn"
                )

    def run(self, state: NoiseState, gradients, outputs, scale: float) -> NoiseState:
        """Advance ``state``'s buffers into ``outputs`` (as the engine does: a call interrupted
        while writing marks the storage corrupted) and return the next state."""
        stream = self._streams(state.draw_key)
        storage, step = state._storage, state.step
        storage.step = -1
        try:
            stream.advance(gradients, outputs, storage.buffers, step, scale)
        except BaseException:
            storage.corrupted_at = step
            raise
        storage.step = step
        return state.advanced()

