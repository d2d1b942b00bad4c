"""The noise engine's state: (B, d) buffers, step counter, keys and what they belong to.

Ownership of the buffers (why a state can be advanced once). The issue's memory target is one
(B, d) buffer tensor and at most one extra d-vector per step; a functional update that returned
fresh buffers would need a second (B, d) tensor. So a state *owns* a buffer storage that the
next ``noise_fn`` call updates in place and hands to the state it returns; the state passed in
is then retired. Retired states are detected, not silently reused: the storage records the step
its contents belong to, and every use of a state compares it with the state's own step. Using a
retired state raises :class:`RetiredStateError` (never different noise).

Replaying or redrawing (why copying and restoring take an explicit choice). A second state at
a step whose noise was already released can release that step again, and each way of drawing
its noise has a cost. Replaying the same draws (``draws="replay"``) is free when the gradients
are bit-identical to the ones already released (a deterministic resume after a crash), but for
other gradients the two outputs subtract to the gradients' difference with no noise at all.
Fresh draws (``fresh_key=k``) never cancel, but they are a second release of those steps that
the privacy accounting must count (e.g. by composing the priced mechanism twice; opake does not
do this for you). Neither is safe by default, so ``state.copy(...)``,
``state.load_state_dict(saved, ...)`` and ``NoiseState.from_state_dict(saved, ...)`` require
exactly one of the two and have no default; pickling and ``copy.copy``/``copy.deepcopy`` of a
state, which could not ask, raise ``TypeError``. A state therefore has two keys: ``key``, the
engine's key, checked against the engine, and ``draw_key``, the key its draws come from: equal
to ``key`` until a fresh-key copy or restore, which derives ``draw_key`` from the fresh key
(``fresh_draw_key``), so every step from that point on is drawn anew. See SECURITY.md,
"Replaying or redrawing noise".

If an exception interrupts a call after it started writing the buffers (only possible from
outside, e.g. KeyboardInterrupt, since every check runs first), the storage is marked
corrupted and every state that shares it refuses to be used: restore from a checkpoint.

Checkpoints: ``state.state_dict()`` is a plain dict of ints, floats, strings, lists and one
tensor, so ``torch.save(state.state_dict(), path)`` and ``torch.load(path, weights_only=True)``
work; ``state.load_state_dict(loaded, draws=...)`` checks it belongs to the same engine
configuration and returns the restored state. Integrity: the dict carries a SHA-256 digest of
every other entry, the buffers' bytes included, computed by ``state_dict()`` and verified by
every load, which also refuses non-finite buffers; a flipped byte or a truncated file is
refused instead of continuing with other noise. The digest has no secret key: it detects
accidents, not a forger, who can recompute it (see SECURITY.md, "Checkpoint integrity").
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import torch

from opake.dpftrl.noise.engine.streaming import inverse_from_description
from opake.errors import InvalidArgumentError, InvalidTypeError, OpakeError
from opake.random import RngKey

__all__ = [
    "CheckpointIntegrityError", "CorruptedStateError", "NoiseHorizonError", "NoiseState", "RetiredStateError",
    "checkpoint_digest", "fresh_draw_key",
]

STATE_FORMAT = "opake.dpftrl.noise.NoiseState"
STATE_VERSION = 3
# 3: the checkpoint records the draw key (which may differ from the engine's key after a
# fresh-key copy or restore) and a SHA-256 digest of all its entries. Version 2 had neither, so
# it could not say which stream to continue and could not detect corruption: refused.
# 2: BLT buffers hold the stored form R_i = theta_i^-(t - e_i) S_i (engine.streaming); version 1
# held S itself, so a version-1 checkpoint would continue with wrong noise and is refused.

_FIELDS = ("format", "version", "step", "n_steps", "key", "draw_key", "noise_multiplier",
           "mechanism_fingerprint", "layout_fingerprint", "inverse", "buffers", "digest")
_BUFFER_DTYPES = (torch.float32, torch.float64)
_HASH_CHUNK = 2**22  # elements hashed (and copied off an accelerator) at a time
_FRESH_DRAWS_DOMAIN = "opake.dpftrl.noise.fresh_draws"
_SECURITY = "SECURITY.md, 'Replaying or redrawing noise'"

_CHOICE = (
    "draws='replay' repeats the noise already drawn for the steps from this point on: free only "
    "if the gradients of every step released again are bit-identical to the ones already released "
    "(a deterministic resume), otherwise the two releases subtract to the gradients' difference "
    "with no noise at all; fresh_key=k (an opake.random.RngKey never used in this run, e.g. "
    "opake.random.key(secrets.randbits(128)) or root.fold_in('retry-1')) draws new noise, which "
    "never cancels, but the steps drawn again are a second release that the privacy accounting "
    "must count (e.g. by composing the priced mechanism twice; opake does not do this for you)"
)

_NO_IMPLICIT_COPY = (
    "a NoiseState cannot be pickled or copied with copy.copy/copy.deepcopy: the copy would "
    "release its steps' noise again without choosing between replaying and redrawing it. Save "
    "state.state_dict() (torch.save; loads with weights_only=True) and restore it with "
    "state.load_state_dict(saved, draws='replay') or (saved, fresh_key=k), or branch in memory with "
    "state.copy(draws='replay') or state.copy(fresh_key=k): " + _CHOICE + " (see " + _SECURITY + ")"
)


class RetiredStateError(OpakeError, RuntimeError):
    """A noise state was used after a ``noise_fn`` call advanced its buffers."""


class CorruptedStateError(OpakeError, RuntimeError):
    """The buffers were left half-updated by an interrupted ``noise_fn`` call."""


class NoiseHorizonError(OpakeError, RuntimeError):
    """``noise_fn`` was asked for a step beyond the ``n_steps`` the mechanism was built for."""


class CheckpointIntegrityError(OpakeError, ValueError):
    """A noise-state checkpoint that is not one ``state_dict()`` wrote, unchanged: truncated, edited or of
    another version, with contents that do not match its digest, or with non-finite buffers."""


def fresh_draw_key(fresh_key: RngKey) -> RngKey:
    """The draw key of a state copied or restored with ``fresh_key``.

    Derived under its own domain so that the draws never coincide with any other use of
    ``fresh_key`` (for instance as another engine's or a sampler's key).
    """
    return fresh_key.fold_in(_FRESH_DRAWS_DOMAIN)


def _require_choice(draws, fresh_key, action: str) -> None:
    """Raise unless exactly one of draws='replay' and fresh_key=RngKey was given."""
    if draws is None and fresh_key is None:
        raise InvalidTypeError(
            f"{action} needs an explicit choice of noise draws, and there is no default: pass "
            f"draws='replay' or fresh_key=k. Each has a privacy cost: {_CHOICE} (see {_SECURITY})"
        )
    if draws is not None and fresh_key is not None:
        raise InvalidTypeError(f"{action}: pass either draws='replay' or fresh_key=k, not both")
    if draws is not None and draws != "replay":
        raise InvalidArgumentError(
            f"{action}: draws must be 'replay', got {draws!r}; to draw new noise pass fresh_key=k "
            f"instead (an opake.random.RngKey never used in this run)"
        )
    if fresh_key is not None and not isinstance(fresh_key, RngKey):
        raise InvalidTypeError(
            f"{action}: fresh_key must be an opake.random.RngKey (e.g. opake.random.key(seed) or "
            f"root.fold_in('retry-1')), got {type(fresh_key).__name__}"
        )


def _chosen_draw_key(draws, fresh_key, *, engine_key: RngKey, current: RngKey, action: str) -> RngKey:
    """The draw key after ``action``: ``current`` to replay, else the one derived from fresh_key."""
    _require_choice(draws, fresh_key, action)
    if draws == "replay":
        return current
    derived = fresh_draw_key(fresh_key)
    if fresh_key in (engine_key, current) or derived == current:
        raise InvalidArgumentError(
            f"{action}: fresh_key is the engine's key or the key this state already draws with, so "
            f"its draws would replay the noise already released instead of drawing new noise; "
            f"pass a key never used in this run (e.g. root.fold_in('retry-1')), or draws='replay' "
            f"if replaying is what you mean"
        )
    return derived


class _Storage:
    """The mutable cell behind a chain of states: the buffers and the step they hold.

    ``step`` is the number of steps already folded into ``buffers``; -1 while a call is writing
    them, and ``corrupted_at`` is set if that call did not finish. ``moved`` is set when
    ``load_state_dict`` hands the buffers to a new storage: the states of this one are retired.
    """

    __slots__ = ("buffers", "step", "corrupted_at", "moved")

    def __init__(self, buffers: torch.Tensor, step: int):
        self.buffers = buffers
        self.step = step
        self.corrupted_at = None
        self.moved = False


@dataclass(frozen=True, eq=False)
class NoiseState:
    """State of a correlated-noise stream after ``step`` steps (see the module docstring).

    Fields: ``step`` (steps done, 0-based index of the next one), ``n_steps`` (the horizon the
    mechanism and its accounting assumed), ``key`` (the engine's key), ``draw_key`` (the key the
    noise is drawn with: ``key`` unless a copy or restore chose fresh draws), ``noise_multiplier``,
    ``mechanism_fingerprint`` and ``layout_fingerprint`` (which mechanism and which parameter
    layout the buffers belong to), ``inverse`` (the streaming inverse). ``buffers`` is the
    (B, d) tensor; read it, do not modify it.
    """

    step: int
    n_steps: int
    key: RngKey
    draw_key: RngKey
    noise_multiplier: float
    mechanism_fingerprint: str
    layout_fingerprint: str
    inverse: object
    _storage: _Storage = field(repr=False)
    # The engine that created this chain of states (or None when rebuilt by from_state_dict):
    # lets noise_fn skip re-comparing its configuration for its own states. Not part of equality.
    _origin: object = field(default=None, repr=False)

    # -- validity -------------------------------------------------------------------------

    @property
    def is_current(self) -> bool:
        """True while no call has advanced (or corrupted) this state's buffers."""
        storage = self._storage
        return storage.step == self.step and storage.corrupted_at is None and not storage.moved

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
                f"buffers, so they match no step; restore the state from a checkpoint with "
                f"state.load_state_dict(torch.load(path, weights_only=True), draws='replay') if no "
                f"step after the checkpoint was released or you will recompute bit-identical "
                f"gradients for those that were, else with fresh_key=k and count those steps twice "
                f"in the accounting (see {_SECURITY})"
            )
        if storage.moved:
            raise RetiredStateError(
                f"this noise state (step {self.step}) was retired by load_state_dict, which moved its "
                f"buffers to the state it returned; use that state"
            )
        if storage.step != self.step:
            raise RetiredStateError(
                f"this noise state (step {self.step}) was already advanced by a noise_fn call: its "
                f"buffers were updated in place and now hold step {storage.step}. Use the state that "
                f"call returned. To release a step twice, call state.copy(draws='replay') or "
                f"state.copy(fresh_key=k) *before* noise_fn: {_CHOICE} (see {_SECURITY})"
            )

    @property
    def buffers(self) -> torch.Tensor:
        self.require_current()
        return self._storage.buffers

    @classmethod
    def fresh(cls, origin, columns: int, mechanism_fingerprint: str, layout_fingerprint: str) -> NoiseState:
        """Step 0 with zero (B, columns) buffers for the stage ``origin`` (an engine or a
        distributed stage: ``inverse``, ``participation``, ``key``, ``noise_multiplier``,
        ``dtype``, ``device``); it draws with the engine's key."""
        buffers = torch.zeros((origin.inverse.num_buffers, columns), dtype=origin.dtype, device=origin.device)
        return cls(
            0, origin.participation.n_steps, origin.key, origin.key, origin.noise_multiplier,
            mechanism_fingerprint, layout_fingerprint, origin.inverse, _Storage(buffers, 0), origin,
        )

    # -- derived states -------------------------------------------------------------------

    def _with(self, step: int, storage: _Storage, draw_key: RngKey | None = None) -> NoiseState:
        return NoiseState(
            step, self.n_steps, self.key, self.draw_key if draw_key is None else draw_key,
            self.noise_multiplier, self.mechanism_fingerprint, self.layout_fingerprint, self.inverse,
            storage, self._origin,
        )

    def copy(self, *, draws: str | None = None, fresh_key: RngKey | None = None) -> NoiseState:
        """An independent state at the same step, with cloned buffers (one (B, d) copy).

        Exactly one of ``draws="replay"`` (the copy draws what this state would draw) and
        ``fresh_key=k`` (the copy draws from a key derived from ``k``, from this step on) is
        required; there is no default because each costs privacy in its own way:
        replaying is free only if every step released from both states gets bit-identical
        gradients, else their outputs subtract to the gradients' difference with no noise;
        fresh draws are a second release of those steps, which the accounting must count
        (opake does not). ``fresh_key`` must differ from ``key`` and ``draw_key``.
        """
        draw_key = _chosen_draw_key(draws, fresh_key, engine_key=self.key, current=self.draw_key,
                                    action="state.copy()")
        self.require_current()
        return self._with(self.step, _Storage(self._storage.buffers.clone(), self.step), draw_key)

    def advanced(self) -> NoiseState:
        """(engine use) Mark the storage as holding step + 1 and return the state for it."""
        self._storage.step = self.step + 1
        return self._with(self.step + 1, self._storage)

    # -- copies that could not choose -----------------------------------------------------

    def __reduce_ex__(self, protocol):
        raise InvalidTypeError(_NO_IMPLICIT_COPY)

    def __reduce__(self):
        raise InvalidTypeError(_NO_IMPLICIT_COPY)

    def __copy__(self):
        raise InvalidTypeError(_NO_IMPLICIT_COPY)

    def __deepcopy__(self, memo):
        raise InvalidTypeError(_NO_IMPLICIT_COPY)

    # -- equality -------------------------------------------------------------------------

    def __eq__(self, other) -> bool:
        if not isinstance(other, NoiseState):
            return NotImplemented
        if (self.step, self.n_steps, self.key, self.draw_key, self.noise_multiplier, self.mechanism_fingerprint,
                self.layout_fingerprint, self.inverse) != (
                other.step, other.n_steps, other.key, other.draw_key, other.noise_multiplier,
                other.mechanism_fingerprint, other.layout_fingerprint, other.inverse):
            return False
        mine, theirs = self.buffers, other.buffers
        return mine.dtype == theirs.dtype and mine.device == theirs.device and torch.equal(mine, theirs)

    __hash__ = None

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain-data checkpoint (loads with ``torch.load(..., weights_only=True)``).

        Like ``nn.Module.state_dict``, the ``"buffers"`` entry is the live tensor, which the
        next ``noise_fn`` call overwrites: save it right away, or clone it (saved after such a
        call, the checkpoint fails its integrity check on load instead of giving wrong noise).
        It is in the streaming inverse's stored form (for a BLT, scaled per epoch; see
        ``engine.streaming``), meaningful together with ``"step"`` and ``"inverse"`` only.
        ``"draw_key"`` says which stream a replaying restore continues; ``"digest"`` is the
        SHA-256 of all other entries (``checkpoint_digest``), read by one pass over the buffers.
        """
        self.require_current()
        state_dict = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "step": self.step,
            "n_steps": self.n_steps,
            "key": self.key.hex(),
            "draw_key": self.draw_key.hex(),
            "noise_multiplier": self.noise_multiplier,
            "mechanism_fingerprint": self.mechanism_fingerprint,
            "layout_fingerprint": self.layout_fingerprint,
            "inverse": self.inverse.describe(),
            "buffers": self._storage.buffers,
        }
        state_dict["digest"] = checkpoint_digest(state_dict)
        return state_dict

    def load_state_dict(self, state_dict: dict, *, draws: str | None = None,
                        fresh_key: RngKey | None = None) -> NoiseState:
        """The state saved in ``state_dict``, checked to belong to this state's engine.

        ``draws="replay"`` continues the checkpoint's own stream (its ``draw_key``): free only if
        the steps from the checkpoint on were never released, or are recomputed with
        bit-identical gradients; ``fresh_key=k`` draws them anew from a key derived from ``k``,
        a second release of every step already released from this point, which the accounting
        must count. One of the two is required (see the module docstring).

        The checkpoint must pass its integrity check (digest, finite buffers), and everything
        that determines the noise must match (key, mechanism, parameter layout, horizon, noise
        multiplier, buffer shape and dtype); the buffers are copied onto this state's device. If
        this state is current its buffers are reused and it is retired, otherwise new ones are
        allocated. On any error this state is left as it was.
        """
        _require_choice(draws, fresh_key, "load_state_dict()")
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
            raise InvalidArgumentError(
                "this checkpoint belongs to a different noise engine configuration ("
                + "; ".join(mismatches)
                + "); build the engine with the same grad_template, strategy, n_steps, min_sep, "
                "max_participations, noise_multiplier, key and dtype as the run that saved it"
            )
        draw_key = _chosen_draw_key(draws, fresh_key, engine_key=self.key,
                                    current=RngKey.from_hex(checked["draw_key"]), action="load_state_dict()")
        if self.is_current:
            # Reuse the buffers, but in a new storage: this state, whose draw key and step may
            # differ from the checkpoint's, must not keep advancing buffers that now hold
            # another stream.
            old = self._storage
            with torch.no_grad():
                old.buffers.copy_(saved)
            old.moved = True
            storage = _Storage(old.buffers, checked["step"])
        else:
            storage = _Storage(saved.to(device=reference.device, copy=True), checked["step"])
        return self._with(checked["step"], storage, draw_key)

    @classmethod
    def from_state_dict(cls, state_dict: dict, *, draws: str | None = None,
                        fresh_key: RngKey | None = None) -> NoiseState:
        """A state rebuilt from ``state_dict`` alone (checked against the engine when used).

        ``draws="replay"`` or ``fresh_key=k`` is required, with the costs described in
        ``load_state_dict``. The checkpoint must pass its integrity check. The buffers are
        cloned, so the new state never shares memory with the state that produced
        ``state_dict``. Prefer ``engine_state.load_state_dict(...)``, which checks the
        checkpoint against the engine right away and reuses the engine state's buffers.
        """
        _require_choice(draws, fresh_key, "NoiseState.from_state_dict()")
        checked = _checked_fields(state_dict)
        key = RngKey.from_hex(checked["key"])
        draw_key = _chosen_draw_key(draws, fresh_key, engine_key=key,
                                    current=RngKey.from_hex(checked["draw_key"]),
                                    action="NoiseState.from_state_dict()")
        return cls(
            checked["step"], checked["n_steps"], key, draw_key, checked["noise_multiplier"],
            checked["mechanism_fingerprint"], checked["layout_fingerprint"],
            inverse_from_description(checked["inverse"]),
            _Storage(checked["buffers"].clone(), checked["step"]),
        )


def _metadata_bytes(state_dict: dict) -> bytes:
    # Canonical text of every entry but the buffers and the digest: JSON with sorted keys,
    # floats in their shortest round-trip form, so equal values give equal bytes after a
    # torch.save/torch.load round trip.
    metadata = {name: state_dict[name] for name in _FIELDS if name not in ("buffers", "digest")}
    try:
        return json.dumps(metadata, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as error:
        raise CheckpointIntegrityError(f"noise-state checkpoint metadata is not plain data ({error})") from None


def _buffer_chunks(buffers: torch.Tensor):
    """The buffers' elements in row-major order, as CPU pieces of at most _HASH_CHUNK."""
    flat = buffers.detach().reshape(-1)
    for begin in range(0, flat.numel(), _HASH_CHUNK):
        yield flat[begin:begin + _HASH_CHUNK].cpu().contiguous()


