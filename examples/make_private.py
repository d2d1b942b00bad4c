"""The PyTorch quick start (docs/torch.md), on a small CNN with BatchNorm and dropout.

A standard script: model, SGD with momentum, a cosine schedule, a TensorDataset, the usual loop. The only
private lines are ``fix_model`` (BatchNorm -> GroupNorm) and ``make_private``.
"""

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from opake.random import key
from opake.torch import fix_model, make_private

generator = torch.Generator().manual_seed(0)
images = torch.randn(1024, 1, 12, 12, generator=generator)
labels = (images[:, 0, :6].mean(dim=(1, 2)) > images[:, 0, 6:].mean(dim=(1, 2))).long()
train_ds = torch.utils.data.TensorDataset(images, labels)

model = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * 6 * 6, 2),
)
model = fix_model(model)                              # BatchNorm mixes examples: GroupNorm instead
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # the BLT is optimized for it

private = make_private(module=model, optimizer=optimizer, dataset=train_ds,
                       batch_size=64, epochs=5, target_epsilon=3.0, target_delta=1e-5,
                       max_grad_norm=1.0, key=key(0))   # key: reproducible; omit it for a fresh one
model, optimizer, loader = private.module, private.optimizer, private.data_loader
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5 * len(loader))
model.train()
for epoch in range(5):                                # the usual loop, unchanged: one epoch per pass
    for x, y in loader:
        optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
        scheduler.step()

with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "run.pt"
    torch.save(private.state_dict(), path)            # loadable with weights_only=True
    assert torch.load(path, weights_only=True)["format"] == "opake.torch.PrivateTraining"

model.eval()
with torch.no_grad():
    accuracy = (model(images).argmax(1) == labels).float().mean().item()
plan = private.plan
print(f"{plan.participation}; noise multiplier {private.noise_multiplier:.3f}; epsilon {private.epsilon:.3f} "
      f"(delta {private.delta:g}); training accuracy {accuracy:.3f}")
