"""A complete DP-FTRL training loop: sampler -> per-example clipping -> BLT noise -> torch.optim.

1. The sampler fixes the participation pattern (balls in bins: every example in one random bin,
   bins served cyclically, so every example once per epoch, num_bins steps apart; batch sizes
   vary around num_examples / num_bins) and says what it guarantees.
2. The accountant and the noise engine get exactly that participation; calibrate picks the
   noise multiplier for (epsilon, delta).
3. Each step: clip per-example gradients, add correlated noise, hand the noisy gradients to a
   torch optimizer through ``.grad``. (Plain SGD: the strategy was optimized for prefix sums,
   i.e. momentum 1.0 in blt_strategy; with SGD momentum beta, pass momentum=beta there.)
"""

import torch
from torch.func import functional_call

import opake.accounting as acc
import opake.dpftrl.accounting as dpftrl_acc
from _common import steps
from opake.dpftrl.clipping import clipped_grad
from opake.dpftrl.noise import blt_strategy, mf_gaussian_noise
from opake.dpftrl.sampling import BallsInBinsSampler
from opake.random import key

root = key(7)
generator = torch.Generator().manual_seed(7)
features = torch.randn(2000, 10, generator=generator)
labels = (features[:, 0] + 0.5 * features[:, 1] > 0).long()

model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

epochs = 5
sampler = BallsInBinsSampler(num_examples=2000, num_bins=40, key=root.fold_in("sampler"))  # ~50 a batch
participation = sampler.participation(n_steps=epochs * sampler.num_bins)

strategy = blt_strategy(max_buffers=10)
calibration = acc.calibrate(
    acc.epsilon_budget(4.0, 1e-6),
    lambda sigma: dpftrl_acc.mf_gaussian(sigma, strategy, participation.n_steps, participation.min_sep,
                                         participation.max_participations),
    0.01, 1000.0,
)


def loss_fn(params, example):
    x, y = example
    logits = functional_call(model, params, (x.unsqueeze(0),))
    return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))


grad_fn, clip_state = clipped_grad(loss_fn, clipping_norm=1.0, normalize_by=sampler.expected_batch_size)
params = dict(model.named_parameters())
noise_fn, noise_state = mf_gaussian_noise(
    grad_template=params, strategy=strategy, n_steps=participation.n_steps,
    min_sep=participation.min_sep, max_participations=participation.max_participations,
    noise_multiplier=calibration.param, key=root.fold_in("noise"),
)
noise_fn.check_accounted_by(calibration.process)  # raises unless the accountant priced this noise

for step in range(steps(participation.n_steps)):
    batch = sampler.batch(step)
    grads, clip_state = grad_fn(params, (features[batch], labels[batch]), state=clip_state)
    noisy, noise_state = noise_fn(grads, noise_state)
    for name, parameter in model.named_parameters():
        parameter.grad = noisy.pytree[name]
    optimizer.step()

with torch.no_grad():
    accuracy = (model(features).argmax(1) == labels).float().mean().item()
print(f"{participation}; noise multiplier {calibration.param:.3f} for epsilon {calibration.epsilon:.3f} "
      f"(delta 1e-6); training accuracy {accuracy:.3f}")
