"""Privacy accounting for matrix-factorization (DP-FTRL) runs.

* ``mf_gaussian(noise_multiplier, strategy, n_steps, min_sep, max_participations)``: the run as
  one Gaussian with noise multiplier noise_multiplier / S (exact).
* ``balls_in_bins(mf_gaussian(noise_multiplier, strategy), num_bins, n_steps)``: fixed bins
  processed cyclically; by default the tightest bound proven for adaptively chosen gradients
  (the random-allocation PLD for orthogonal bins, as the identity strategy's; the unamplified
  bound for every other strategy, a BLT included); the amplified bound of the aligned pair
  (method="amplified", not proven for adaptive gradients when bins interact) and a Monte Carlo
  estimate (method="monte_carlo") on request.
* ``poisson(mf_gaussian(noise_multiplier, strategy), sample_rate, n_steps)``: cyclic Poisson
  sampling for BandMF (Band23 Thm 4) and the identity strategy (DP-SGD), by PLD; refuses a BLT.

Each of them says which bound it computes (``process.method``, an ``AccountingMethod``) and
states the noise it priced as ``priced_noise`` (a ``PricedNoise``: the resolved
mechanism and the noise multiplier); ``check_noise_priced`` (what
``noise_fn.check_accounted_by(process)`` runs) refuses a noise stage that runs other noise.
"""

from opake.dpftrl.accounting.allocation.balls_in_bins import BallsInBins, UnprovenAmplificationWarning, balls_in_bins
from opake.dpftrl.accounting.factorized_gaussian import MFGaussian, UnboundMechanismError, mf_gaussian
from opake.dpftrl.accounting.allocation.monte_carlo import BallsInBinsMonteCarlo, DeltaEstimate, EpsilonEstimate
from opake.dpftrl.accounting.allocation.pld import BallsInBinsPLD
from opake.dpftrl.accounting.poisson import UnsupportedAmplificationError, poisson
from opake.dpftrl.noise.priced import AccountingMismatchError, PricedNoise, check_noise_priced
from opake.dpftrl.accounting.allocation.rdp import BallsInBinsRDP
from opake.dpftrl.accounting.methods import AccountingMethod

__all__ = [
    "AccountingMethod",
    "AccountingMismatchError",
    "BallsInBins",
    "BallsInBinsMonteCarlo",
    "BallsInBinsPLD",
    "BallsInBinsRDP",
    "DeltaEstimate",
    "EpsilonEstimate",
    "MFGaussian",
    "PricedNoise",
    "UnboundMechanismError",
    "UnprovenAmplificationWarning",
    "UnsupportedAmplificationError",
    "balls_in_bins",
    "check_noise_priced",
    "mf_gaussian",
    "poisson",
]
