"""Correlated noise: strategy recipes (BLT, BandMF, identity) and the streaming noise engine."""

from opake.dpftrl.noise.band_mf import BandMFStrategy, band_mf_strategy
from opake.dpftrl.noise.strategy import (
    BLTStrategy,
    IdentityStrategy,
    Mechanism,
    blt_strategy,
    identity_strategy,
)
from opake.dpftrl.noise.engine import mf_gaussian_noise
from opake.dpftrl.noise.distributed import shard_mf_gaussian_noise, sharded_mf_gaussian_noise

__all__ = [
    "BandMFStrategy",
    "BLTStrategy",
    "IdentityStrategy",
    "Mechanism",
    "band_mf_strategy",
    "blt_strategy",
    "identity_strategy",
    "mf_gaussian_noise",
    "shard_mf_gaussian_noise",
    "sharded_mf_gaussian_noise",
]
