"""Throughput and peak memory of the private training step against the non-private one.

For each model, in one process and interleaved (best of ``--repeats``), times one training step
``zero_grad(); loss.backward(); step()``:

- non-private: the plain model and optimizer (the floor);
- opake: the same model after ``opake.torch.make_private`` (per-example clipping in backward,
  correlated BLT noise in ``step``), on batches of the same size;
- Opacus (DP-SGD, ghost clipping where it has it), when a peer environment is installed at
  ``../peer-opacus`` (``python3 -m venv ../peer-opacus && ../peer-opacus/bin/pip install
  torch==2.13.0 opacus``): the same models through ``benchmarks/peers/opacus_step.py`` in that
  interpreter, never imported here.

It prints steps/s, the DP/non-private throughput ratio (target >= 0.6) and the peak of torch's
live allocations during one step at batch 256 (target <= 1.5x non-private).

Models: the 2-conv CNN of issue 13 (28x28 inputs, 10 classes) and a small transformer (2
layers, d_model 128, 4 heads built from Linear layers, sequence 64, vocabulary 1000).

    python benchmarks/training_step.py             # both models, batch 64 (time) and 256 (memory)
    python benchmarks/training_step.py --quick
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from noise_engine import _peak_allocated_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent
OPACUS = (ROOT.parent.parent / "peer-opacus" / "bin" / "python", ROOT / "peers" / "opacus_step.py")


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    """Pre-norm transformer block; attention from Linear layers (what ghost clipping covers)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.out(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocabulary=1000, width=128, layers=2, heads=4, length=64):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(length, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)  # batch first, as hooks need
        x = self.embed(tokens) + self.position(positions)
        return self.head(self.norm(self.blocks(x)))


def _data(name: str, count: int):
    generator = torch.Generator().manual_seed(0)
    if name == "cnn":
        return torch.utils.data.TensorDataset(torch.randn(count, 1, 28, 28, generator=generator),
                                              torch.randint(0, 10, (count,), generator=generator))
    tokens = torch.randint(0, 1000, (count, 65), generator=generator)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())  # Opacus needs contiguous ids


def _loss(name, model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _model(name):
    torch.manual_seed(0)
    return CNN() if name == "cnn" else Transformer()


def _steps(name: str, batch: int, private: bool, steps: int):
    """A closure running one training step on a fresh batch of ``batch`` examples each call."""
    from opake.random import key
    from opake.torch import make_private

    model = _model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = _data(name, batch * 4)
    if private:
        run = make_private(module=model, optimizer=optimizer, dataset=dataset, batch_size=batch,
                           epochs=max(1, math.ceil(steps / 4)) + 1, noise_multiplier=1.0, target_delta=1e-5,
                           max_grad_norm=1.0, key=key(0))
        model, optimizer = run.module, run.optimizer
    x_all, y_all = dataset.tensors

    def step(index=[0]):
        start = (index[0] % 4) * batch
        index[0] += 1
        optimizer.zero_grad()
        _loss(name, model, x_all[start:start + batch], y_all[start:start + batch]).backward()
        optimizer.step()

    return step


def _best(step, repeats: int) -> float:
    return _best_alternating([step], repeats)[0]


def _best_alternating(steps, repeats: int) -> list[float]:
    """Best time of each step, the steps alternating so that a burst of load elsewhere on the
    machine slows both sides of a ratio rather than one."""
    for step in steps:
        step()  # warm-up
    best = [math.inf] * len(steps)
    for _ in range(repeats):
        for index, step in enumerate(steps):
            start = time.perf_counter()
            step()
            best[index] = min(best[index], time.perf_counter() - start)
    return best


def _opacus(name: str, batch: int, repeats: int):
    python, script = OPACUS
    if not python.exists():
        return None
    out = subprocess.run([str(python), str(script), name, str(batch), str(repeats)], capture_output=True,
                         text=True, cwd=ROOT.parent)
    if out.returncode != 0:
        return None
    seconds, peak = out.stdout.split()
    return float(seconds), int(peak)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    print(f"threads {args.threads}; best of {repeats}; peak = torch's live allocations during one step")
    print(f"{'model':<12} {'batch':>5} | {'plain ms':>8} {'opake ms':>8} {'ratio':>6} | "
          f"{'plain MiB':>9} {'opake MiB':>9} {'ratio':>6} | {'opacus ms':>9} {'ratio':>6} {'MiB':>7}")
    for name in ("cnn", "transformer"):
        for batch in (64, 256):
            plain, private = _steps(name, batch, False, repeats + 2), _steps(name, batch, True, repeats + 2)
            plain_s, private_s = _best_alternating([plain, private], repeats)
            plain_peak, private_peak = _peak_allocated_bytes(plain), _peak_allocated_bytes(private)
            peer = _opacus(name, batch, repeats)
            peer_text = (f"{peer[0] * 1e3:>9.1f} {plain_s / peer[0]:>6.2f} {peer[1] / 2**20:>7.1f}"
                         if peer else f"{'-':>9} {'-':>6} {'-':>7}")
            print(f"{name:<12} {batch:>5} | {plain_s * 1e3:>8.1f} {private_s * 1e3:>8.1f} "
                  f"{plain_s / private_s:>6.2f} | {plain_peak / 2**20:>9.1f} {private_peak / 2**20:>9.1f} "
                  f"{private_peak / plain_peak:>6.2f} | {peer_text}")
    print("ratio = non-private time / DP time (throughput ratio; target >= 0.6); memory ratio target <= 1.5")
    return 0


if __name__ == "__main__":
    sys.exit(main())
