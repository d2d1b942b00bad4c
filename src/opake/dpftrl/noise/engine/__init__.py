"""The streaming noise engine: ``mf_gaussian_noise`` streams sigma * clip / norm * C^{-1} z.

Modules, one job each: ``correlated_noise`` (the stage and its factory), ``state`` (the frozen
state, checkpoints), ``streaming`` (the strategies' streaming inverses), ``draws`` (keyed
Gaussian blocks), ``layout`` (the pytree's flat layout), ``plan`` (the per-step plan of
segments), ``pages`` (output vectors on CPU). The strategy mathematics lives beside this
package, in ``opake.dpftrl.noise``; nothing here imports it back except through a resolved
``Mechanism``.
"""

from opake.dpftrl.noise.engine.correlated_noise import CorrelatedNoise, mf_gaussian_noise

__all__ = ["CorrelatedNoise", "mf_gaussian_noise"]
