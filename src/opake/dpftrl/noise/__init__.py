"""Correlated noise: strategy recipes (BLT, identity) and the streaming noise engine."""

from opake.dpftrl.noise.strategy import (
    BLTStrategy,
    IdentityStrategy,
    Mechanism,
    blt_strategy,
    identity_strategy,
)
from opake.dpftrl.noise.engine import mf_gaussian_noise

__all__ = [
    "BLTStrategy",
    "IdentityStrategy",
    "Mechanism",
    "blt_strategy",
    "identity_strategy",
    "mf_gaussian_noise",
]
