"""opake: differentially private training with correlated noise (DP-FTRL) on PyTorch.

Public names live one import deep, at the paths the user-facing examples use:
``opake.random.key``, ``opake.dpftrl.noise.{blt_strategy, mf_gaussian_noise}``,
``opake.dpftrl.accounting.{mf_gaussian, balls_in_bins}``, ``opake.accounting.calibrate``.
"""

__version__ = "0.1.0"
