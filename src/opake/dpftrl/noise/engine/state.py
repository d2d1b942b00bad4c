"""The noise engine's state: (B, d) buffers, step counter, key and what they belong to.

Ownership of the buffers (why a state can be advanced once). The issue's memory target is one
(B, d) buffer tensor and at most one extra d-vector per step; a functional update that returned
fresh buffers would need a second (B, d) tensor. So a state *owns* a buffer storage that the
next ``noise_fn`` call updates in place and hands to the state it returns; the state passed in
is then retired. Retired states are detected, not silently reused: the storage records the step
its contents belong to, and every use of a state compares it with the state's own step. Using a
retired state raises :class:`RetiredStateError` (never different noise). So from the caller's
side ``noise_fn`` is pure in the sense that matters: the same state gives the same output or an
error. ``state.copy()`` clones the buffers (the one explicit 2x-memory operation) to keep a
state for a second call (retrying a step, tests of purity).

If an exception interrupts a call after it started writing the buffers (only possible from
outside, e.g. KeyboardInterrupt, since every check runs first), the storage is marked
corrupted and every state that shares it refuses to be used: restore from a checkpoint.

Checkpoints: ``state.state_dict()`` is a plain dict of ints, floats, strings, lists and one
tensor, so ``torch.save(state.state_dict(), path)`` and ``torch.load(path, weights_only=True)``
work; ``state.load_state_dict(loaded)`` checks it belongs to the same engine configuration and
returns the restored state. Pickling a whole state (``torch.save(state, path)``) also works but
needs ``weights_only=False`` to load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from opake.dpftrl.noise.engine.streaming import inverse_from_description
from opake.random import RngKey

__all__ = ["CorruptedStateError", "NoiseHorizonError", "NoiseState", "RetiredStateError"]

STATE_FORMAT = "opake.dpftrl.noise.NoiseState"
STATE_VERSION = 2
# 2: BLT buffers hold the stored form R_i = theta_i^-(t - e_i) S_i (engine.streaming); version 1
# held S itself, so a version-1 checkpoint would continue with wrong noise and is refused.


class RetiredStateError(RuntimeError):
    """A noise state was used after a ``noise_fn`` call advanced its buffers."""


class CorruptedStateError(RuntimeError):
    """The buffers were left half-updated by an interrupted ``noise_fn`` call."""


class NoiseHorizonError(RuntimeError):
    """``noise_fn`` was asked for a step beyond the ``n_steps`` the mechanism was built for."""


class _Storage:
    """The mutable cell behind a chain of states: the buffers and the step they hold.

    ``step`` is the number of steps already folded into ``buffers``; -1 while a call is writing
    them, and ``corrupted_at`` is set if that call did not finish.
    """

    __slots__ = ("buffers", "step", "corrupted_at")

    def __init__(self, buffers: torch.Tensor, step: int):
        self.buffers = buffers
        self.step = step
        self.corrupted_at = None


@dataclass(frozen=True, eq=False)
class NoiseState:
    """State of a correlated-noise stream after ``step`` steps (see the module docstring).

    Fields: ``step`` (steps done, 0-based index of the next one), ``n_steps`` (the horizon the
    mechanism and its accounting assumed), ``key``, ``noise_multiplier``,
    ``mechanism_fingerprint`` and ``layout_fingerprint`` (which mechanism and which parameter
    layout the buffers belong to), ``inverse`` (the streaming inverse). ``buffers`` is the
    (B, d) tensor; read it, do not modify it.
    """

    step: int
    n_steps: int
    key: RngKey
    noise_multiplier: float
    mechanism_fingerprint: str
    layout_fingerprint: str
    inverse: object
    _storage: _Storage = field(repr=False)
    # The engine that created this chain of states (or None after unpickling): lets noise_fn
    # skip re-comparing its configuration for its own states. Not part of equality.
    _origin: object = field(default=None, repr=False)

    # -- validity -------------------------------------------------------------------------

    @property
    def is_current(self) -> bool:
        """True while no call has advanced (or corrupted) this state's buffers."""
        return self._storage.step == self.step and self._storage.corrupted_at is None

    def mismatches(self, *, key, mechanism, layout, n_steps, noise_multiplier, inverse, columns,
                   dtype, device) -> list:
        """Names of the settings in which this state differs from the given stage's."""
        buffers = self._storage.buffers
        return [
            name for name, mine, theirs in (
                ("key", key, self.key),
                ("mechanism", mechanism, self.mechanism_fingerprint),
                ("parameter layout", layout, self.layout_fingerprint),
                ("n_steps", n_steps, self.n_steps),
                ("noise_multiplier", noise_multiplier, self.noise_multiplier),
                ("streaming inverse", inverse, self.inverse),
                ("buffer shape", (inverse.num_buffers, columns), tuple(buffers.shape)),
                ("buffer dtype", dtype, buffers.dtype),
                ("buffer device", device, buffers.device),
            ) if mine != theirs
        ]

    def require_before_horizon(self) -> None:
        """Raise NoiseHorizonError once all n_steps steps of noise are used."""
        if self.step >= self.n_steps:
            raise NoiseHorizonError(
                f"noise_fn was called for step {self.step + 1} (1-based) but the mechanism was built "
                f"for n_steps={self.n_steps}, and the privacy accounting assumed n_steps={self.n_steps}: "
                f"all of its noise is used. To train longer, build the strategy, accounting and engine "
                f"for a larger n_steps"
            )

    def require_current(self) -> None:
        """Raise unless this state's buffers still hold step ``step``."""
        storage = self._storage
        if storage.corrupted_at is not None:
            raise CorruptedStateError(
                f"a noise_fn call at step {storage.corrupted_at} was interrupted while updating the "
                f"buffers, so they match no step; restore the state from a checkpoint "
                f"(state.load_state_dict(torch.load(path)))"
            )
        if storage.step != self.step:
            raise RetiredStateError(
                f"this noise state (step {self.step}) was already advanced by a noise_fn call: its "
                f"buffers were updated in place and now hold step {storage.step}. Use the state that "
                f"call returned, or call state.copy() before noise_fn to keep a state for reuse"
            )

    @property
    def buffers(self) -> torch.Tensor:
        self.require_current()
        return self._storage.buffers

    @classmethod
    def fresh(cls, origin, columns: int, mechanism_fingerprint: str, layout_fingerprint: str) -> NoiseState:
        """Step 0 with zero (B, columns) buffers for the stage ``origin`` (an engine or a
        distributed stage: ``inverse``, ``participation``, ``key``, ``noise_multiplier``,
        ``dtype``, ``device``)."""
        buffers = torch.zeros((origin.inverse.num_buffers, columns), dtype=origin.dtype, device=origin.device)
        return cls(
            0, origin.participation.n_steps, origin.key, origin.noise_multiplier, mechanism_fingerprint,
            layout_fingerprint, origin.inverse, _Storage(buffers, 0), origin,
        )

    # -- derived states -------------------------------------------------------------------

    def _with(self, step: int, storage: _Storage) -> NoiseState:
        return NoiseState(
            step, self.n_steps, self.key, self.noise_multiplier, self.mechanism_fingerprint,
            self.layout_fingerprint, self.inverse, storage, self._origin,
        )

    def copy(self) -> NoiseState:
        """An independent state with cloned buffers (costs one (B, d) copy)."""
        self.require_current()
        return self._with(self.step, _Storage(self._storage.buffers.clone(), self.step))

    def advanced(self) -> NoiseState:
        """(engine use) Mark the storage as holding step + 1 and return the state for it."""
        self._storage.step = self.step + 1
        return self._with(self.step + 1, self._storage)

    # -- equality -------------------------------------------------------------------------

    def __eq__(self, other) -> bool:
        if not isinstance(other, NoiseState):
            return NotImplemented
        if (self.step, self.n_steps, self.key, self.noise_multiplier, self.mechanism_fingerprint,
                self.layout_fingerprint, self.inverse) != (
                other.step, other.n_steps, other.key, other.noise_multiplier,
                other.mechanism_fingerprint, other.layout_fingerprint, other.inverse):
            return False
        mine, theirs = self.buffers, other.buffers
        return mine.dtype == theirs.dtype and mine.device == theirs.device and torch.equal(mine, theirs)

    __hash__ = None

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain-data checkpoint (loads with ``torch.load(..., weights_only=True)``).

        Like ``nn.Module.state_dict``, the ``"buffers"`` entry is the live tensor, which the
        next ``noise_fn`` call overwrites: save it right away, or clone it. It is in the
        streaming inverse's stored form (for a BLT, scaled per epoch; see ``engine.streaming``),
        meaningful together with ``"step"`` and ``"inverse"`` only.
        """
        self.require_current()
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "step": self.step,
            "n_steps": self.n_steps,
            "key": self.key.hex(),
            "noise_multiplier": self.noise_multiplier,
            "mechanism_fingerprint": self.mechanism_fingerprint,
            "layout_fingerprint": self.layout_fingerprint,
            "inverse": self.inverse.describe(),
            "buffers": self._storage.buffers,
        }

    def load_state_dict(self, state_dict: dict) -> NoiseState:
        """The state saved in ``state_dict``, checked to belong to this state's engine.

        Everything that determines the noise must match (key, mechanism, parameter layout,
        horizon, noise multiplier, buffer shape and dtype); the buffers are copied onto this
        state's device. If this state is current its buffers are reused (and it is retired),
        otherwise new ones are allocated.
        """
        checked = _checked_fields(state_dict)
        mismatches = []
        for name, mine in (
            ("key", self.key.hex()),
            ("mechanism_fingerprint", self.mechanism_fingerprint),
            ("layout_fingerprint", self.layout_fingerprint),
            ("n_steps", self.n_steps),
            ("noise_multiplier", self.noise_multiplier),
            ("inverse", self.inverse.describe()),
        ):
            if checked[name] != mine:
                mismatches.append(f"{name}: saved {checked[name]!r}, this engine {mine!r}")
        reference = self._storage.buffers
        saved = checked["buffers"]
        if saved.shape != reference.shape or saved.dtype != reference.dtype:
            mismatches.append(
                f"buffers: saved {tuple(saved.shape)} {saved.dtype}, this engine "
                f"{tuple(reference.shape)} {reference.dtype}"
            )
        if mismatches:
            raise ValueError(
                "this checkpoint belongs to a different noise engine configuration ("
                + "; ".join(mismatches)
                + "); build the engine with the same grad_template, strategy, n_steps, min_sep, "
                "max_participations, noise_multiplier, key and dtype as the run that saved it"
            )
        if self.is_current:
            storage = self._storage
            with torch.no_grad():
                storage.buffers.copy_(saved)
            storage.step = checked["step"]
        else:
            storage = _Storage(saved.to(device=reference.device, copy=True), checked["step"])
        return self._with(checked["step"], storage)

    @classmethod
    def from_state_dict(cls, state_dict: dict) -> NoiseState:
        """A state rebuilt from ``state_dict`` alone (checked against the engine when used).

        The buffers are cloned, so the new state never shares memory with the state that
        produced ``state_dict``. Prefer ``engine.state.load_state_dict(...)``, which checks
        the checkpoint against the engine right away and reuses the engine state's buffers.
        """
        return cls._from_owned_state_dict({**state_dict, "buffers": _checked_fields(state_dict)["buffers"].clone()})

    @classmethod
    def _from_owned_state_dict(cls, state_dict: dict) -> NoiseState:
        # For unpickling: the tensor in the dict was just created for us, so it is adopted.
        checked = _checked_fields(state_dict)
        return cls(
            checked["step"], checked["n_steps"], RngKey.from_hex(checked["key"]),
            checked["noise_multiplier"], checked["mechanism_fingerprint"],
            checked["layout_fingerprint"], inverse_from_description(checked["inverse"]),
            _Storage(checked["buffers"], checked["step"]),
        )

    def __reduce__(self):
        return (NoiseState._from_owned_state_dict, (self.state_dict(),))


def _checked_fields(state_dict) -> dict:
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        raise ValueError(
            "not a noise-state checkpoint: expected the dict returned by NoiseState.state_dict()"
        )
    if state_dict.get("version") != STATE_VERSION:
        raise ValueError(
            f"noise-state checkpoint version {state_dict.get('version')!r} is not supported "
            f"(this opake reads version {STATE_VERSION})"
        )
    required = ("step", "n_steps", "key", "noise_multiplier", "mechanism_fingerprint",
                "layout_fingerprint", "inverse", "buffers")
    missing = [name for name in required if name not in state_dict]
    if missing:
        raise ValueError(f"noise-state checkpoint is missing {missing}")
    step, n_steps = state_dict["step"], state_dict["n_steps"]
    if not (isinstance(step, int) and isinstance(n_steps, int) and 0 <= step <= n_steps):
        raise ValueError(f"noise-state checkpoint has an invalid step {step!r} for n_steps {n_steps!r}")
    sigma = state_dict["noise_multiplier"]
    if not isinstance(sigma, float) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"noise-state checkpoint has an invalid noise_multiplier {sigma!r}")
    if not isinstance(state_dict["buffers"], torch.Tensor) or state_dict["buffers"].dim() != 2:
        raise ValueError("noise-state checkpoint 'buffers' must be a 2-D tensor")
    return state_dict


def check_state_for(stage, state, *, mechanism: str, layout: str, columns: int, returned_by: str) -> None:
    """Refuse a state that ``stage`` (an engine or a distributed stage) must not advance.

    Not a NoiseState, retired or corrupted, from another configuration (e.g. unpickled for a
    different run), or past the horizon: each raises before any buffer is written.
    """
    if not isinstance(state, NoiseState):
        raise TypeError(
            f"noise_fn's second argument must be the NoiseState returned by {returned_by}, "
            f"got {type(state).__name__}"
        )
    state.require_current()
    if state._origin is not stage:
        mismatches = state.mismatches(
            key=stage.key, mechanism=mechanism, layout=layout, n_steps=stage.participation.n_steps,
            noise_multiplier=stage.noise_multiplier, inverse=stage.inverse, columns=columns,
            dtype=stage.dtype, device=stage.device,
        )
        if mismatches:
            raise ValueError(
                f"this noise state belongs to a different noise engine (differs in: "
                f"{', '.join(mismatches)}); pass the state returned by {returned_by}"
            )
    state.require_before_horizon()
