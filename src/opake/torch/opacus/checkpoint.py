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

A noise-free run's checkpoint (``noise_multiplier=0``) loaded into a noised run, as Opacus' own
checkpoint test does: the model and optimizer are loaded, and the run is then noise-free for good
(``no_noise.NoiseFreeWeightsTraining``: its epsilon is infinite, since its weights were trained
without noise), its accountant's history the saved one. Noise and clipping schedulers
(``opake.torch.opacus.schedulers``, which never change the planned values) are saved and restored
under Opacus' entry names.
"""

from __future__ import annotations

import torch

from opake.errors import InvalidArgumentError
from opake.torch.checkpoint import CheckpointError
from opake.torch.opacus.keys import run_key
from opake.torch.opacus.no_noise import NoiseFreeTraining, is_noise_free_checkpoint, load_noise_free_weights
from opake.torch.opacus.schedulers import _StepSchedule

__all__ = ["load_checkpoint", "save_checkpoint"]

_RUN = "opake_private_training"
_ACCOUNTANT = "privacy_accountant_state_dict"
_NOISE_SCHEDULER, _CLIP_SCHEDULER = "noise_scheduler_state_dict", "grad_clip_scheduler_state_dict"  # Opacus' names


def save_checkpoint(engine, *, path, module, optimizer=None, noise_scheduler=None, grad_clip_scheduler=None,
                    checkpoint_dict=None, module_state_dict_kwargs=None, torch_save_kwargs=None) -> None:
    """Write ``checkpoint_dict`` with the run's state (module docstring)."""
    private = _checked(engine, module, optimizer, noise_scheduler, grad_clip_scheduler, module_state_dict_kwargs)
    checkpoint = dict(checkpoint_dict or {})
    checkpoint[_RUN] = private.state_dict()
    checkpoint[_ACCOUNTANT] = engine.accountant.state_dict()
    for entry, scheduler in ((_NOISE_SCHEDULER, noise_scheduler), (_CLIP_SCHEDULER, grad_clip_scheduler)):
        if scheduler is not None:
            checkpoint[entry] = scheduler.state_dict()
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
    run, history = checkpoint.pop(_RUN), checkpoint.pop(_ACCOUNTANT, None)
    schedulers = [(scheduler, checkpoint.pop(entry, None)) for entry, scheduler in
                  ((_NOISE_SCHEDULER, noise_scheduler), (_CLIP_SCHEDULER, grad_clip_scheduler))]
    if is_noise_free_checkpoint(run) and not isinstance(private, NoiseFreeTraining):
        # Weights trained without noise, into a noised run: that run is noise-free from now on.
        load_noise_free_weights(private, run)
        engine.accountant.inherited = _history(history, run)
    else:
        if draws is None and fresh_key is None:
            fresh_key = run_key(None, engine.secure_mode).fold_in("opake.torch.opacus.load_checkpoint")
        private.load_state_dict(run, draws=draws, fresh_key=fresh_key)
    for scheduler, state in schedulers:
        if scheduler is not None and state is not None:
            scheduler.load_state_dict(state)
    return checkpoint


def _history(saved, run: dict) -> list:
    """The saved accountant's history, or, where it is missing or malformed, the noise-free steps the
    run's noise state records (the history is a record only: the run's epsilon is infinite either way)."""
    history = saved.get("history") if isinstance(saved, dict) else None
    if isinstance(history, list) and all(isinstance(entry, tuple) and len(entry) == 3 for entry in history):
        return list(history)
    noise = run.get("noise")
    steps = noise.get("step") if isinstance(noise, dict) else None
    return [(0.0, None, steps)] if isinstance(steps, int) and steps else []


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
    for scheduler in (noise_scheduler, grad_clip_scheduler):
        if scheduler is not None and not isinstance(scheduler, _StepSchedule):
            raise InvalidArgumentError(
                f"{type(scheduler).__name__} is not one of opake.torch.opacus' schedulers (StepNoise, StepGradClip), "
                f"which keep the noise multiplier and the clipping bound the run was planned with"
            )
    if state_dict_kwargs:
        raise InvalidArgumentError(
            "module state-dict options are not available: the checkpoint holds the module's full "
            "state_dict(), restored exactly; drop the argument"
        )
    return private
