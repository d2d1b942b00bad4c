"""The BLT page's multi-epoch noise example: each unit participates up to 5 times, >= 100 apart."""

from _common import steps, tiny_problem

params, batch, grad_fn, clip_state = tiny_problem()
lr = 0.05
noise_multiplier = 3.0

from opake.dpftrl.noise import mf_gaussian_noise, blt_strategy  # noqa: E402
from opake.random import key  # noqa: E402

# Multi-epoch: each user participates up to 5 times, ≥100 steps apart
strategy = blt_strategy(max_buffers=10)
noise_fn, noise_state = mf_gaussian_noise(
    grad_template=params,
    strategy=strategy,
    n_steps=5000,
    min_sep=100,
    max_participations=5,
    noise_multiplier=noise_multiplier,
    key=key(42),
)

for step in range(steps(5000)):
    grads, clip_state = grad_fn(params, batch, state=clip_state)
    noisy_grads, noise_state = noise_fn(grads, noise_state)
    params = params - lr * noisy_grads.pytree

mech = noise_fn.mechanism
print(f"BLT with {mech.num_buffers} buffers, sensitivity {mech.sensitivity:.4f} for {mech.participation}")
