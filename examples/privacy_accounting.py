"""The BLT page's "Privacy accounting" example, runnable (noise multiplier from calibrate)."""

import opake.accounting as acc
import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.noise import blt_strategy

strategy = blt_strategy(max_buffers=10)
noise_multiplier = acc.calibrate(
    acc.epsilon_budget(8.0, 1e-5),
    lambda sigma: dpftrl_acc.mf_gaussian(sigma, strategy, n_steps=5000, min_sep=100, max_participations=5),
    0.01, 100.0,
).param

# Unamplified accounting for the multi-participation context above.
proc = dpftrl_acc.mf_gaussian(
    noise_multiplier, strategy, n_steps=5000, min_sep=100, max_participations=5,
)
eps = proc.epsilon_at(delta=1e-5)
assert eps > 0 and eps < float("inf"), f"epsilon out of range: {eps}"
print(f"5000 steps, <= 5 participations >= 100 apart, noise multiplier {noise_multiplier:.4f}: epsilon {eps:.4f}")

# Separate run: a fixed partition into 100 bins, repeated for five epochs.
proc = dpftrl_acc.balls_in_bins(
    dpftrl_acc.mf_gaussian(1.0, strategy),
    num_bins=100, n_steps=500,
)
eps = proc.epsilon_at(delta=1e-5)
print(f"balls in bins (100 bins, 500 steps), noise multiplier 1.0: epsilon {eps:.4f} ({proc.description})")
