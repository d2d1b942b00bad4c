"""Opacus' ``save_checkpoint`` / ``load_checkpoint`` on the run's own checkpoint.

``save_checkpoint(path=, module=, optimizer=, checkpoint_dict=)`` writes ``checkpoint_dict``
(yours: epoch, best accuracy, ...) with one more entry, ``"opake_private_training"``: the run's
``PrivateTraining.state_dict()`` (model, optimizer, noise state, step, key, plan record; loadable
with ``torch.load(..., weights_only=True)``), and ``"privacy_accountant_state_dict"`` as Opacus
writes it. ``load_checkpoint`` restores it into the engine's run, planned identically with the
same key (``torch.manual_seed(s)`` before ``make_private`` gives the same key again; otherwise
pass ``key=``), and returns the rest of the dict.

The noise after a restore. A checkpoint restores the noise state at its step. The steps after
it get either the noise already drawn for them (``draws="replay"``) or new noise
(``fresh_key=k``), and neither is free when some of those steps were already released before
the restore (SECURITY.md, "Replaying or redrawing noise"): replayed noise on gradients that
differ by a single bit releases their difference in the clear, an unbounded loss; new noise
releases those steps a second time, which the reported epsilon does not count (twice the
composition of those steps, a bounded loss). Opacus' behaviour is the second: its noise after a
restore is new, and its accountant counts each step once. The default here is the same, new
noise from a key never used by the run (drawn as the engine draws its key: torch's generator
unless ``secure_mode``), because its failure is bounded; ``draws="replay"`` continues the
original noise exactly (a deterministic resume with no step released after the checkpoint).
Either way the reported epsilon covers one release of each step: resume from the latest
checkpoint, with nothing released after it, and both are exact.
"""

from __future__ import annotations

import torch

from opake.errors import InvalidArgumentError
from opake.torch.checkpoint import CheckpointError
from opake.torch.opacus.keys import run_key

__all__ = ["load_checkpoint", "save_checkpoint"]

_RUN = "opake_private_training"
_ACCOUNTANT = "privacy_accountant_state_dict"


def save_checkpoint(engine, *, path, module, optimizer=None, noise_scheduler=None, grad_clip_scheduler=None,
                    checkpoint_dict=None, module_state_dict_kwargs=None, torch_save_kwargs=None) -> None:
    """Write ``checkpoint_dict`` with the run's state (module docstring)."""
    private = _checked(engine, module, optimizer, noise_scheduler, grad_clip_scheduler, module_state_dict_kwargs)
    checkpoint = dict(checkpoint_dict or {})
    checkpoint[_RUN] = private.state_dict()
    checkpoint[_ACCOUNTANT] = engine.accountant.state_dict()
    torch.save(checkpoint, path, **(torch_save_kwargs or {}))


def load_checkpoint(engine, *, path, module, optimizer=None, noise_scheduler=None, grad_clip_scheduler=None,
                    module_load_dict_kwargs=None, torch_load_kwargs=None, draws=None, fresh_key=None) -> dict:
    """Restore the run's state from ``path``; returns the rest of the saved dict (module docstring)."""
    private = _checked(engine, module, optimizer, noise_scheduler, grad_clip_scheduler, module_load_dict_kwargs)
    checkpoint = torch.load(path, **{"weights_only": True, **(torch_load_kwargs or {})})
    if not isinstance(checkpoint, dict) or _RUN not in checkpoint:
        raise CheckpointError(
            f"{path!r} is not a checkpoint of opake's PrivacyEngine.save_checkpoint (no {_RUN!r} "
            f"entry); save it with privacy_engine.save_checkpoint(path=..., module=..., optimizer=...)"
        )
    if draws is None and fresh_key is None:
        fresh_key = run_key(None, engine.secure_mode).fold_in("opake.torch.opacus.load_checkpoint")
    private.load_state_dict(checkpoint.pop(_RUN), draws=draws, fresh_key=fresh_key)
    checkpoint.pop(_ACCOUNTANT, None)
    return checkpoint


def _checked(engine, module, optimizer, noise_scheduler, grad_clip_scheduler, state_dict_kwargs):
    private = engine.private
    if private is None:
        raise InvalidArgumentError(
            "no run is planned yet: call make_private or make_private_with_epsilon first, with the "
            "same arguments as the run that saved the checkpoint"
        )
    if module is not private.module:
        raise InvalidArgumentError("module is not this engine's: pass the module make_private returned")
    if optimizer is not None and optimizer is not private.optimizer:
        raise InvalidArgumentError("optimizer is not this engine's: pass the optimizer make_private returned (or None)")
    if noise_scheduler is not None or grad_clip_scheduler is not None:
        raise InvalidArgumentError(
            "noise and clipping schedulers are not available: the plan fixes the noise multiplier "
            "and the clipping bound for the whole run (the accountant prices exactly those)"
        )
    if state_dict_kwargs:
        raise InvalidArgumentError(
            "module state-dict options are not available: the checkpoint holds the module's full "
            "state_dict(), restored exactly; drop the argument"
        )
    return private
