"""Opacus peer for benchmarks/training_step.py; runs in ../peer-opacus's interpreter, never imported.

    ../peer-opacus/bin/python benchmarks/peers/opacus_step.py cnn 64 7 [--quick]

Builds the same model and data as training_step.py (``benchmarks/lib/step_models.py``, plain torch:
nothing of opake's is imported here), makes them private with Opacus' default (fixed batches, no
Poisson sampling, so the step is the same work), with ghost clipping (``grad_sample_mode="ghost"``)
for the CNN and per-sample hooks for the transformer (Opacus' ghost-clipping loss wrapper expects
one loss per example, not per token), and prints the best step time in seconds and the peak of
torch's live allocations during one step, in bytes. Any failure exits non-zero with its error.
"""

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from noise_engine import _peak_allocated_bytes  # noqa: E402  (stdlib and torch only at import)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lib"))
from step_models import SIZES, data, model as build_model  # noqa: E402


def best_seconds(step, repeats: int) -> float:
    step()  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    from opacus import PrivacyEngine

    name, batch, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    size = SIZES["--quick" in sys.argv[4:]]
    torch.set_num_threads(1)
    model = build_model(name, size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = data(name, batch * 4, size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch)
    engine = PrivacyEngine()
    criterion = torch.nn.CrossEntropyLoss()
    if name == "cnn":
        model, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False,
        )
    else:
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode="hooks", poisson_sampling=False,
        )
    x_all, y_all = dataset.tensors

    def step(index=[0]):
        start = (index[0] % 4) * batch
        index[0] += 1
        optimizer.zero_grad()
        out = model(x_all[start:start + batch])
        loss = criterion(out.reshape(-1, out.shape[-1]), y_all[start:start + batch].reshape(-1))
        loss.backward()
        optimizer.step()

    seconds = best_seconds(step, repeats)
    print(seconds, _peak_allocated_bytes(step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