def checkpoint_digest(state_dict: dict) -> str:
    """SHA-256 (hex) of a noise-state checkpoint: all metadata entries and the buffers' dtype,
    shape and bytes. ``state_dict()`` stores it under ``"digest"``; every load recomputes it."""
    buffers = state_dict["buffers"]
    digest = hashlib.sha256(_metadata_bytes(state_dict))
    digest.update(f"|{buffers.dtype}|{tuple(buffers.shape)}|".encode())
    for chunk in _buffer_chunks(buffers):
        digest.update(chunk.numpy())
    return digest.hexdigest()


def _checked_fields(state_dict) -> dict:
    """``state_dict`` after checking its format, version, fields and integrity."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        raise CheckpointIntegrityError(
            "not a noise-state checkpoint: expected the dict returned by NoiseState.state_dict()"
        )
    if state_dict.get("version") != STATE_VERSION:
        raise CheckpointIntegrityError(
            f"noise-state checkpoint version {state_dict.get('version')!r} is not supported "
            f"(this opake reads version {STATE_VERSION}); resume with the opake version that saved it"
        )
    missing = [name for name in _FIELDS if name not in state_dict]
    if missing:
        raise CheckpointIntegrityError(f"noise-state checkpoint is missing {missing}; it is truncated or was edited")
    unexpected = sorted(map(str, set(state_dict) - set(_FIELDS)))
    if unexpected:
        raise CheckpointIntegrityError(
            f"noise-state checkpoint has unexpected entries {unexpected}; it was edited or corrupted"
        )
    step, n_steps = state_dict["step"], state_dict["n_steps"]
    if not (type(step) is int and type(n_steps) is int and 0 <= step <= n_steps):
        raise CheckpointIntegrityError(f"noise-state checkpoint has an invalid step {step!r} for n_steps {n_steps!r}")
    sigma = state_dict["noise_multiplier"]
    if not isinstance(sigma, float) or not math.isfinite(sigma) or sigma <= 0:
        raise CheckpointIntegrityError(f"noise-state checkpoint has an invalid noise_multiplier {sigma!r}")
    for name in ("key", "draw_key"):
        try:
            RngKey.from_hex(state_dict[name])
        except (TypeError, ValueError, AttributeError):
            raise CheckpointIntegrityError(
                f"noise-state checkpoint has an invalid {name} {state_dict[name]!r:.80}; expected 64 hex digits"
            ) from None
    for name in ("mechanism_fingerprint", "layout_fingerprint", "digest"):
        if not isinstance(state_dict[name], str):
            raise CheckpointIntegrityError(
                f"noise-state checkpoint has a non-text {name} ({type(state_dict[name]).__name__})"
            )
    if not isinstance(state_dict["inverse"], dict):
        raise CheckpointIntegrityError(
            "noise-state checkpoint 'inverse' must be a dict (the streaming inverse's description)"
        )
    buffers = state_dict["buffers"]
    if (not isinstance(buffers, torch.Tensor) or buffers.dim() != 2 or buffers.layout != torch.strided
            or buffers.dtype not in _BUFFER_DTYPES):
        raise CheckpointIntegrityError("noise-state checkpoint 'buffers' must be a dense 2-D float32 or float64 tensor")
    if checkpoint_digest(state_dict) != state_dict["digest"]:
        raise CheckpointIntegrityError(
            "noise-state checkpoint failed its integrity check: its SHA-256 digest does not match "
            "its contents, so it was corrupted (a flipped byte, a truncated or partly written "
            "file) or edited, or its 'buffers' tensor changed after state_dict() returned (a "
            "noise_fn call before it was saved). Loading it would continue with other noise; "
            "restore from an intact checkpoint"
        )
    if not all(bool(torch.isfinite(chunk).all()) for chunk in _buffer_chunks(buffers)):
        raise CheckpointIntegrityError(
            "noise-state checkpoint has NaN or infinite buffers, which no run produces (the buffers "
            "hold finite noise only); restore from an intact checkpoint"
        )
    return state_dict


def check_state_for(stage, state, *, mechanism: str, layout: str, columns: int, returned_by: str) -> None:
    """Refuse a state that ``stage`` (an engine or a distributed stage) must not advance.

    Not a NoiseState, retired or corrupted, from another configuration (e.g. rebuilt by
    from_state_dict for a different run), or past the horizon: each raises before any buffer
    is written. The draw key is not compared: a fresh-key state belongs to the same engine.
    """
    if not isinstance(state, NoiseState):
        raise InvalidTypeError(
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
            raise InvalidArgumentError(
                f"this noise state belongs to a different noise engine (differs in: "
                f"{', '.join(mismatches)}); pass the state returned by {returned_by}"
            )
    state.require_before_horizon()
