"""Strategy mathematics (float64, no torch state): which C, its sensitivity, its errors.

BLT (``blt``, ``blt_optimize``), BandMF (``band_mf``, ``band_mf_optimize``), the identity and the
resolved ``Mechanism`` (``strategy``), with the references they are tested against
(``toeplitz``, ``geometric``) and the optimizer they share (``lbfgs``). The streaming noise that
uses a resolved mechanism lives in ``opake.dpftrl.noise``, which re-exports the recipes at the
seed's import paths (``opake.dpftrl.noise.blt_strategy``).
"""

from opake.dpftrl.strategies.band_mf import BandMFStrategy, band_mf_strategy
from opake.dpftrl.strategies.strategy import (
    BLTStrategy,
    IdentityStrategy,
    Mechanism,
    blt_strategy,
    identity_strategy,
)

__all__ = ["BandMFStrategy", "BLTStrategy", "IdentityStrategy", "Mechanism", "band_mf_strategy", "blt_strategy",
           "identity_strategy"]
