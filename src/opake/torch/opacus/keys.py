"""The run's key when an Opacus script gives none: from torch's generator, or from the OS.

Opacus draws its noise from torch's default generator unless ``secure_mode=True``, so
``torch.manual_seed(s)`` at the top of a script reproduces a run (Opacus' own
``test_deterministic_run``). The adapter keeps that meaning: without ``key=``, and with
``secure_mode=False`` (Opacus' default), the run's 128-bit key is four 32-bit words drawn from
torch's default CPU generator, so the same seed gives the same batches and noise and another
seed another run. That key has at most the entropy of torch's seed (64 bits when torch seeds
itself, the seed's when you set it) and anyone who knows the seed can regenerate the noise and
remove it: an experiment setting, as in Opacus. ``secure_mode=True`` draws the key from the
operating system (``secrets.randbits(128)``), which is what SECURITY.md asks of a run whose
outputs are published; ``key=opake.random.key(seed)`` gives the key yourself (refused with
``secure_mode=True``, as Opacus refuses a seeded generator there).
"""

from __future__ import annotations

import secrets

import torch

from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.random import RngKey, key as make_key

__all__ = ["run_key"]

_WORD = 1 << 32


def run_key(key: RngKey | None, secure_mode: bool) -> RngKey:
    """The key of a run planned by the adapter (module docstring)."""
    if key is not None:
        if secure_mode:
            raise InvalidArgumentError(
                "key= and secure_mode=True contradict each other: secure_mode draws the key from the operating "
                "system so that nobody knows it; drop key= (or secure_mode=True for a reproducible experiment)"
            )
        if not isinstance(key, RngKey):
            raise InvalidTypeError(
                f"key must be an opake.random.RngKey (opake.random.key(seed)), got {type(key).__name__}"
            )
        return key
    if secure_mode:
        return make_key(secrets.randbits(128))
    words = torch.randint(0, _WORD, (4,), dtype=torch.int64)  # torch's default generator, as Opacus' noise
    return make_key(sum(int(word) << (32 * index) for index, word in enumerate(words)))
