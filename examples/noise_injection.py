"""The BLT page's "Noise injection" example (single participation), runnable.

The loop is the page's code; only ``params``, ``batch``, ``grad_fn`` (opake's per-example
clipping) and the noise multiplier are set up first.
"""

import opake.accounting as acc
import opake.dpftrl.accounting as dpftrl_acc
from _common import steps, tiny_problem

params, batch, grad_fn, clip_state = tiny_problem()
lr = 0.05

from opake.dpftrl.noise import mf_gaussian_noise, blt_strategy  # noqa: E402
from opake.random import key  # noqa: E402

# Single participation
strategy = blt_strategy(max_buffers=10)
noise_multiplier = acc.calibrate(  # the page's parameter guide: "Use acc.calibrate()"
    acc.epsilon_budget(2.0, 1e-5),
    lambda sigma: dpftrl_acc.mf_gaussian(sigma, strategy, n_steps=10000, min_sep=1, max_participations=1),
    0.01, 100.0,
).param
noise_fn, noise_state = mf_gaussian_noise(
    grad_template=params,
    strategy=strategy,
    n_steps=10000,
    min_sep=1,
    max_participations=1,
    noise_multiplier=noise_multiplier,
    key=key(42),
)

for step in range(steps(10000)):
    grads, clip_state = grad_fn(params, batch, state=clip_state)
    noisy_grads, noise_state = noise_fn(grads, noise_state)
    params = params - lr * noisy_grads.pytree

print(f"noise multiplier {noise_multiplier:.4f} for epsilon 2 at delta 1e-5; "
      f"{noise_state.step} steps; {clip_state.clipped_examples} of {clip_state.examples} gradients clipped")
